"""The cost-aware tree budget: counterfactual acceptance from one verified tree, and a choice that follows cost."""
import pytest
import torch

from labkit import autoregressive_generate, tree_generate
from labkit.core.trace import Step
from labkit.core.tree_budget import CostAwareBudget, FixedBudget
from labkit.drafters.suffix import SuffixDrafter


def step(nodes: int, path: list[int], verify: float, draft: float = 0.0) -> Step:
    return Step(list(range(nodes)), len(path), 0, False, draft, verify, parents=[-1] * nodes, path=path)


def test_one_verified_tree_says_what_every_smaller_budget_would_commit():
    policy = CostAwareBudget(max_budget=8)
    policy.budget()
    policy.update(step(8, [0, 2, 5], 0.1))                 # accepted nodes 0 -> 2 -> 5
    assert [policy.tokens_committed(n) for n in (1, 2, 3, 5, 6, 8)] == [2, 2, 3, 3, 4, 4]
    assert policy.tokens_committed(9) is None               # nothing verified 9 nodes


def test_a_drafter_that_proposed_fewer_speaks_for_larger_budgets():
    policy = CostAwareBudget(max_budget=16)
    policy.budget()
    policy.update(step(3, [0, 1, 2], 0.1))                  # the drafter had only 3 nodes to give
    assert policy.tokens_committed(16) == 4                 # a bigger budget would not have added any


def feed(policy: CostAwareBudget, verify_of, n_steps: int = 24) -> list[int]:
    """Steps that keep nodes 0 -> 1 -> ... -> 5 two steps in three and nothing on the third, timed by
    verify_of(nodes + 1): a budget of n commits 1 + 2/3 min(n, 6) tokens a step on average."""
    chosen = []
    for i in range(n_steps):
        n = policy.budget()
        chosen.append(n)
        policy.update(step(n, [j for j in range(6) if j < n] if i % 3 else [], verify_of(n + 1)))
    return chosen


def test_flat_verify_cost_buys_the_whole_accepted_depth():
    chosen = feed(CostAwareBudget(max_budget=32, explore_every=8), lambda t: 0.1 + 0.0001 * t)
    exploiting = [n for i, n in enumerate(chosen) if i > 8 and i % 8]     # once a large tree was seen to pay
    assert set(exploiting) == {6}          # deeper nodes are never kept; 6 is all the gain, nearly free


def test_steep_verify_cost_keeps_the_tree_small():
    chosen = feed(CostAwareBudget(max_budget=32, explore_every=8), lambda t: 0.02 + 0.1 * t)
    exploiting = [n for i, n in enumerate(chosen) if i > 8 and i % 8]
    assert set(exploiting) == {1}          # each node costs most of a step and pays two thirds of a token
    assert chosen[8] == chosen[16] == 32   # but every 8th step explores the largest tree again


def test_greedy_tree_decoding_with_a_cost_aware_budget_is_exact(tiny_target):
    prompt = torch.tensor([1, 4, 2, 1, 4, 7, 1, 4])
    out = tree_generate(tiny_target, SuffixDrafter(), prompt, 40, budget=CostAwareBudget(max_budget=24))
    assert out.tokens == autoregressive_generate(tiny_target, prompt, 40).tokens


def test_budgets_refuse_bad_values():
    with pytest.raises(ValueError, match="budget"):
        FixedBudget(0)
    with pytest.raises(ValueError, match="min_budget <= max_budget"):
        CostAwareBudget(max_budget=4, min_budget=8)
