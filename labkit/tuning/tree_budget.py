"""The cost-aware tree budget: how many nodes to verify each step, from this machine's verify cost and this
drafter's acceptance.

Sequoia's point (Chen et al. 2024): the best tree size depends on the hardware. A bigger tree accepts a little
more and costs a verify of more tokens; where a wide verify costs little more than a narrow one big trees pay,
where it costs several one-token steps they do not. `CostAwareBudget` measures both sides during decoding and
picks the budget with the most expected tokens per second:

- acceptance, counterfactually: a drafter with `best_first` (suffix decoding, EAGLE-2, Medusa's greedy tree, any
  chain) lists its nodes best first (parents before children), so a proposal cut to its first n nodes is the tree
  it would have proposed with budget n; under greedy verification only one child of a node can match the target,
  so the nodes the target would keep from the cut tree are the accepted path's nodes with index below n. One step
  verified with N nodes therefore says what every budget n <= N would have committed.
- cost: the machine's verify-cost curve t(T)/t(1) when given (`verify_curve`, as `python -m labkit verify-cost`
  measures it), scaled to this run's verify seconds; otherwise a least-squares line through (nodes + 1, verify
  seconds) of the steps so far; plus the drafter's mean drafting seconds per step. The curve matters where verify
  cost is a staircase (flat up to some width, then a jump) that a straight line cannot follow.

Budget 0 is a choice too: a plain step, chosen when no tree is expected to commit tokens at least `margin` faster
than plain decoding does; its cost is the measured one-token verify and its yield one token, so drafting stops
where it would lose. A node's acceptance is counted as if `prior` more steps had rejected it: after one lucky
guess a tree is not yet judged to pay, and a drafter that keeps being right soon is.

Finding out when drafting pays again. Wrapped in `Shadowed` (tuning/shadow.py), the plain steps have the drafter
propose the largest tree unverified, paid from `shadow_share` of the plain steps' time and coming where exploring
steps would have (8, 16, 32, ... plain steps apart); each is remembered as a step of the largest budget, its
accepted path growing as tokens are committed, so no verify is spent on finding out. Without shadows, exploring
steps verify instead: with the machine's curve the first step verifies the largest tree priced at most
`probe_cost` above a plain step, without one the first two verify the largest tree and the smallest; while
drafting, every `explore_every`-th step verifies a larger tree (twice the best budget, or the largest whose fitted
verify costs at most `probe_cost` more than the best's), and while plain steps stay best the gap doubles.
(Under sampling, acceptance along the path depends on the other nodes, and the counterfactual is an estimate.)
"""
from __future__ import annotations

from collections import deque

import numpy as np

from ..core.adaptive import MARGIN, VerifyTime, check_margin
from ..core.trace import Step
from ..core.tree_budget import BudgetPolicy
from .shadow import SHADOW_SHARE, Shadow, check_share

# Steps that accepted nothing, counted with the steps a cost-aware budget remembers: a node's acceptance is judged
# as if it had also been rejected this often, so one lucky probe (a node of 1 in 1 accepted) does not start a run of
# drafting; a drafter that is right keeps being judged right after a few steps (4 of 4 count as 4 of 6).
PRIOR_STEPS = 2.0
# How much dearer than the best budget's verify an exploring step's tree may be: where drafting does not pay, each
# probe costs this much of a plain step on top of the drafter's own work; too small a share buys a one-node probe,
# which finds a long match late (docs/benchmark.md).
PROBE_COST = 0.3


