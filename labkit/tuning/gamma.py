"""The cost-aware γ: core.adaptive.BestRateGamma with what makes it pay on a machine where drafting is dear.

`CostAwareGamma` picks the γ with the most expected tokens per second, as BestRateGamma does, and adds a warm-up
sized for a hoped-for acceptance rate, costs measured before the run (`known_costs`), probes whose gap doubles
while drafting keeps not paying, and unverified proposals on plain steps (shadows, tuning/shadow.py: wrap it in
`Shadowed` to have them). Where each of these pays, and by how much, is in docs/benchmark.md.
"""
from __future__ import annotations

from ..core.adaptive import (
    MARGIN,
    GammaPolicy,
    VerifyTime,
    check_gamma,
    check_margin,
    expected_tokens,
)
from ..core.trace import Step
from .shadow import SHADOW_SHARE, check_share


def check_known_costs(costs) -> tuple[float, float]:
    """(draft step seconds, target step seconds), both positive numbers."""
    ok = isinstance(costs, (tuple, list)) and len(costs) == 2 and all(
        not isinstance(c, bool) and isinstance(c, (int, float)) and c > 0 for c in costs)
    if not ok:
        raise ValueError("known_costs is (seconds of the draft's one-token step, seconds of the target's), both > 0 "
                         f"(e.g. (0.019, 0.046)), got {costs!r}")
    return float(costs[0]), float(costs[1])



# The acceptance rate the cost-aware warm-up sizes its drafts for, before the run has measured its own: a little
# below what a good draft reaches on the text it suits (the lab's draft pairs: docs/benchmark.md).
HOPE = 0.8


