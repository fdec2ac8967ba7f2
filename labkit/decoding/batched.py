"""Batched decoding: B sequences at once, each accepting its own number of tokens per step.

The target's `RaggedCache` (labkit.models.ragged_cache) lets rows of different lengths share one
cache and roll back by different amounts. The drafter is any chain drafter, drafting for all
rows through `rows_of`: a drafter whose needs say `rows` (the draft model) drafts every row in the
same forwards, any other as `RowCopies`, one copy per row. A row proposes at most γ tokens and may
propose fewer (or none); the verify forward right-aligns the rows, and `accept_rows` caps each
row's acceptance at its own proposal length.

Greedy mode is exact per row in exact arithmetic: each row's tokens are its own greedy
autoregressive decoding. (Padded rows run through matrix kernels of another shape than a lone
row, so on real models a near-tie between two logits can flip in low precision.) The acceptance
runs for all rows at once through kernels.greedy_accept / sampled_accept (a fused Triton kernel
on a GPU, the torch reference elsewhere). Every row gets its own `Generation` and trace; the
step times in each are the whole batch's.
"""
from __future__ import annotations

import copy
import time

import torch

from .. import kernels
from ..core.sampling import (
    GREEDY,
    SamplingConfig,
    next_token,
    probs_from_logits,
    sample,
)
from ..core.trace import Step, Trace
from ..drafters.base import Drafter, Proposal
from ..models.ragged_cache import RaggedCache, left_pad, unpad
from ..models.target import Target
from .base import (
    Generation,
    check_drafter,
    check_eos,
    check_request,
    check_sampling,
    cut,
    finished,
    finished_message,
    seeded,
)


class BatchDecoder:
    """B rows decoded together: the batch's `Decoder`. It keeps prompts, new tokens and a trace per row and the
    shared clock; each `step()` is one target forward for every live row, and `run()` steps until every row is
    done and returns one `Generation` per row. A subclass sets up its caches and implements `_advance()`."""

    def begin(self, target: Target, prompts: list[torch.Tensor], max_new_tokens: int, method: str,
              eos_token_ids: tuple[int, ...], seed: int | None, clock, sampling: SamplingConfig) -> None:
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of 1-D token-id tensors, one per row")
        self.prompts = [check_request(target, p, max_new_tokens).tolist() for p in prompts]
        check_sampling(sampling)
        self.new: list[list[int]] = [[] for _ in prompts]
        self.traces = [Trace(method=method, prompt_len=len(p)) for p in self.prompts]
        self.max_new_tokens, self.eos, self.clock = max_new_tokens, set(check_eos(eos_token_ids)), clock
        self.generator, self.sampling = seeded(seed), sampling
        self.t0 = clock()
        self.prefill_time = 0.0

    @property
    def done(self) -> bool:
        return not any(self.live)

    def step(self) -> None:
        """One forward for every live row; a batch whose rows have all finished refuses."""
        if self.done:
            raise RuntimeError(finished_message("every row", sum(map(len, self.new))))
        self._advance()

    def _advance(self) -> None:
        raise NotImplementedError

    def run(self) -> list[Generation]:
        """Step until every row has reached EOS or max_new_tokens."""
        while not self.done:
            self.step()
        return self.result()

    @property
    def live(self) -> list[bool]:
        return [not finished(new, self.eos, self.max_new_tokens) for new in self.new]

    def sequence(self, b: int) -> list[int]:
        return self.prompts[b] + self.new[b]

    def commit(self, b: int, tokens: list[int], step: Step) -> None:
        """Append row b's step: its new tokens (cut after EOS and at the limit) and the step's trace."""
        self.new[b] = cut(self.new[b] + tokens, self.eos, self.max_new_tokens)
        trace = self.traces[b]
        trace.steps.append(step)
        trace.n_generated = len(self.new[b])
        if not finished(self.new[b], self.eos, self.max_new_tokens):
            return
        trace.stop_reason = "eos" if any(t in self.eos for t in self.new[b]) else "max_new_tokens"

    def result(self) -> list[Generation]:
        total = self.clock() - self.t0
        for trace in self.traces:
            trace.prefill_time, trace.total_time = self.prefill_time, total
        return [Generation(new, trace) for new, trace in zip(self.new, self.traces)]


class BatchedAutoregressiveDecoder(BatchDecoder):
    """The baseline: one forward of B tokens per step. prompts: B tensors (T_b,) of any lengths."""

    @torch.no_grad()
    def __init__(self, model: Target, prompts: list[torch.Tensor], max_new_tokens: int,
                 sampling: SamplingConfig = GREEDY, eos_token_ids: tuple[int, ...] = (), seed: int | None = None,
                 clock=time.perf_counter):
        self.begin(model, prompts, max_new_tokens, "batched/autoregressive", eos_token_ids, seed, clock, sampling)
        B = len(self.prompts)
        self.cache = RaggedCache(model, B, max(map(len, self.prompts)) + max_new_tokens)
        self.logits = self.cache.feed(*left_pad(self.prompts))[:, -1]                    # (B, V)
        self.prefill_time, self.verify_time = clock() - self.t0, 0.0

    @torch.no_grad()
    def _advance(self) -> None:
        """Each live row takes its next token from the last forward; then one forward feeds them all."""
        token = next_token(self.logits, self.sampling, self.generator)                  # (B,)
        for b, live in enumerate(self.live):
            if live:
                self.commit(b, [int(token[b])], Step([], 0, int(token[b]), True, 0.0, self.verify_time))
        if self.done:
            return
        t1 = self.clock()
        self.logits = self.cache.feed(token[:, None], torch.tensor(self.live).long())[:, -1]   # (B, V)
        self.verify_time = self.clock() - t1


