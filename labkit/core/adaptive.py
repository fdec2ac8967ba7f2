"""Choosing the lookahead γ online.

Leviathan et al. 2023 (section 3.4): with per-token acceptance rate α, a verify pass over γ
draft tokens yields E[tokens] = (1 - α^(γ+1)) / (1 - α). Whether a longer draft pays depends
on what drafting and verifying cost, which this CPU or that GPU decides, not the paper.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

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
    name = "policy"

    @abstractmethod
    def gamma(self) -> int:
        """How many tokens to draft in the next step."""

    def update(self, step: Step) -> None:
        """Learn from the step just taken."""


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

    @property
    def flat(self) -> bool:
        return self.tokens is None

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


# How much faster than plain decoding drafting must be expected to be before the cost-aware policies draft: a
# step's time varies by a few percent on a shared CPU, and a loop's own bookkeeping is not in the estimate, so a
# smaller expected gain is as likely a loss.
MARGIN = 0.05


class CostAwareGamma(GammaPolicy):
    """Ours: pick γ maximising expected tokens per second from what this run has measured.

    α is a decayed maximum-likelihood estimate (accepted / (accepted + rejections)); the
    draft step time and a linear verify-time model t(n) = a + b·n are fitted from the trace.
    γ = 0 is a choice too (plain decoding through the same loop) when no draft length is expected to beat one
    target step per token by `margin` (5%); then every `probe_every` plain steps (doubling after each probe that
    still says 0) one draft of the best length refreshes α, so drafting resumes where it pays.
    """
    name = "cost-aware"

    def __init__(self, start: int = 5, max_gamma: int = 16, decay: float = 0.9, warmup: int = 3,
                 probe_every: int = 8, margin: float = MARGIN):
        """margin: how much faster than plain decoding a draft must be expected to be before a step drafts."""
        self.k, self.max_gamma, self.decay, self.warmup = check_gamma(start), check_gamma(max_gamma), decay, warmup
        self.margin = check_margin(margin)
        self.probe_every = self.interval = check_gamma(probe_every)
        self.accepted = self.rejected = 0.0
        self.draft_time = self.draft_tokens = 0.0
        self.verify_time = VerifyTime(decay=decay)   # seconds of a verify pass of n tokens, fitted from the trace
        self.n_steps = 0
        self.idle = 0          # plain (γ = 0) steps since the last draft

    def update(self, step: Step) -> None:
        d = self.decay
        self.verify_time.add(step.gamma + 1, step.verify_time)
        if step.gamma == 0:
            self.idle += 1
            return
        if self.idle:                            # a probe after plain steps: back off if it does not pay
            self.interval = self.interval * 2 if self._best() == 0 else self.probe_every
        self.idle = 0
        self.n_steps += 1
        self.accepted = d * self.accepted + step.n_accepted
        self.rejected = d * self.rejected + (0 if step.bonus else 1)
        self.draft_time = d * self.draft_time + step.draft_time
        self.draft_tokens = d * self.draft_tokens + step.gamma

    def tokens_per_second(self, g: int) -> float:
        """Expected committed tokens per second drafting g tokens a step (g = 0: plain decoding)."""
        alpha = self.accepted / max(1e-9, self.accepted + self.rejected)
        t_draft = self.draft_time / max(1e-9, self.draft_tokens)
        return expected_tokens(alpha, g) / (g * t_draft + max(1e-9, self.verify_time(g + 1)))

    def _best(self) -> int:
        """The γ with the most expected tokens per second; a draft only where it beats plain decoding by margin."""
        best = max(range(0, self.max_gamma + 1), key=self.tokens_per_second)
        return 0 if self.tokens_per_second(best) < (1 + self.margin) * self.tokens_per_second(0) else best

    def gamma(self) -> int:
        if self.n_steps < self.warmup:
            return self.k
        best = self._best()
        if best == 0 and self.idle >= self.interval:
            best = max(range(1, self.max_gamma + 1), key=self.tokens_per_second)     # probe
        self.k = best
        return self.k
