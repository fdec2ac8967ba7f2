"""Choosing the lookahead γ online.

Leviathan et al. 2023 (section 3.4): with per-token acceptance rate α, a verify pass over γ
draft tokens yields E[tokens] = (1 - α^(γ+1)) / (1 - α). Whether a longer draft pays depends
on what drafting and verifying cost, which this CPU or that GPU decides, not the paper.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from .trace import Step


def expected_tokens(alpha: float, gamma: int) -> float:
    """Mean tokens per verify pass for acceptance rate alpha and γ draft tokens (bonus included)."""
    if alpha >= 1:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def expected_speedup(alpha: float, gamma: int, draft_cost: float, verify_cost: float = 1.0) -> float:
    """Leviathan's improvement factor: tokens per pass over the pass's cost in plain-decode steps.

    draft_cost: one draft step / one target decode step; verify_cost: a γ+1 token verify pass /
    one target decode step (1 in the paper's ideal, measured here: larger on a CPU).
    """
    return expected_tokens(alpha, gamma) / (gamma * draft_cost + verify_cost)


def check_margin(margin: float) -> float:
    """A cost-aware policy's margin: the relative gain over plain decoding it asks of a draft, in [0, 1)."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(f"margin is a relative gain in [0, 1) (0.05: 5%), got {margin!r}")
    return float(margin)


def check_gamma(gamma: int) -> int:
    if not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 1:
        raise ValueError(f"gamma (draft tokens per step) must be an integer >= 1, got {gamma!r}")
    return gamma


class GammaPolicy(ABC):
    """How many tokens to draft each step. The eager loops call start once, then gamma and update every step."""
    name = "policy"

    def start(self, prompt_ids) -> None:
        """A new sequence, its prompt (T,) already in the target's cache."""

    @abstractmethod
    def gamma(self) -> int:
        """How many tokens to draft in the next step (0: a plain step)."""

    def update(self, step: Step) -> None:
        """Learn from the step just taken."""

    def plain_steps(self) -> int:
        """Asked when gamma() has just said 0: how many steps from this one on are plain for sure (the compiled loops
        take them at once, one host sync for all); 1 unless the policy knows more."""
        return 1


class FixedGamma(GammaPolicy):
    name = "fixed"

    def __init__(self, gamma: int):
        self.k = check_gamma(gamma)

    def gamma(self) -> int:
        return self.k


class HeuristicGamma(GammaPolicy):
    """transformers' schedule: +2 after a fully accepted draft, -1 otherwise (never below 1)."""
    name = "heuristic"

    def __init__(self, start: int = 5, max_gamma: int = 32):
        self.k, self.max_gamma = float(check_gamma(start)), check_gamma(max_gamma)

    def gamma(self) -> int:
        return int(self.k)

    def update(self, step: Step) -> None:
        if step.gamma == 0:
            return
        self.k = min(self.max_gamma, self.k + 2) if step.bonus else max(1.0, self.k - 1)


class VerifyCurve:
    """t(k)/t(1), the cost of a verify pass over k tokens in one-token passes: this machine's measured curve
    {tokens: ratio} (linear between its points, the last segment's slope beyond them), or flat (None: 1)."""

    def __init__(self, curve: dict[int, float] | None = None):
        self.tokens = self.ratios = None
        if curve:
            points = sorted((int(t), float(r)) for t, r in curve.items())
            if len(points) < 2 or points[0][0] < 1 or any(r <= 0 for _, r in points):
                raise ValueError(f"verify_curve needs >= 2 points {{tokens >= 1: t(tokens)/t(1) > 0}}, got {curve!r}")
            self.tokens, self.ratios = [t for t, _ in points], [r for _, r in points]
        self._table = np.ones(0)

    @property
    def flat(self) -> bool:
        return self.tokens is None

    def table(self, n: int) -> np.ndarray:
        """(n,) the curve at 1, ..., n tokens."""
        if len(self._table) < n:
            self._table = np.array([self(k) for k in range(1, n + 1)])
        return self._table[:n]

    def __call__(self, n_tokens: int) -> float:
        T, R = self.tokens, self.ratios
        if T is None:
            return 1.0
        if n_tokens <= T[0]:
            return R[0]
        i = next((i for i in range(1, len(T)) if n_tokens <= T[i]), len(T) - 1)
        return max(1e-9, R[i - 1] + (R[i] - R[i - 1]) * (n_tokens - T[i - 1]) / (T[i] - T[i - 1]))


class VerifyTime:
    """Seconds of a verify pass over n tokens, learned from the run's own steps: the one verify-cost model of the
    cost-aware γ and tree-budget policies (and, as its `curve`, of the speedup calculator).

    With a measured curve: the curve's shape scaled by the run's decayed seconds per one-token pass (one size
    seen is enough). Flat: a decayed least-squares line t(n) = a + b·n through the (tokens, seconds) seen.
    """

    def __init__(self, curve: dict[int, float] | None = None, decay: float = 0.9):
        self.curve, self.decay = VerifyCurve(curve), decay
        self.sums = [0.0] * 5  # decayed sums: w, n, t, n·n, n·t (t: seconds / curve(n))

    def add(self, n_tokens: int, seconds: float) -> None:
        d, n, t = self.decay, n_tokens, seconds / self.curve(n_tokens)
        self.sums = [d * s + x for s, x in zip(self.sums, (1.0, n, t, n * n, n * t))]

    def table(self, n: int) -> np.ndarray:
        """(n,) fitted seconds of a verify pass of 1, ..., n tokens."""
        w, _, st, _, _ = self.sums
        if w and not self.curve.flat:
            return st / w * self.curve.table(n)
        return np.array([self(k) for k in range(1, n + 1)])

    def __call__(self, n_tokens: int) -> float:
        """Fitted seconds for a verify pass of n_tokens (a line: flat when only one size was seen; never a
        negative slope)."""
        w, sn, st, snn, snt = self.sums
        if w == 0:
            return 0.0
        if not self.curve.flat:
            return st / w * self.curve(n_tokens)
        var = snn / w - (sn / w) ** 2
        slope = max(0.0, (snt / w - sn * st / w ** 2) / var) if var > 1e-9 else 0.0
        return st / w + slope * (n_tokens - sn / w)


# How much faster than plain decoding a draft must be expected to be before a cost-aware policy drafts: a step's
# time varies by a few percent on a shared machine, and the loop's own bookkeeping is not in the estimate.
MARGIN = 0.05


class BestRateGamma(GammaPolicy):
    """Draft the γ with the most expected tokens per second, from what this run has measured:

        rate(γ) = E[tokens | α, γ] / (γ·c + t(γ + 1))

    α the acceptance rate (accepted / judged draft tokens), c the draft's seconds per token, t(n) the verify's
    seconds for n tokens (VerifyTime: this machine's curve t(n)/t(1) scaled by the run, or a fitted line); all three
    decayed, so the choice follows the text. γ = 0 (plain decoding) when no draft beats it by `margin`; then every
    `probe_every`-th step drafts the best length once more, so a draft that starts to guess right is noticed.
    The tuned policies of labkit.tuning add what this one leaves out (a warm-up sized by a hoped-for α, costs
    known before the run, backing off between probes, unverified proposals on plain steps)."""
    name = "best-rate"

    def __init__(self, start: int = 4, max_gamma: int = 16, decay: float = 0.9, probe_every: int = 8,
                 verify_curve: dict[int, float] | None = None, margin: float = MARGIN):
        self.k, self.max_gamma, self.decay = check_gamma(start), check_gamma(max_gamma), decay
        self.probe_every, self.margin = check_gamma(probe_every), check_margin(margin)
        self.verify = VerifyTime(verify_curve, decay)
        self.accepted = self.judged = self.draft_seconds = self.drafted = 0.0
        self.plain_run = 0                   # plain steps since the last draft

    def rate(self, g: int) -> float:
        """Expected tokens per second drafting g tokens a step (g = 0: plain decoding)."""
        alpha = self.accepted / max(1e-9, self.judged)
        c = self.draft_seconds / max(1e-9, self.drafted)
        return expected_tokens(alpha, g) / (g * c + max(1e-9, self.verify(g + 1)))

    def gamma(self) -> int:
        if not self.judged:                  # nothing measured yet: draft the starting length
            return self.k
        best = max(range(self.max_gamma + 1), key=self.rate)
        if self.rate(best) < (1 + self.margin) * self.rate(0):
            best = 0 if self.plain_run < self.probe_every else max(range(1, self.max_gamma + 1), key=self.rate)
        return best

    def update(self, step: Step) -> None:
        d, g = self.decay, step.gamma
        self.verify.add(g + 1, step.verify_time)
        self.plain_run = self.plain_run + 1 if g == 0 else 0
        if g:                                # judged: the accepted tokens and the first rejected one, if any
            self.accepted = d * self.accepted + step.n_accepted
            self.judged = d * self.judged + step.n_accepted + (not step.bonus)
            self.draft_seconds, self.drafted = d * self.draft_seconds + step.draft_time, d * self.drafted + g