class CostAwareBudget(BudgetPolicy):
    """Pick each step's tree budget (nodes) maximising expected tokens per second, measured on this run."""
    name = "cost-aware"
    needs_best_first = True

    def __init__(self, max_budget: int = 64, min_budget: int = 0, window: int = 32, explore_every: int = 8,
                 warmup: int = 2, verify_curve: dict[int, float] | None = None, margin: float = MARGIN,
                 prior: float = PRIOR_STEPS, probe_cost: float = PROBE_COST, shadow_share: float = SHADOW_SHARE):
        """verify_curve: this machine's {tokens: t(tokens)/t(1)} (None: fit a line to the run's steps);
        min_budget 0 lets a step be plain decoding (no draft) where drafting does not pay; warmup: steps
        alternating the largest and the smallest budget before any choice (without a curve; with one, a single
        step of the largest tree the curve calls cheap); margin: how much faster than plain decoding a tree must be
        expected to be before a step drafts one; prior: steps that accepted nothing, counted with the remembered
        ones, so that one lucky probe does not start a run of drafting; probe_cost: how much dearer than the best
        budget's verify an exploring step's tree may be; shadow_share: the share of the plain steps' time the
        drafter's unverified proposals on them may cost (0: no shadows, exploring steps instead)."""
        self.margin = check_margin(margin)
        if not 0 <= prior <= 16 or not 0 <= probe_cost <= 1:
            raise ValueError(f"need 0 <= prior <= 16 (steps) and 0 <= probe_cost <= 1, got {prior}, {probe_cost}")
        self.prior, self.probe_cost, self.shadow_share = prior, probe_cost, check_share(shadow_share)
        if isinstance(max_budget, bool) or not isinstance(max_budget, int) or not 0 <= min_budget <= max_budget \
                or max_budget < 1:
            raise ValueError(f"need integers 0 <= min_budget <= max_budget, max_budget >= 1, got {min_budget}, "
                             f"{max_budget}")
        if isinstance(explore_every, bool) or not isinstance(explore_every, int) or explore_every < 1:
            raise ValueError(f"explore_every must be an integer >= 1 (steps between exploring steps), "
                             f"got {explore_every!r}")
        self.max_budget, self.min_budget = max_budget, min_budget
        self.verify = VerifyTime(verify_curve, decay=0.95)
        self.explore_every = self.interval = explore_every
        self.warmup = min(warmup, 1) if verify_curve else warmup
        self.history: deque[tuple[int, int, list[int]]] = deque(maxlen=window)   # (budget, nodes, accepted path)
        self._remembered: tuple | None = None     # what the history says, until it changes (see expected)
        self.draft_seconds = 0.0
        self.n_steps = self.n_drafted = 0
        self.next_explore = explore_every      # the step that explores next
        self.exploring = False
        self.last = max_budget
        # shadows: whether the loop proposes them (expect_shadows), the seconds one costs, and the seconds of plain
        # steps not yet spent on them
        self.shadows = False
        self.shadow_seconds: float | None = None
        self.credit = 0.0

    def budget(self) -> int:
        """The budget for the next step."""
        self.exploring = False
        if self.n_steps < self.warmup:
            if self.warmup == 1 and self.shadows:                  # a plain step and a shadow of the largest tree
                self.last = 0
            elif self.warmup == 1:                            # a measured curve: one size is enough to scale it
                self.last = self.explore_budget(self.min_budget)
            else:                                           # the largest tree and the smallest: two sizes to fit
                self.last = self.max_budget if self.n_steps % 2 == 0 else self.min_budget
            return self.last
        best = self.best()
        if self.shadows and best > 0 and self.last == 0:   # shadows resumed drafting: they explored the largest
            self.interval = self.explore_every             # tree, so the next exploring step is a full gap away
            self.next_explore = max(self.next_explore, self.n_steps + self.explore_every)
        self.exploring = self.n_steps >= self.next_explore and (best > 0 or not self.shadows)
        self.last = self.explore_budget(best) if self.exploring else best
        return self.last

    def plain_steps(self) -> int:
        """Asked when budget() has just said 0: plain steps until the next exploring step, where no shadow can come
        between (a loop without shadows); 1 while warming up."""
        if self.last != 0 or self.exploring or self.shadows or self.n_steps < self.warmup:
            return 1
        return max(1, self.next_explore - self.n_steps)

    def best(self) -> int:
        """The budget with the most expected tokens per second, as the remembered steps say; a tree only where it
        beats a plain step (when allowed) by `margin`."""
        n, tokens, seconds = self.expected()
        allowed = n >= self.min_budget
        n, rates = n[allowed], tokens[allowed] / seconds[allowed]                  # (K,) tokens a second
        if not n.size:
            return self.max_budget
        best = int(np.argmax(rates))                                                # the first of the fastest
        return 0 if n[0] == 0 and rates[best] < (1 + self.margin) * rates[0] else int(n[best])

    def verify_cost(self, tokens: int) -> float:
        """A verify of `tokens` tokens in this run's seconds, or in the curve's units before any step is timed."""
        return self.verify(tokens) if self.verify.sums[0] else self.verify.curve(tokens)

    def explore_budget(self, best: int) -> int:
        """Twice the best budget (at least one node), or further while a verify costs at most `probe_cost` more
        than the best's."""
        limit = (1 + self.probe_cost) * self.verify_cost(best + 1)
        cheap = max(n for n in range(best, self.max_budget + 1) if n == best or self.verify_cost(n + 1) <= limit)
        return max(min(self.max_budget, max(1, 2 * best)), cheap)

    def expect_shadows(self) -> None:
        """Called by Shadowed, which proposes shadows on plain steps: then plain steps do not explore, and the first
        step is a plain one with a shadow."""
        self.shadows = self.shadow_share > 0 and self.min_budget == 0

    def shadow_size(self) -> int:
        """Asked by the loop on a plain step: nodes the drafter should propose unverified now (0: none). A shadow
        is due when the plain steps have banked `shadow_share` of their time to pay for one (always while what
        a shadow costs is unknown), and where an exploring step would have been (8, 16, 32, ... plain steps
        apart) as soon as the last one is paid for: that one may run the bank into debt, which the next plain
        steps pay back first. So the shadows never cost more than their share of the plain steps' time and one
        shadow besides (a shadow costs the drafter's work, an exploring step that and a verify besides)."""
        if self.last != 0 or not self.shadows:
            return 0
        scheduled = self.n_steps >= self.next_explore
        if scheduled:
            self.next_explore, self.interval = self.n_steps + self.interval, 2 * self.interval
        if self.shadow_seconds is not None:
            self.credit = min(self.credit + self.shadow_share * self.verify(1), self.shadow_seconds)
            if self.credit < (0.0 if scheduled else self.shadow_seconds):
                return 0
        return self.max_budget

    def add_shadow(self, shadow: Shadow) -> None:
        """Remember an unverified proposal as a step of the largest budget; its path (the same list) grows as the
        loop follows it along the committed tokens."""
        self.shadow_seconds = shadow.seconds if self.shadow_seconds is None else \
            0.8 * self.shadow_seconds + 0.2 * shadow.seconds
        self.credit -= shadow.seconds                               # the bank pays what it cost (the first too)
        if shadow.n_nodes:
            self.history.append((self.max_budget, shadow.n_nodes, shadow.path))
            self._remembered = None
            self._add_draft_seconds(shadow.seconds)

    def shadow_grew(self, shadow: Shadow, gained: int) -> None:
        """The remembered path is the shadow's own list, grown in place: what the history says has changed."""
        self._remembered = None

    def _add_draft_seconds(self, seconds: float) -> None:
        self.draft_seconds = 0.9 * self.draft_seconds + 0.1 * seconds if self.n_drafted else seconds
        self.n_drafted += 1

    def update(self, step: Step) -> None:
        """Learn from a verified step (its proposal, accepted path and timings); a plain step only times a verify.
        While drafting, after an exploring step the next is `explore_every` steps away (without shadows, twice as
        far as the last gap while plain steps stay best)."""
        nodes = len(step.proposed)
        self.verify.add(nodes + 1, step.verify_time)
        self.n_steps += 1
        if self.last > 0:
            self.history.append((self.last, nodes, list(step.path or [])))
            self._remembered = None
            self._add_draft_seconds(step.draft_time)
        if self.exploring:
            self.interval = self.interval * 2 if self.best() == 0 else self.explore_every
            self.next_explore = self.n_steps - 1 + self.interval      # counted from the exploring step

    def estimates(self) -> list[tuple[int, float, float]]:
        """(n, expected tokens a step commits, expected seconds a step takes) for budgets n = 0, 1, 2, ... as far
        as the remembered steps say (n = 0, a plain step: one token for a one-token verify, when min_budget
        allows it). Node n's gain (it is on the accepted path) is averaged over the steps that would have
        verified it (budget >= n, or fewer nodes because the drafter proposed fewer), and the gains add up: so
        a budget that only the exploring steps reached is judged by its extra nodes alone."""
        return [(int(n), float(t), float(c)) for n, t, c in zip(*self.expected())]

    def expected(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`estimates` as arrays (K,) each: budgets, expected tokens, expected seconds. Asked every step, so what
        the remembered steps say is worked out once after each change to them (a new step, a shadow's path
        growing); a step that changes nothing (a plain one) only reprices the verifies at this run's seconds."""
        plain = self.min_budget == 0
        head = (np.zeros(1, dtype=np.int64), np.ones(1), np.full(1, max(1e-9, self.verify(1)))) if plain else \
            (np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0))               # n = 0: one token, one-token verify
        if not self.history:
            return head
        if self._remembered is None:
            self._remembered = self._remember()
        n, tokens, seen, count, verified = self._remembered
        t_verify = self.verify.table(self.max_budget + 1)                           # (M+1,) k nodes + the root
        seconds = self.draft_seconds + (t_verify[verified] * seen).sum(0) / np.maximum(count, 1)    # (M,)
        reach = tokens.size
        return (np.concatenate([head[0], n[:reach]]), np.concatenate([head[1], tokens]),
                np.concatenate([head[2], np.maximum(1e-9, seconds[:reach])]))

    def _remember(self) -> tuple[np.ndarray, ...]:
        """What the remembered steps say, apart from this run's seconds: budgets n (M,), the expected tokens (R,) of
        the budgets some step says (R <= M), which steps would verify node n-1 (H, M), how many (M,), and how many
        nodes each would have verified (H, M)."""
        M = self.max_budget
        budget = np.array([b for b, _, _ in self.history])                            # (H,)
        nodes = np.array([n for _, n, _ in self.history])                             # (H,)
        kept = np.zeros((len(self.history), M), dtype=bool)                           # (H, M) node on the path
        for i, (_, _, path) in enumerate(self.history):
            kept[i, path] = True
        n = np.arange(1, M + 1)                                                        # (M,)
        seen = (budget[:, None] >= n) | (nodes < budget)[:, None]                     # (H, M) would verify node n-1
        count = seen.sum(0)                                                            # (M,)
        reach = int(np.argmin(count > 0)) if (count == 0).any() else M                 # budgets some step says
        tokens = 1.0 + np.cumsum((kept & seen).sum(0) / (count + self.prior))          # (M,)
        verified = np.minimum(n[None, :], nodes[:, None])                             # (H, M)
        return n, tokens[:reach], seen, count, verified

    def tokens_committed(self, n: int) -> float | None:
        """Expected tokens a step commits with budget n (None: no remembered step says)."""
        return next((tokens for m, tokens, _ in self.estimates() if m == n), None)
