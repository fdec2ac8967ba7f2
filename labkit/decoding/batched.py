"""Batched speculative decoding: B sequences at once, each accepting its own number of tokens.

One KV cache holds all B rows and its write pointer moves for all of them together; what
differs per row is which slots count. `RaggedCache` records, for every row and slot, the
token position the slot holds (-1: padding or rolled back). A query at position p sees the
row's slots holding positions <= p, and each row's RoPE positions are its own, so left
padding (prompts of different lengths) and rows accepting different counts are both the
same thing: slots a row ignores. Rollback is per row (`truncate_rows`); the shared cache then
drops the slots no row keeps. The native model's explicit `positions` and `mask` arguments
carry all of it: no change to the model.

Greedy mode is exact per row (each row equals its own greedy autoregressive decoding); the
acceptance runs for all rows at once through kernels.greedy_accept / sampled_accept (a
fused Triton kernel on a GPU, the torch reference elsewhere). Draft models only: a drafter
with its own per-sequence state (labkit.drafters) would need a batched interface first.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

import kernels

from ..core.sampling import (
    GREEDY,
    SamplingConfig,
    next_token,
    probs_from_logits,
    sample,
)
from ..drafters.draft_model import check_draft_model
from .base import check_request, cut, finished, seeded


class RaggedCache:
    """A KVCache shared by B rows that hold different numbers of tokens."""

    def __init__(self, model, batch_size: int, max_len: int):
        self.model = model
        self.cache = model.new_cache(batch_size, max_len)
        self.slot_pos = torch.full((batch_size, max_len), -1, dtype=torch.long)       # (B, S) position, -1 none
        self.length = torch.zeros(batch_size, dtype=torch.long)                        # (B,) tokens held per row

    def feed(self, tokens: torch.Tensor, n_real: torch.Tensor) -> torch.Tensor:
        """Append row b's last n_real[b] tokens of `tokens` (B, T) (the rest is padding); logits (B, T, V)."""
        B, T = tokens.shape
        L = self.cache.length
        real = torch.arange(T)[None, :] >= (T - n_real)[:, None]                        # (B, T)
        positions = self.length[:, None] + real.long().cumsum(1) - 1                   # (B, T); pads: length-1
        positions = positions.clamp(min=0)
        self.slot_pos[:, L:L + T] = torch.where(real, positions, -1)
        held = self.slot_pos[:, :L + T]                                                # (B, S)
        mask = (held[:, None, :] >= 0) & (held[:, None, :] <= positions[:, :, None])   # (B, T, S)
        mask[:, torch.arange(T), L + torch.arange(T)] = True                           # a pad sees itself: no empty row
        device = self.model.device
        logits = self.model(tokens.to(device), self.cache, positions=positions.to(device),
                            mask=mask[:, None].to(device))                             # (B, T, V)
        self.length += n_real
        return logits.cpu()

    def truncate_rows(self, lengths: torch.Tensor) -> None:
        """Keep each row's first lengths[b] tokens; drop the slots no row holds any more."""
        if bool((lengths > self.length).any()) or bool((lengths < 0).any()):
            raise ValueError(f"cannot truncate rows holding {self.length.tolist()} tokens to {lengths.tolist()}")
        self.slot_pos[self.slot_pos >= lengths[:, None]] = -1
        self.length = lengths.clone()
        used = torch.nonzero((self.slot_pos[:, :self.cache.length] >= 0).any(0))
        self.cache.truncate(int(used[-1]) + 1 if used.numel() else 0)


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-aligned token rows (B, T) padded with 0 on the left, and each row's real count (B,)."""
    T = max(len(r) for r in rows)
    return torch.tensor([[0] * (T - len(r)) + r for r in rows]).long(), torch.tensor([len(r) for r in rows])


