"""Self-speculative decoding with multi-token heads (Stern et al. 2018 blockwise parallel decoding;
Gloeckle et al. 2024 sec. 3.2; DeepSeek-V3 sec. 5.4.3): the model drafts for itself.

The target and the drafter are one model, so the draft comes free from the last verify forward:
`MTPVerifier` is the loop's target (it returns head 1's next-token logits, like any target) and
also keeps, per absolute position, what the heads saw. Position p = len(committed) - 2 is the
last position whose input is committed; its head 1 predicted the last committed token, so
  - Gloeckle (`GloeckleDrafter`): heads 2..n at p already hold the next n-1 tokens: reading them
    costs nothing;
  - DeepSeek (`DeepSeekDrafter`): module 1 at p takes head 1's hidden state there plus the
    embedding of the last committed token and predicts the next token; module 2 takes module 1's
    state plus that draft token, and so on: a short sequential chain, each module with its own KV
    cache that trails the trunk (module k at position i needs token i+k) and rolls back with it.
Head 1 verifies in the next forward, so greedy output equals the model's own greedy output.
"""
from __future__ import annotations

import torch

from ..core.sampling import SamplingConfig
from ..models.adapters import MTPVerifier
from ..models.mtp import MTPModel
from .base import Drafter, Needs, Proposal, draft_chain


class MTPDrafter(Drafter):
    """Drafts up to n-1 tokens, one head (or module) after the other, from the last committed position."""
    needs = Needs(best_first=True)      # a chain

    def __init__(self, verifier: MTPVerifier):
        self.verifier, self.model = verifier, verifier.model
        self.name = f"mtp-{self.model.cfg.kind}{self.model.cfg.n_future}"
        self.max_draft = self.model.cfg.n_future - 1

    def head_logits(self, i: int, p: int, seq: list[int]) -> torch.Tensor:
        """Logits (V,) of draft token i (0-based) after position p; `seq`: the committed tokens and drafts so far."""
        raise NotImplementedError

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> Proposal:
        p, k = tokens.numel() - 2, min(k, self.max_draft)         # p: last position with a committed input
        if p < 0 or k == 0:                                       # a one-token prompt: nothing seen yet
            return Proposal.empty(tokens)
        seq = tokens.tolist()

        def feed(i: int, x: torch.Tensor) -> torch.Tensor:
            seq.append(int(x))
            return self.head_logits(i + 1, p, seq)                                          # (V,)
        return draft_chain(self.head_logits(0, p, seq), feed, k, sampling, generator)


class GloeckleDrafter(MTPDrafter):
    """Gloeckle heads 2..n: their outputs at position p, kept by the verifier, are the draft."""

    def head_logits(self, i, p, seq):
        return self.verifier.future_logits[p, i]                                           # (V,)


class DeepSeekDrafter(MTPDrafter):
    """DeepSeek-V3's sequential modules, each with a KV cache that trails the trunk's."""

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        S, D = self.model.cfg.max_seq_len, self.model.cfg.dim
        self.module_caches = [self.model.new_module_cache() for _ in range(self.max_draft)]
        self.module_hidden = [torch.zeros(S, D, device=self.model.device) for _ in range(self.max_draft)]

    def head_logits(self, k: int, p: int, seq: list[int]) -> torch.Tensor:
        """Module k (0-based) caught up to position p; its logits there (V,) predict token p+k+2."""
        cache = self.module_caches[k]
        first = cache.length                                                               # positions first..p are new
        h_prev = (self.verifier.head1_hidden if k == 0 else self.module_hidden[k - 1])[first:p + 1]   # (n, D)
        next_tokens = torch.tensor(seq[first + k + 1:p + k + 2], device=self.model.device)          # (n,)
        h = self.model.module_hidden(k, h_prev[None], next_tokens[None], cache)[0]          # (n, D)
        self.module_hidden[k][first:p + 1] = h
        return self.model.module_logits(k, h[-1])                                          # (V,)

    def commit(self, n_cached: int, features: torch.Tensor | None = None, verdict: torch.Tensor | None = None) -> None:
        """Module k keeps position i only while token i+k+1 is among the first n_cached (committed) tokens."""
        for k, cache in enumerate(self.module_caches):
            cache.truncate(max(0, min(cache.length, n_cached - k - 1)))


def self_speculative(model: MTPModel) -> tuple[MTPVerifier, MTPDrafter]:
    """The (target, drafter) pair for SpeculativeDecoder: both views of one MTP model."""
    verifier = MTPVerifier(model)
    drafter = GloeckleDrafter if model.cfg.kind == "gloeckle" else DeepSeekDrafter
    return verifier, drafter(verifier)
