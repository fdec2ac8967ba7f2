"""How many tree nodes to verify each step: the tree loop's budget policy.

A budget policy is to the tree loop what a γ policy (adaptive.py) is to the chain loop: `start` once, then
`budget()` before and `update(step)` after every step. `FixedBudget` verifies the same number of nodes every
step. A policy that judges smaller budgets by cutting a step's proposal to its first n nodes (labkit.tuning's
cost-aware budget, after Sequoia: the best tree size depends on the hardware) sets `needs_best_first`, and the
loop then refuses a drafter whose proposals are not listed best first.
"""
from __future__ import annotations

from .trace import Step


class BudgetPolicy:
    """The interface: the tree nodes of the next step (0: a plain step), learning from each step taken."""
    name = "policy"
    needs_best_first = False      # True: judges budgets n < N by a proposal's first n nodes (Needs.best_first)
    max_budget: int               # the most nodes a step may ask for (the compiled loop sizes its verify by it)

    def start(self, prompt_ids) -> None:
        """A new sequence, its prompt (T,) already in the target's cache."""

    def budget(self) -> int:
        raise NotImplementedError

    def update(self, step: Step) -> None:
        """Learn from the step just taken."""

    def plain_steps(self) -> int:
        """Asked when budget() has just said 0: plain steps from this one on for sure (the compiled tree loop takes
        them at once); 1 unless the policy knows more."""
        return 1


class FixedBudget(BudgetPolicy):
    """The same number of tree nodes every step."""
    name = "fixed"

    def __init__(self, nodes: int):
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"budget (tree nodes per step) must be an integer >= 1, got {nodes!r}")
        self.nodes = nodes

    def budget(self) -> int:
        return self.nodes

    @property
    def max_budget(self) -> int:
        return self.nodes