@dataclass
class BatchedGeneration:
    tokens: list[list[int]]                  # each row's new tokens (prompt excluded)
    n_accepted: list[list[int]] = field(default_factory=list)   # per step, per row (empty for autoregressive)
    n_forwards: int = 0                      # target forwards after the prefill
    gamma: int = 0                           # draft tokens per step (0: autoregressive)
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens over the steps where a row was still decoding."""
        counted = [n for step in self.n_accepted for n in step if n is not None]
        return sum(counted) / (self.gamma * len(counted)) if counted and self.gamma else float("nan")


def _check_batch(model, prompts: list[torch.Tensor], max_new_tokens: int) -> list[list[int]]:
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of 1-D token-id tensors, one per row")
    return [check_request(model, p, max_new_tokens).tolist() for p in prompts]


@torch.no_grad()
def batched_autoregressive_generate(model, prompts: list[torch.Tensor], max_new_tokens: int,
                                    sampling: SamplingConfig = GREEDY, eos_token_ids: tuple[int, ...] = (),
                                    seed: int | None = None, clock=time.perf_counter) -> BatchedGeneration:
    """The baseline: one forward of B tokens per step. prompts: B tensors (T_b,) of any lengths.

    clock: what the timings use; time.thread_time (with one torch thread) is stable on a shared CPU.
    """
    rows, generator, eos = _check_batch(model, prompts, max_new_tokens), seeded(seed), set(eos_token_ids)
    t0 = clock()
    cache = RaggedCache(model, len(rows), max(map(len, rows)) + max_new_tokens)
    logits = cache.feed(*left_pad(rows))[:, -1]                                        # (B, V)
    out = BatchedGeneration([[] for _ in rows], prefill_time=clock() - t0)
    while True:
        token = next_token(logits, sampling, generator)                               # (B,)
        for b, new in enumerate(out.tokens):
            if not finished(new, eos, max_new_tokens):
                new.append(int(token[b]))
        if all(finished(new, eos, max_new_tokens) for new in out.tokens):
            break
        t1 = clock()
        logits = cache.feed(token[:, None], torch.ones(len(rows), dtype=torch.long))[:, -1]  # (B, V)
        out.verify_time += clock() - t1
        out.n_forwards += 1
    out.tokens = [cut(new, eos, max_new_tokens) for new in out.tokens]
    out.total_time = clock() - t0
    return out


@torch.no_grad()
def batched_speculative_generate(target, draft, prompts: list[torch.Tensor], max_new_tokens: int, gamma: int = 4,
                                 sampling: SamplingConfig = GREEDY, eos_token_ids: tuple[int, ...] = (),
                                 seed: int | None = None, clock=time.perf_counter) -> BatchedGeneration:
    """Speculative decoding of B prompts with a draft model: every row drafts γ, one target forward verifies all."""
    if not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"gamma (draft tokens per step) must be an integer >= 1, got {gamma!r}")
    rows, generator, eos = _check_batch(target, prompts, max_new_tokens), seeded(seed), set(eos_token_ids)
    check_draft_model(target, draft)
    B, t0 = len(rows), clock()
    max_len = max(map(len, rows)) + (gamma + 2) * (max_new_tokens + 1)                 # worst case: 1 token a step
    tgt, drf = RaggedCache(target, B, max_len), RaggedCache(draft, B, max_len)
    if max(map(len, rows)) > 1:                                                        # caches hold all but the last
        feed, n_real = left_pad([r[:-1] for r in rows])
        tgt.feed(feed, n_real), drf.feed(feed, n_real)
    out = BatchedGeneration([[] for _ in rows], gamma=gamma, prefill_time=clock() - t0)
    while not all(finished(new, eos, max_new_tokens) for new in out.tokens):
        seqs = [r + new for r, new in zip(rows, out.tokens)]
        # 1. Propose: the draft catches up on the committed tokens it has not seen, then drafts γ
        t1 = clock()
        logits = drf.feed(*left_pad([s[int(drf.length[b]):] for b, s in enumerate(seqs)]))[:, -1]  # (B, V)
        drafted, q_rows = [], []
        for i in range(gamma):
            q = probs_from_logits(logits, sampling)                                    # (B, V)
            x = logits.argmax(-1) if sampling.greedy else sample(q, generator)         # (B,)
            drafted.append(x), q_rows.append(q)
            if i < gamma - 1:
                logits = drf.feed(x[:, None], torch.ones(B, dtype=torch.long))[:, -1]  # (B, V)
        draft_tokens = torch.stack(drafted, 1)                                         # (B, K)
        # 2. Verify: one target forward over [last committed token, draft...] for every row
        t2 = clock()
        feed = torch.cat([torch.tensor([s[-1] for s in seqs])[:, None], draft_tokens], 1)   # (B, K+1)
        logits = tgt.feed(feed, torch.full((B,), gamma + 1))                           # (B, K+1, V)
        t3 = clock()
        # 3. Accept: each row's longest agreeing prefix, plus one token of the target's
        if sampling.greedy:
            n_accepted, next_tokens = kernels.greedy_accept(draft_tokens, logits)
        else:
            u = torch.rand(B, gamma, generator=generator)                              # (B, K)
            acc = kernels.sampled_accept(draft_tokens, torch.stack(q_rows, 1), probs_from_logits(logits, sampling), u)
            n_accepted, next_tokens = acc.n_accepted, kernels.sample_next(acc, generator)
        # 4. Commit: extend each live row; roll both caches back to each row's committed tokens but the last
        step = []
        for b, new in enumerate(out.tokens):
            live = not finished(new, eos, max_new_tokens)
            if live:
                new += draft_tokens[b, :n_accepted[b]].tolist() + [int(next_tokens[b])]
                new[:] = cut(new, eos, max_new_tokens)
            step.append(int(n_accepted[b]) if live else None)
        held = torch.tensor([len(r) + len(new) - 1 for r, new in zip(rows, out.tokens)])   # (B,)
        tgt.truncate_rows(torch.minimum(held, tgt.length))
        drf.truncate_rows(torch.minimum(held, drf.length))
        out.n_accepted.append(step)
        out.draft_time += t2 - t1
        out.verify_time += t3 - t2
        out.n_forwards += 1
    out.tokens = [cut(new, eos, max_new_tokens) for new in out.tokens]
    out.total_time = clock() - t0
    return out