def batched_autoregressive_generate(model: Target, prompts: list[torch.Tensor], max_new_tokens: int,
                                    sampling: SamplingConfig = GREEDY, eos_token_ids: tuple[int, ...] = (),
                                    seed: int | None = None, clock=time.perf_counter) -> list[Generation]:
    """The baseline over B prompts (BatchedAutoregressiveDecoder.run).

    clock: what the timings use; time.thread_time (with one torch thread) is stable on a shared CPU.
    """
    return BatchedAutoregressiveDecoder(model, prompts, max_new_tokens, sampling, eos_token_ids, seed, clock).run()


def accept_rows(draft: torch.Tensor, k: torch.Tensor, logits: torch.Tensor, q_draft: torch.Tensor | None,
                sampling: SamplingConfig, generator: torch.Generator | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's accepted count (B,) and next token (B,) when row b proposed only its first k[b] tokens.

    draft (B, K) is padded past k[b] (any ids), logits (B, K+1, V) are left-aligned, and q_draft
    (B, K, V) is zero past k[b]: a zero q makes the residual at k[b] the target's p itself, so a row
    that keeps all k[b] tokens draws its bonus token from p_target[k[b]], as a lone row would.
    """
    B, K = draft.shape
    rows = torch.arange(B)
    if K == 0:
        return torch.zeros(B, dtype=torch.long), next_token(logits[:, 0], sampling, generator)
    if sampling.greedy:
        acc = kernels.greedy_accept(draft, logits)
        n = torch.minimum(acc.n_accepted.cpu(), k)                                     # (B,) padding never counts
        return n, torch.where(n == acc.n_accepted.cpu(), acc.next_token.cpu(), logits[rows, n].argmax(-1))
    p_target = probs_from_logits(logits, sampling)                                     # (B, K+1, V)
    u = torch.rand(B, K, generator=generator)                                          # (B, K)
    acc = kernels.sampled_accept(draft, q_draft, p_target, u)
    n = torch.minimum(acc.n_accepted.cpu(), k)                                         # (B,)
    next_probs = torch.where((n < acc.n_accepted.cpu())[:, None], p_target[rows, n], acc.next_probs.cpu())  # (B, V)
    return n, sample(next_probs, generator)


class RowCopies:
    """Any one-sequence drafter for B rows: a copy per row, started on its prompt, each row proposing on its own."""

    def __init__(self, drafter: Drafter, prompts: list[torch.Tensor]):
        self.drafters = [copy.copy(drafter) for _ in prompts]
        for row, prompt in zip(self.drafters, prompts):
            row.start(prompt)

    def propose(self, rows: list[torch.Tensor], k: list[int], sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> list[Proposal]:
        """Row b's proposal of at most k[b] nodes after its committed tokens rows[b] (N_b,); k[b] = 0: none."""
        return [drafter.propose(tokens, n, sampling, generator) if n > 0 else Proposal.empty(tokens)
                for drafter, tokens, n in zip(self.drafters, rows, k)]

    def commit(self, n_cached: list[int]) -> None:
        """The target's cache now holds row b's first n_cached[b] committed tokens."""
        for drafter, n in zip(self.drafters, n_cached):
            drafter.commit(n)


def rows_of(drafter: Drafter, prompts: list[torch.Tensor], max_len: int):
    """`drafter` for the B rows of `prompts` (B tensors (T_b,)), with propose(rows, k, sampling, generator) and
    commit(n_cached). This loop's protocol: a drafter whose needs say `rows` has rows(prompts, max_len), drafting
    every row in one forward, its state holding at most max_len tokens a row; any other runs as RowCopies."""
    return drafter.rows(prompts, max_len) if drafter.needs.rows else RowCopies(drafter, prompts)


class BatchedSpeculativeDecoder(BatchDecoder):
    """Speculative decoding of B prompts: every row proposes up to γ tokens, one target forward verifies all."""

    @torch.no_grad()
    def __init__(self, target: Target, drafter: Drafter, prompts: list[torch.Tensor], max_new_tokens: int,
                 gamma: int = 4, sampling: SamplingConfig = GREEDY, eos_token_ids: tuple[int, ...] = (),
                 seed: int | None = None, clock=time.perf_counter):
        check_drafter(drafter)
        if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
            raise ValueError(f"gamma (draft tokens per step) must be an integer >= 1, got {gamma!r}")
        if drafter.needs.features or drafter.needs.verdict:
            raise ValueError(f"the {drafter.name} drafter reads the target's features or verdicts, which only the tree "
                             "loop gives: batch a chain drafter (draft model, prompt lookup)")
        drafter.check_target(target)
        self.begin(target, prompts, max_new_tokens, f"batched/{drafter.name}", eos_token_ids, seed, clock, sampling)
        max_len = max(map(len, self.prompts)) + (gamma + 2) * (max_new_tokens + 1)       # worst case: 1 token a step
        self.cache = cache = RaggedCache(target, len(self.prompts), max_len)   # every committed token but the last
        if max(map(len, self.prompts)) > 1:
            cache.feed(*left_pad([p[:-1] for p in self.prompts]))
        self.rows = rows_of(drafter, [torch.tensor(p) for p in self.prompts], max_len)
        self.prefill_time = clock() - self.t0
        self.target, self.drafter, self.gamma = target, drafter, gamma

    @torch.no_grad()
    def _advance(self) -> None:
        """propose -> verify -> accept -> commit, for every live row at once."""
        drafter, sampling, cache, clock, live = self.drafter, self.sampling, self.cache, self.clock, self.live
        B, V = len(self.prompts), self.target.vocab_size
        seqs = [self.sequence(b) for b in range(B)]
        k = [min(self.gamma, self.max_new_tokens - len(new) - 1) if on else 0 for new, on in zip(self.new, live)]
        # 1. Propose: at most k[b] tokens per row (a finished row proposes none)
        t1 = clock()
        proposals = [p.limit(n) for p, n in zip(self.rows.propose([torch.tensor(s) for s in seqs], k, sampling,
                                                                  self.generator), k)]
        if not all(p.is_chain for p in proposals):
            raise ValueError(f"the {drafter.name} drafter proposed a tree: batched decoding verifies chains")
        k_row = torch.tensor([p.k for p in proposals])                                 # (B,)
        K = int(k_row.max())
        draft = torch.zeros(B, K, dtype=torch.long)                                    # (B, K), 0-padded
        q_draft = None if sampling.greedy else torch.zeros(B, K, V)                    # (B, K, V), 0-padded
        for b, p in enumerate(proposals):
            draft[b, :p.k] = p.tokens
            if q_draft is not None:
                q_draft[b, :p.k] = p.q_or_one_hot(V)
        # 2. Verify: one target forward over [last committed token, draft...] of every live row
        t2 = clock()
        feed = [[s[-1]] + p.tokens.tolist() if on else [] for s, p, on in zip(seqs, proposals, live)]
        tokens, n_real = left_pad(feed)
        logits = unpad(cache.feed(tokens, n_real), n_real)[:, :K + 1]                 # (B, K+1, V)
        t3 = clock()
        # 3. Accept: each row's longest agreeing prefix of its own proposal, plus one token of the target's
        n_accepted, next_tokens = accept_rows(draft, k_row, logits, q_draft, sampling, self.generator)
        p_target = logits.log_softmax(-1) if sampling.greedy else probs_from_logits(logits, sampling).log()
        # 4. Commit: extend each live row; roll both caches back to each row's committed tokens but the last
        for b, p in enumerate(proposals):
            if not live[b]:
                continue
            n = int(n_accepted[b])
            step = Step(p.tokens.tolist(), n, int(next_tokens[b]), n == p.k, t2 - t1, t3 - t2,
                        p_target[b, torch.arange(p.k), p.tokens].exp().tolist(), p.q_token.tolist())
            self.commit(b, p.tokens[:n].tolist() + [int(next_tokens[b])], step)
        n_cached = [len(self.sequence(b)) - 1 for b in range(B)]
        cache.truncate_rows(torch.minimum(torch.tensor(n_cached), cache.length))
        self.rows.commit(n_cached)


def batched_speculative_generate(target: Target, drafter: Drafter, prompts: list[torch.Tensor], max_new_tokens: int,
                                 gamma: int = 4, sampling: SamplingConfig = GREEDY,
                                 eos_token_ids: tuple[int, ...] = (), seed: int | None = None,
                                 clock=time.perf_counter) -> list[Generation]:
    """Speculative decoding of B prompts (BatchedSpeculativeDecoder.run)."""
    return BatchedSpeculativeDecoder(target, drafter, prompts, max_new_tokens, gamma, sampling, eos_token_ids, seed,
                                     clock).run()


def batch_summary(generations: list[Generation]) -> dict:
    """What the batch as a whole did: target forwards, acceptance over every row's steps, timings, throughput."""
    traces = [g.trace for g in generations]
    longest = max(traces, key=lambda t: t.n_target_forwards)                          # ran in every batch forward
    proposed = sum(s.gamma for t in traces for s in t.steps)
    accepted = sum(s.n_accepted for t in traces for s in t.steps)
    total, prefill = longest.total_time, longest.prefill_time
    return {"rows": len(traces), "new_tokens": sum(t.n_generated for t in traces),
            "target_forwards": longest.n_target_forwards,
            "acceptance_rate": accepted / proposed if proposed else float("nan"),
            "total_time": total, "prefill_time": prefill, "decode_time": total - prefill,
            "draft_time": longest.draft_time, "verify_time": longest.verify_time,
            "tokens_per_second": sum(t.n_generated for t in traces) / total if total else float("nan")}
