"""Speed choices beside the algorithm: policies and wrappers that make speculation pay on a given machine.

The loops (labkit.decoding), the drafters and the math (labkit.core) never import this package; each piece here
is something a loop takes through the interfaces those already have:

- `gamma.CostAwareGamma` and `tree_budget.CostAwareBudget`: γ and tree-budget policies priced on this machine's
  verify curve and this run's timings (core.adaptive.BestRateGamma is the short version of the same idea);
- `shadow.Shadowed`: a policy wrapper whose plain steps still propose, unverified, so a cost-aware policy notices
  when drafting would pay again without spending a verify;
- `gate.DraftGate`: across the requests of one workload, whether a request drafts at all.

What each buys, measured, is in docs/benchmark.md.
"""
from .gamma import CostAwareGamma
from .gate import DraftGate, drafting_paid
from .shadow import Shadow, Shadowed
from .tree_budget import CostAwareBudget

__all__ = ["CostAwareGamma", "CostAwareBudget", "DraftGate", "drafting_paid", "Shadow", "Shadowed"]
