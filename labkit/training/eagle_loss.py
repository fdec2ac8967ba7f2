"""What an EAGLE head is trained to minimise: EAGLE-1's feature regression + token loss, and EAGLE-3's
training-time test (Li et al. 2025), which unrolls the head on its own outputs as drafting does.

EAGLE-3's training-time test (`unrolled_logits`): step 0 reads the fused target features at every
position t; step k reads its own step k-1 output at t with the token x_{t+1+k}, at RoPE position
t+k, and attends to the target-fed entries up to t and to its own entries of steps 1..k at t:
exactly what a chain drafted k deep from root t attends to.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models.eagle_heads import Eagle3Head, EagleHead


def vocab_index(draft_vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(vocab_size,) the position of each target token id in the draft vocabulary, -1 where it is not in it."""
    vocab_map = torch.full((vocab_size,), -1, dtype=torch.long)
    vocab_map[draft_vocab] = torch.arange(draft_vocab.numel())
    return vocab_map


def eagle_loss(head: EagleHead, embed: torch.nn.Embedding, lm_rows: torch.Tensor, vocab_map: torch.Tensor,
               tokens: torch.Tensor, hidden: torch.Tensor, target_next: torch.Tensor, cls_weight: float = 0.1,
               noise: float = 0.0, bf16: bool = False):
    """(loss, regression loss, classification loss, top-1 correct, count) on sequences tokens (B, T).

    Pair t = (hidden[:, t], tokens[:, t+1]) predicts hidden[:, t+1] and target_next[:, t+1].
    """
    B, T = tokens.shape
    f_in = hidden[:, :-1].float()                                                       # (B, T-1, D)
    if noise:
        f_in = f_in + (torch.rand_like(f_in) - 0.5) * 2 * noise                          # EAGLE's input noise
    f_true = hidden[:, 1:].float()                                                      # (B, T-1, D)
    labels = vocab_map[target_next[:, 1:]]                                              # (B, T-1) in the draft vocab
    cache = head.new_cache(T, batch_size=B, dtype=torch.float32, device=f_in.device)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        f_hat = head(f_in, embed(tokens[:, 1:]).float(), cache)                         # (B, T-1, D)
        logits = f_hat @ lm_rows.T.to(f_hat.dtype)                                      # (B, T-1, Vd)
    f_hat, logits = f_hat.float(), logits.float()
    reg = F.smooth_l1_loss(f_hat, f_true)
    valid = labels >= 0                                                                 # held-out tokens may be outside
    cls = F.cross_entropy(logits[valid], labels[valid])
    correct = int((logits.argmax(-1) == labels)[valid].sum())
    return reg + cls_weight * cls, float(reg.detach()), float(cls.detach()), correct, int(valid.sum())


class GradCache:
    """A one-layer KV cache that grows by concatenation, out of place, so that gradients flow through every
    unrolled step (KVCache writes into a preallocated buffer in place, which autograd cannot differentiate)."""

    def __init__(self):
        self.k = self.v = None
        self.length = 0

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        self.k = k_new if self.k is None else torch.cat([self.k, k_new], dim=2)          # (B, Hkv, S, hd)
        self.v = v_new if self.v is None else torch.cat([self.v, v_new], dim=2)
        return self.k, self.v

    def advance(self, n_tokens: int) -> None:
        self.length += n_tokens


def unrolled_masks(n: int, k: int) -> torch.Tensor:
    """(n, (k+1) n) bool: step k's query at t sees the target-fed entries <= t and its own entries at t of
    steps 1..k (the training-time test's attention: a chain k deep from root t sees exactly these)."""
    t = torch.arange(n)
    causal = t[None, :] <= t[:, None]                                                  # (n, n)
    return torch.cat([causal] + [torch.eye(n, dtype=torch.bool)] * k, dim=1)


def unrolled_logits(head: Eagle3Head, embed: nn.Embedding, lm_rows: torch.Tensor, tokens: torch.Tensor,
                    taps: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Training-time test: [step k's draft logits (B, n, Vd) for k < steps], n = T - 1 roots t = 0..T-2.

    tokens (B, T); taps (B, T, 3D) the target's tapped features. Step k at root t reads x_{t+1+k} (clamped at
    the end; those rows have no label) and predicts the target's token after it, target_next[t+1+k]."""
    if steps < 1:
        raise ValueError(f"steps (training-time test depth) must be >= 1, got {steps}")
    B, T = tokens.shape
    n = T - 1
    t = torch.arange(n, device=tokens.device)
    a = head.context(taps[:, :n])                                                      # (B, n, D) step 0 input
    cache = GradCache()
    out = []
    for k in range(steps):
        ids = tokens[:, (t + 1 + k).clamp(max=T - 1)]                                  # (B, n)
        positions = (t + k).expand(B, n)                                               # (B, n)
        a = head(a, embed(ids).to(a.dtype), cache, positions, unrolled_masks(n, k).to(a.device))  # (B, n, D)
        out.append(head.readout_input(a) @ lm_rows.T.to(a.dtype))                      # (B, n, Vd)
    return out


@dataclass
class TTTLoss:
    loss: torch.Tensor                # the weighted mean over steps of the cross-entropy
    per_step: list[float]             # cross-entropy of each step
    correct: list[int]                # top-1 hits of each step
    count: list[int]                  # labelled rows of each step


def eagle3_loss(head: Eagle3Head, embed: nn.Embedding, lm_rows: torch.Tensor, vocab_map: torch.Tensor,
                tokens: torch.Tensor, taps: torch.Tensor, target_next: torch.Tensor, steps: int = 1,
                decay: float = 0.8) -> TTTLoss:
    """Cross-entropy against the target's greedy tokens at each unrolled step, step k weighted decay**k
    (the reference weights deeper steps less too). labels outside the draft vocabulary are skipped."""
    B, T = tokens.shape
    t = torch.arange(T - 1, device=tokens.device)
    losses, per_step, correct, count = [], [], [], []
    for k, logits in enumerate(unrolled_logits(head, embed, lm_rows, tokens, taps, steps)):
        idx = t + 1 + k                                                                # (n,)
        labels = vocab_map[target_next[:, idx.clamp(max=T - 1)]]                        # (B, n)
        valid = (labels >= 0) & (idx <= T - 1)                                          # (B, n)
        ce = F.cross_entropy(logits[valid].float(), labels[valid])
        losses.append(decay ** k * ce)
        per_step.append(float(ce.detach()))
        correct.append(int((logits.argmax(-1) == labels)[valid].sum()))
        count.append(int(valid.sum()))
    loss = sum(losses) / sum(decay ** k for k in range(steps))
    return TTTLoss(loss, per_step, correct, count)