class CostAwareGamma(GammaPolicy):
    """Ours: pick γ maximising expected tokens per second from what this run has measured.

    α is a decayed maximum-likelihood estimate (accepted / (accepted + rejections)); the draft step time is
    fitted from the trace, and the verify time too: this machine's measured curve t(n)/t(1) scaled by the run's
    steps (`verify_curve`), or without one a line t(n) = a + b·n through them.
    The first of `warmup` steps drafts `start` tokens (one, where the drafter costs little enough to shadow: see
    below); once it has timed the draft, the rest draft as many tokens (at most `start`) as would pay best were the
    draft at least as good as `hope` (α = 0.8), so a draft that costs too much to pay even then stops after one step
    instead of spending the whole warm-up on long drafts. Where the draft's and the target's one-token steps were
    measured before the run (`known_costs`), the first draft is sized that way too, and a draft that could not
    pay even at `hope` is never tried until a probe. γ = 0 is a choice too (plain decoding through the same loop)
    when no draft length is expected to beat one target step per token by `margin` (5%). On plain steps the
    drafter still proposes, unverified, while its work stays within `shadow_share` (1%) of their time
    (tuning/shadow.py): the tokens the plain steps commit accept or reject each shadow token as a verify would, so α
    stays current without spending a verify (prompt lookup costs nothing and shadows every plain step). Where
    shadows are rarer than every `probe_every` plain steps (a draft model's), one draft of the best length is
    verified instead (the gap doubling after each probe that still says 0), so drafting resumes where it pays.
    """
    name = "cost-aware"

    def __init__(self, start: int = 5, max_gamma: int = 16, decay: float = 0.9, warmup: int = 3,
                 probe_every: int = 8, margin: float = MARGIN, shadow_share: float = SHADOW_SHARE,
                 verify_curve: dict[int, float] | None = None, hope: float = HOPE,
                 known_costs: tuple[float, float] | None = None):
        """margin: how much faster than plain decoding a draft must be expected to be before a step drafts;
        shadow_share: the share of the plain steps' time unverified proposals on them may cost (0: none);
        verify_curve: this machine's {tokens: t(tokens)/t(1)} (None: fit a line to the run's steps);
        hope: the acceptance rate the warm-up's drafts are sized for;
        known_costs: (seconds of the draft's one-token step, of the target's), measured before the run (the
        bench's drafters.window.WindowCosts): the run's own timings start from them, one step's worth."""
        self.k, self.max_gamma, self.decay, self.warmup = check_gamma(start), check_gamma(max_gamma), decay, warmup
        self.start_gamma = self.k
        self.margin = check_margin(margin)
        if isinstance(hope, bool) or not isinstance(hope, (int, float)) or not 0 < hope < 1:
            raise ValueError(f"hope is an acceptance rate in (0, 1) (0.8: 80% of drafted tokens), got {hope!r}")
        self.hope = float(hope)
        self.probe_every = self.interval = check_gamma(probe_every)
        self.accepted = self.rejected = 0.0
        self.draft_time = self.draft_tokens = 0.0
        self.verify_time = VerifyTime(verify_curve, decay=decay)   # seconds of a verify pass of n tokens
        self.n_steps = 0
        self.idle = 0          # plain (γ = 0) steps since the last draft or shadow
        self.shadow_share, self.credit = check_share(shadow_share), 0.0
        self.shadows = False   # whether the loop proposes shadows on plain steps (expect_shadows)
        if known_costs is not None:
            draft_step, target_step = check_known_costs(known_costs)
            self.draft_time, self.draft_tokens = draft_step, 1.0
            self.verify_time.add(1, target_step)

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
        if self.n_steps < self.warmup and self._cheap():     # shadows learn α for free: no more warm-up drafts
            self.n_steps = self.warmup

    def plain_steps(self) -> int:
        """Plain steps until the next probe (the interval since the last draft), where no shadow can come between
        (a loop without shadows); a plain step's own timing cannot tip the choice sooner but by the margin."""
        if self.k != 0 or self.shadows or self.n_steps < self.warmup:
            return 1
        return max(1, self.interval - self.idle)

    def _cheap(self) -> bool:
        """Whether a shadow of the starting length costs at most `shadow_share` of a plain step (prompt lookup's
        does; a draft model's does not)."""
        t_draft = self.draft_time / max(1e-9, self.draft_tokens)
        return self.shadows and self.k * t_draft <= self.shadow_share * self.verify_time(1)

    def expect_shadows(self) -> None:
        """Called by Shadowed, which proposes shadows on plain steps."""
        self.shadows = self.shadow_share > 0

    def shadow_size(self) -> int:
        """Asked on a plain step: the best draft length when the plain steps have banked `shadow_share` of their
        time to pay for drafting it (always while drafting's cost is unknown), else 0."""
        if self.k != 0 or not self.shadows:
            return 0
        g = self._probe()
        cost = g * self.draft_time / self.draft_tokens if self.draft_tokens else 0.0
        self.credit = min(self.credit + self.shadow_share * self.verify_time(1), cost)
        if self.credit < cost:
            return 0
        self.credit -= cost
        self.idle = 0                            # a shadow instead of a probe
        return g

    def add_shadow(self, shadow) -> None:
        """A shadow counts as a drafted step for the cost of drafting, and its tokens as they are judged."""
        d = self.decay
        self.accepted, self.rejected = d * self.accepted, d * self.rejected
        self.draft_time = d * self.draft_time + shadow.seconds
        self.draft_tokens = d * self.draft_tokens + shadow.n_nodes

    def shadow_grew(self, shadow, gained: int) -> None:
        self.accepted += gained
        self.rejected += shadow.settled and not shadow.reached_leaf

    def _probe(self) -> int:
        """The draft length a probe or shadow tries: the best one, plain decoding aside."""
        return max(range(1, self.max_gamma + 1), key=self.tokens_per_second)

    def tokens_per_second(self, g: int, alpha: float | None = None) -> float:
        """Expected committed tokens per second drafting g tokens a step (g = 0: plain decoding), at the run's
        acceptance rate or at `alpha`."""
        if alpha is None:
            alpha = self.alpha()
        t_draft = self.draft_time / max(1e-9, self.draft_tokens)
        return expected_tokens(alpha, g) / (g * t_draft + max(1e-9, self.verify_time(g + 1)))

    def alpha(self) -> float:
        """The run's acceptance rate: accepted / (accepted + rejections), both decayed."""
        return self.accepted / max(1e-9, self.accepted + self.rejected)

    def _best(self, most: int | None = None, alpha: float | None = None) -> int:
        """The γ up to `most` (max_gamma) with the most expected tokens per second, at the run's α or `alpha`; a
        draft only where it beats plain decoding by margin."""
        def rate(g: int) -> float:
            return self.tokens_per_second(g, alpha)
        best = max(range(0, (self.max_gamma if most is None else most) + 1), key=rate)
        return 0 if rate(best) < (1 + self.margin) * rate(0) else best

    def _hopeful(self) -> int:
        """A warm-up step's γ: the best up to `start_gamma` were α at least `hope` (0: none)."""
        return self._best(self.start_gamma, max(self.hope, self.alpha()))

    def gamma(self) -> int:
        if self.n_steps < self.warmup and self.draft_tokens:     # the draft's cost known: timed, or given
            self.k = self._hopeful()
            if self.k:
                return self.k
            self.n_steps = self.warmup           # not even a good draft would pay: the usual rule from here on
        if self.n_steps < self.warmup:
            return self.k
        best = self._best()
        if best == 0 and self.idle >= self.interval:
            best = self._probe()
        self.k = best
        return self.k
