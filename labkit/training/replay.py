"""Acceptance replayed on held-out features: what a greedy chain drafter would get accepted, without the target.

On the target's own greedy text (self-distilled answers, features.py --distilled) the verify step's
outcome is already known: the target's next token after position t is `target_next[t]`. A chain
drafter started at root t (the target's features up to t, the bonus token x_{t+1} committed) guesses
x_{t+2}, x_{t+3}, ...; its step k is accepted when it and every step before it equal the target's
tokens. So at every root of a held-out sequence, one teacher-forced pass of the head gives

    accepted(t) = #{leading steps k with guess_k(t) == target_next[t+1+k]}
    tokens per forward (chain of depth K) = 1 + mean_t accepted(t)

exactly what greedy chain decoding measures, averaged over every root instead of the roots the
decoding happens to visit, and at the cost of a head forward instead of target forwards. EAGLE
heads are replayed with their training-time-test unroll (eagle3.unrolled_logits, which feeds step
k the token x_{t+1+k}: the drafted token whenever the steps before it were accepted); Medusa's
head k reads h_t alone. A step whose teacher-forced input is not the target's own token (prompt
text, where tokens[t+1+k] != target_next[t+k]) ends the chain: the replay never credits a guess
that decoding could not have made. The roots averaged over are those where the target speaks next
(x_{t+2} is its own token): the answers, and the last token of each prompt.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ChainReplay:
    tokens_per_forward: float          # 1 + mean accepted steps over the roots
    step_acceptance: list[float | None]  # P(step k accepted | steps < k accepted), k = 0..K-1 (None: never reached)
    roots: int                         # roots replayed (positions whose next token is the target's own)


def chain_accepts(guesses: torch.Tensor, tokens: torch.Tensor, target_next: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted steps (B, n), root mask (B, n)) of chains at roots t = 0..n-1 from guesses (B, n, K) in
    the target's vocabulary: guess k at root t is for the token after x_{t+1+k}, i.e. target_next[t+1+k]."""
    B, n, K = guesses.shape
    T = tokens.shape[1]
    t = torch.arange(n, device=tokens.device)
    own = torch.zeros(B, T, dtype=torch.bool, device=tokens.device)                     # own[i]: x_i is the target's token
    own[:, 1:] = tokens[:, 1:] == target_next[:, :-1]
    ok = torch.ones(B, n, dtype=torch.bool, device=tokens.device)
    accepted = torch.zeros(B, n, dtype=torch.long, device=tokens.device)
    for k in range(K):
        i = t + 1 + k                                                                  # (n,) step k's input position
        inside = i <= T - 1
        i = i.clamp(max=T - 1)
        fed = own[:, i] if k else torch.ones_like(ok)                                  # x_{t+1} is committed, any text
        ok = ok & inside & fed & (guesses[:, :, k] == target_next[:, i])                # (B, n)
        accepted += ok
    roots = own[:, (t + 2).clamp(max=T - 1)] & (t + 2 <= T - 1)                         # (B, n) x_{t+2} is the target's
    return accepted, roots


def summarize(accepted: torch.Tensor, roots: torch.Tensor, K: int) -> ChainReplay:
    a = accepted[roots]                                                                # (R,)
    reached = [(a >= k).sum().item() for k in range(K + 1)]
    return ChainReplay(1 + a.float().mean().item() if a.numel() else float("nan"),
                       [reached[k + 1] / reached[k] if reached[k] else None for k in range(K)], int(a.numel()))


@torch.no_grad()
def eagle_guesses(head, embed, lm_rows: torch.Tensor, draft_vocab: torch.Tensor, tokens: torch.Tensor,
                  features: torch.Tensor, steps: int) -> torch.Tensor:
    """(B, T-1, steps) the head's greedy guesses at every root, in the target's vocabulary; features (B, T, *)
    are what the head reads from the target (final hidden states for EAGLE-1, the tapped blocks for EAGLE-3)."""
    from .eagle_loss import unrolled_logits
    logits = unrolled_logits(head, embed, lm_rows, tokens, features, steps)            # steps x (B, n, Vd)
    return draft_vocab[torch.stack([lg.argmax(-1) for lg in logits], dim=-1)]          # (B, n, steps)


@torch.no_grad()
def medusa_guesses(heads, hidden: torch.Tensor, vocab_ids: torch.Tensor | None = None, chunk: int = 512) -> torch.Tensor:
    """(B, T-1, K) head k's top-1 at root t, read from h_t (the state whose LM-head readout is the bonus token
    x_{t+1}): the guess for the token after x_{t+1+k}. vocab_ids: the target's id of each row of the heads'
    LM head when it reads a sub-vocabulary (None: it reads the full vocabulary)."""
    B, T, D = hidden.shape
    flat = hidden[:, :-1].reshape(-1, D)                                               # (B (T-1), D)
    best = torch.cat([heads(part.to(heads.dtype)).argmax(-1).T for part in flat.split(chunk)])  # (B (T-1), K)
    return (best if vocab_ids is None else vocab_ids[best]).reshape(B, T - 1, -1)


def replay_heldout(fs, guesses_of, batch_size: int = 8) -> dict:
    """{source: {tokens_per_forward, roots, step_acceptance}} of a chain on a FeatureSet's held-out rows, code and
    chat apart; guesses_of(rows) gives the chain's guesses (b, T-1, K) for those held-out rows (a LongTensor)."""
    tokens, _, target_next = fs.split("heldout")
    out = {}
    for source, sl in fs.heldout_rows().items():
        accepted, roots = [], []
        for r in torch.arange(sl.start, sl.stop).split(batch_size):
            guesses = guesses_of(r)                                                    # (b, T-1, K)
            a, m = chain_accepts(guesses, tokens[r], target_next[r])
            accepted.append(a)
            roots.append(m)
        rep = summarize(torch.cat(accepted), torch.cat(roots), guesses.shape[-1])
        out[source] = {"tokens_per_forward": round(rep.tokens_per_forward, 4), "roots": rep.roots,
                       "step_acceptance": [x if x is None else round(x, 4) for x in rep.step_acceptance]}
        print(f"held out, {source}: greedy {guesses.shape[-1]}-deep chain replayed at {rep.roots} roots: "
              f"{rep.tokens_per_forward:.3f} tokens per forward")
    return out
