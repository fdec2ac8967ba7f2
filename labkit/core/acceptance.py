"""Acceptance rules: which draft tokens the target keeps, and the token it adds.

Both rules look at K draft tokens and the target's K+1 distributions from one verify pass
(position i predicts the token after draft token i-1; the last one follows the whole draft).
They return the accepted count and one more token: a correction where a draft token was
rejected, or the "bonus" token when all K were accepted. Either way one verify pass yields
between 1 and K+1 tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import argmax, sample


@dataclass(frozen=True)
class Acceptance:
    """What one verify pass kept: for one sequence (ints), or for B rows at once (tensors (B,), what the batched
    kernels in labkit.kernels return)."""
    n_accepted: int | torch.Tensor           # leading draft tokens kept, 0..K
    next_token: int | torch.Tensor | None    # the correction (rejected position) or the bonus token (all accepted);
                                             # None while it is still to be drawn from next_probs
    bonus: bool | torch.Tensor               # True when all K draft tokens were accepted
    next_probs: torch.Tensor | None = None   # (B, V) a batched sampled verify: the residual (or p, for the bonus)
                                             # that next_token is drawn from (kernels.sample_next)

    def tokens(self, draft_tokens: torch.Tensor) -> list[int]:
        """The tokens this step commits: the accepted prefix and the next token."""
        return draft_tokens[: self.n_accepted].tolist() + [self.next_token]


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Acceptance:
    """Keep the longest prefix equal to the target's argmax; exact for greedy decoding.

    draft_tokens: (K,), target_logits: (K+1, V).
    """
    draft = draft_tokens.tolist()
    for n in range(len(draft) + 1):          # row by row: a row's argmax reads a vocabulary, so stop at the first miss
        pick = int(argmax(target_logits[n]))
        if n == len(draft) or pick != draft[n]:
            return Acceptance(n, pick, bonus=n == len(draft))


def speculative_accept(draft_tokens: torch.Tensor, q_draft: torch.Tensor, p_target: torch.Tensor,
                       generator: torch.Generator | None = None) -> Acceptance:
    """Rejection sampling of Leviathan et al. 2023 / Chen et al. 2023: output ~ p_target exactly.

    Token x_i is kept with probability min(1, p_target(x_i) / q_draft(x_i)); at the first
    rejection the replacement is drawn from the residual norm(max(0, p_target - q_draft)).
    draft_tokens: (K,), q_draft: (K, V), p_target: (K+1, V).
    """
    K = draft_tokens.shape[0]
    idx = torch.arange(K)
    p_x = p_target[idx, draft_tokens]                                        # (K,)
    q_x = q_draft[idx, draft_tokens]                                         # (K,)
    u = torch.rand(K, generator=generator)                                   # (K,)
    accepted = (u * q_x < p_x).int()                                         # u < p/q without dividing by 0
    n = int(accepted.cumprod(0).sum())
    if n == K:
        return Acceptance(K, int(sample(p_target[K], generator)), bonus=True)
    residual = (p_target[n] - q_draft[n]).clamp(min=0)                       # (V,)
    if residual.sum() <= 0:  # p == q up to rounding: then the residual is p itself
        residual = p_target[n]
    return Acceptance(n, int(sample(residual / residual.sum(), generator)), bonus=False)
