"""Whether a request drafts at all, from what drafting did on the earlier requests of the same workload.

Inside one request the cost-aware policies (gamma.py, tree_budget.py) learn how good a draft is only by
trying it, and a draft model reads the whole prompt before its first guess. On a long prompt with a short
answer that read alone can cost more than the draft then saves, whatever the policy decides afterwards. A
serving loop sees many requests of one kind (a translation endpoint, a RAG assistant, a code completer), so it
can learn across them. `DraftGate` keeps, for one workload, whether drafting paid on its last drafted request,
the draft's reading of the prompt counted, and runs the next requests plain where it did not. After `retry`
plain requests it drafts once more, and each try that loses again doubles the wait, so on a workload where
drafting never pays only one request in 1 + retry, then in 1 + 2·retry, 1 + 4·retry, ... pays the price of trying:
the probes inside a request (CostAwareGamma's `probe_every`) do the same across its steps. A request that
pays resets the wait. Plain requests are plain decoding, so every output stays the target's own.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from ..core.adaptive import VerifyCurve
from ..core.trace import Trace


@dataclass(frozen=True)
class Verdict:
    """A drafted request against the plain decoding of the same tokens."""
    seconds: float          # the request's time, prefill (the draft's reading of the prompt too) included
    plain_seconds: float    # the target's own prefill plus one plain step per token after the first

    @property
    def paid(self) -> bool:
        return self.seconds < self.plain_seconds

    @property
    def speedup(self) -> float:
        return self.plain_seconds / self.seconds


def drafting_paid(trace: Trace, step_seconds: float) -> Verdict:
    """Judge a drafted request: its time against the target's prefill in it plus (n - 1) plain steps of
    `step_seconds` each (plain decoding's first token comes with its prefill)."""
    if not step_seconds > 0:
        raise ValueError(f"step_seconds is the target's one-token step in seconds, > 0 (e.g. 0.05), "
                         f"got {step_seconds!r}")
    target_prefill = trace.prefill_time - trace.draft_prefill_time
    plain = target_prefill + max(0, trace.n_generated - 1) * step_seconds
    return Verdict(trace.total_time, plain)


class DraftGate:
    """One workload's choice, request after request: draft (`drafts()`), or decode plain."""

    def __init__(self, retry: int = 2):
        """retry: plain requests after a drafted one that lost, before drafting is tried again (doubling after
        each try that loses too)."""
        if isinstance(retry, bool) or not isinstance(retry, int) or retry < 1:
            raise ValueError(f"retry is a number of plain requests >= 1 before drafting is tried again, got {retry!r}")
        self.retry = self.wait = retry
        self.plain_left = 0                  # plain requests still to run before the next drafted one
        self.history: list[bool | None] = []  # per request: paid (True/False) where it drafted, None where plain

    def drafts(self) -> bool:
        """Whether the next request drafts."""
        return self.plain_left == 0

    def record(self, verdict: Verdict | None) -> None:
        """What the request just run did: its verdict where it drafted, None where it ran plain."""
        if verdict is None:
            if self.plain_left == 0:
                raise ValueError("this request was to draft (drafts() was True): record its drafting_paid verdict")
            self.plain_left -= 1
            self.history.append(None)
            return
        if self.plain_left:
            raise ValueError(f"this request was to run plain ({self.plain_left} plain requests left): record None")
        self.history.append(verdict.paid)
        if verdict.paid:
            self.wait = self.retry
        else:
            self.plain_left, self.wait = self.wait, 2 * self.wait

    def describe(self) -> str:
        drafted = [h for h in self.history if h is not None]
        return (f"{len(self.history)} requests: {len(drafted)} drafted ({sum(drafted)} paid), "
                f"{len(self.history) - len(drafted)} plain")


def one_token_step(trace: Trace, verify_curve: dict[int, float]) -> float | None:
    """The target's one-token step during a run, from its own verifies: each step's verify time over the curve's
    t(γ+1)/t(1) (linear between the measured widths), the median (the first step is left out: it feeds the draft
    alone, after the prefill). None where the run has no step after the first."""
    curve = VerifyCurve(verify_curve)
    seconds = [s.verify_time / curve(s.gamma + 1) for s in trace.steps[1:] if s.verify_time > 0]
    return statistics.median(seconds) if seconds else None
