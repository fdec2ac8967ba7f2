"""How many tree nodes to verify per step, from this machine's verify cost and this drafter's acceptance.

Sequoia's point (Chen et al. 2024): the best tree size depends on the hardware. A bigger tree
accepts a little more and costs a verify of more tokens; where verifying 32 tokens costs 1.2
one-token steps (a CPU with flat kernels, 01/08) big trees pay, where it costs 4 they do not.
`CostAwareBudget` measures both sides during decoding and picks the budget with the most
expected tokens per second:

- acceptance, counterfactually: tree drafters list nodes best first (parents before children),
  so a proposal cut to its first n nodes is the tree they would have proposed with budget n;
  and under greedy verification only one child of a node can match the target, so the nodes
  the target would keep from the cut tree are the accepted path's nodes with index below n.
  One step verified with N nodes therefore says what every budget n <= N would have committed.
- cost: a least-squares line through (nodes + 1, verify seconds) of the steps so far, plus the
  drafter's mean drafting seconds per step.

The first steps verify the largest and the smallest tree (two sizes for the cost line), and
every `explore_every`-th step verifies the largest budget again, so the estimate for large
trees stays fresh. (Under sampling, acceptance along the path depends on the other nodes, and
the counterfactual is an estimate.)
"""
from __future__ import annotations

from collections import deque

from .adaptive import VerifyFit
from .trace import Step


class FixedBudget:
    """The same number of tree nodes every step."""
    name = "fixed"

    def __init__(self, nodes: int):
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"budget (tree nodes per step) must be an integer >= 1, got {nodes!r}")
        self.nodes = nodes

    def budget(self) -> int:
        return self.nodes

    def update(self, step: Step) -> None:
        pass


class CostAwareBudget:
    """Pick each step's tree budget (nodes) maximising expected tokens per second, measured on this run."""
    name = "cost-aware"

    def __init__(self, max_budget: int = 64, min_budget: int = 1, window: int = 32, explore_every: int = 8,
                 warmup: int = 2):
        if isinstance(max_budget, bool) or not isinstance(max_budget, int) or not 1 <= min_budget <= max_budget:
            raise ValueError(f"need integers 1 <= min_budget <= max_budget, got {min_budget}, {max_budget}")
        self.max_budget, self.min_budget = max_budget, min_budget
        self.explore_every, self.warmup = explore_every, warmup
        self.history: deque[tuple[int, int, list[int]]] = deque(maxlen=window)   # (budget, nodes, accepted path)
        self.verify = VerifyFit(decay=0.95)
        self.draft_seconds = 0.0
        self.n_steps = 0
        self.last = max_budget

    def budget(self) -> int:
        """The budget for the next step."""
        if self.n_steps < self.warmup:                      # the largest tree and the smallest: two sizes to fit
            self.last = self.max_budget if self.n_steps % 2 == 0 else self.min_budget
        elif self.n_steps % self.explore_every == 0:
            self.last = self.max_budget
        else:
            rates = {n: tokens / seconds for n, tokens, seconds in self.estimates() if n >= self.min_budget}
            self.last = max(rates, key=rates.get) if rates else self.max_budget
        return self.last

    def update(self, step: Step) -> None:
        """Learn from a verified step (its proposal, accepted path and timings)."""
        nodes = len(step.proposed)
        self.history.append((self.last, nodes, list(step.path or [])))
        self.verify.add(nodes + 1, step.verify_time)
        self.draft_seconds = 0.9 * self.draft_seconds + 0.1 * step.draft_time if self.n_steps else step.draft_time
        self.n_steps += 1

    def estimates(self) -> list[tuple[int, float, float]]:
        """(n, expected tokens a step commits, expected seconds a step takes) for budgets n = 1, 2, ... as far as
        the remembered steps say. Node n's gain (it is on the accepted path) is averaged over the steps that
        would have verified it (budget >= n, or fewer nodes because the drafter proposed fewer), and the gains
        add up: so a budget that only the exploring steps reached is judged by its extra nodes alone."""
        steps = [(budget, nodes, set(path)) for budget, nodes, path in self.history]
        out, tokens = [], 1.0
        for n in range(1, self.max_budget + 1):
            seen = [(nodes, path) for budget, nodes, path in steps if budget >= n or nodes < budget]
            if not seen:
                break
            tokens += sum(n - 1 in path for _, path in seen) / len(seen)
            seconds = sum(self.draft_seconds + self.verify(min(n, nodes) + 1) for nodes, _ in seen) / len(seen)
            out.append((n, tokens, max(1e-9, seconds)))
        return out

    def tokens_committed(self, n: int) -> float | None:
        """Expected tokens a step commits with budget n (None: no remembered step says)."""
        return next((tokens for m, tokens, _ in self.estimates() if m == n), None)
