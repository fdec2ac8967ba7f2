"""The cost-aware tree budget: counterfactual acceptance from one verified tree, and a choice that follows cost."""
import copy
import statistics

import pytest
import torch

from labkit import autoregressive_generate, tree_generate
from labkit.core.adaptive import VerifyCurve, VerifyTime
from labkit.core.sampling import GREEDY
from labkit.core.trace import Step
from labkit.core.tree_budget import FixedBudget
from labkit.drafters.base import Drafter, Needs, Proposal
from labkit.drafters.eagle import EagleDrafter
from labkit.drafters.lookahead import LookaheadDrafter
from labkit.drafters.medusa import MedusaDrafter, medusa_tree
from labkit.drafters.suffix import SuffixDrafter
from labkit.models.eagle_heads import EagleConfig, EagleHead
from labkit.models.medusa_heads import MedusaHeads
from labkit.models.target import as_tree_target
from labkit.tuning.shadow import Shadow, follow_shadows
from labkit.tuning.tree_budget import PRIOR_STEPS, PROBE_COST, CostAwareBudget


def step(nodes: int, path: list[int], verify: float, draft: float = 0.0) -> Step:
    return Step(list(range(nodes)), len(path), 0, False, draft, verify, parents=[-1] * nodes, path=path)


def test_one_verified_tree_says_what_every_smaller_budget_would_commit():
    policy = CostAwareBudget(max_budget=8, prior=0)
    policy.budget()
    policy.update(step(8, [0, 2, 5], 0.1))                 # accepted nodes 0 -> 2 -> 5
    assert [policy.tokens_committed(n) for n in (1, 2, 3, 5, 6, 8)] == [2, 2, 3, 3, 4, 4]
    assert policy.tokens_committed(9) is None               # nothing verified 9 nodes


def test_a_drafter_that_proposed_fewer_speaks_for_larger_budgets():
    policy = CostAwareBudget(max_budget=16, prior=0)
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
    assert chosen[8] == chosen[16] == 32   # exploring the largest tree: it costs next to nothing more


def test_steep_verify_cost_keeps_the_tree_small_or_drafts_nothing():
    steep = lambda t: 0.02 + 0.1 * t       # noqa: E731
    chosen = feed(CostAwareBudget(max_budget=32, min_budget=1, explore_every=8), steep)
    exploiting = [n for i, n in enumerate(chosen) if i > 8 and i % 8]
    assert set(exploiting) == {1}          # each node costs most of a step and pays two thirds of a token
    assert chosen[8] == chosen[16] == 2    # every 8th step explores twice the best, not the dear largest tree
    # plain steps allowed (the default): one node yields 1.67 tokens in 0.22 s (7.6 tok/s), a plain step 1 token
    # in 0.12 s (8.3 tok/s); so no draft, and one node is tried at step 8, then 16 steps later (a backoff)
    chosen = feed(CostAwareBudget(max_budget=32, explore_every=8), steep, n_steps=60)
    assert chosen[:2] == [32, 0]
    assert [i for i, n in enumerate(chosen) if n and i >= 2] == [8, 24, 56]
    assert chosen[8] == chosen[24] == chosen[56] == 1


def test_exploring_backs_off_while_plain_steps_stay_best_and_resumes_its_pace_once_drafting_pays():
    """A drafter that is never right for 40 steps, then right five nodes deep: the exploring steps come 8, 16
    and 32 steps apart while nothing is accepted, every 8 steps again once trees pay."""
    policy, chosen = CostAwareBudget(max_budget=16, explore_every=8, verify_curve=STEP_CURVE), []
    for i in range(120):
        n = policy.budget()
        chosen.append(n)
        path = [j for j in range(5) if j < n] if i >= 40 else []
        policy.update(step(n, path, 0.1 * VerifyCurve(STEP_CURVE)(n + 1), draft=0.001 * n))
    # with a measured curve one warmup step: the largest tree the curve prices at most PROBE_COST above a plain step
    assert chosen[0] == max(n for n in range(17) if VerifyCurve(STEP_CURVE)(n + 1) <= 1 + PROBE_COST) > 0
    drafted = [i for i, n in enumerate(chosen) if n]
    assert drafted[:4] == [0, 8, 24, 56], "while nothing is accepted, exploring steps come 8, 16, 32 steps apart"
    assert all(n >= 5 for n in chosen[70:]), f"drafting resumed: {chosen[56:]}"


def test_a_cost_aware_budget_knows_its_plain_steps_until_the_next_exploring_step():
    """What the compiled tree loop asks on a plain step, to take the plain steps that follow at once: on every plain
    step, how many steps remain until the budget drafts again (no shadows: the compiled loop proposes none)."""
    policy, chosen, sure = CostAwareBudget(max_budget=16, explore_every=8, verify_curve=STEP_CURVE), [], {}
    for i in range(60):
        n = policy.budget()
        chosen.append(n)
        if n == 0:
            sure[i] = policy.plain_steps()
        policy.update(step(n, [], 0.1 * VerifyCurve(STEP_CURVE)(n + 1), draft=0.001 * n))
    drafted = [i for i, n in enumerate(chosen) if n]
    assert drafted[:3] == [0, 8, 24]
    assert sure and all(sure[i] == min(d for d in drafted + [99] if d > i) - i for i in sure if i < drafted[2])
    policy.expect_shadows()
    assert policy.plain_steps() == 1                                      # a shadow may come on any plain step


def test_budget_zero_while_nothing_is_accepted_then_drafting_again_once_it_pays():
    """A drafter that is always wrong for 24 steps, then right five nodes deep: plain steps, then trees again."""
    policy, chosen = CostAwareBudget(max_budget=16, explore_every=4), []
    for i in range(64):
        n = policy.budget()
        chosen.append(n)
        path = [j for j in range(5) if j < n] if i >= 24 else []
        policy.update(step(n, path, 0.1 + 0.001 * (n + 1), draft=0.002 * n))
    assert set(chosen[6:24]) - {0} <= {n for i, n in enumerate(chosen[6:24], 6) if i % 4 == 0}, \
        "while nothing is accepted, only the exploring steps draft"
    assert chosen[6:24].count(0) >= 12
    assert all(n >= 5 for n in chosen[40:]), f"drafting resumed: {chosen[24:]}"


STEP_CURVE = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.8, 32: 3.4, 64: 6.7}   # flat to 8 tokens, then steep (a CPU)


@pytest.mark.parametrize("curve", [None, STEP_CURVE])
def test_the_reading_of_the_remembered_steps_kept_between_steps_follows_every_change_to_them(curve):
    """The budget works out what its history says once per change to it: a verified step, a new shadow, a shadow's
    path growing in place, an old step falling out of the window. After each, and after plain steps that change
    nothing but the verify seconds, it says what a reading from scratch says, and chooses the same."""
    policy = CostAwareBudget(max_budget=8, window=4, verify_curve=curve)
    policy.expect_shadows()
    shadow = Shadow(start=3, tokens=[7, 5, 8, 9], parents=[-1, -1, 0, 2], seconds=0.01)
    for i, (budget, path) in enumerate([(0, []), (8, [0, 2]), (0, []), (4, [1]), (0, []), (8, [0, 1, 3]),
                                        (2, []), (0, []), (8, [0])]):
        policy.budget()
        policy.last = budget
        policy.update(step(budget, path, 0.1 + 0.01 * budget + 0.003 * i, draft=0.002))
        if i == 2:
            policy.add_shadow(shadow)
        if i in (3, 4):                                   # the committed tokens 7, then 8: the shadow's path grows
            follow_shadows([shadow], [0, 1, 2, 7, 8][:i + 1], policy)
        assert policy.estimates() == fresh(policy).estimates()
        assert policy.best() == fresh(policy).best()
    assert shadow.path == [0, 2] and len(policy.history) == 4             # it grew, and the window dropped steps


def fresh(policy: CostAwareBudget) -> CostAwareBudget:
    """The same policy with no reading of its history kept: it works out what the remembered steps say anew."""
    copied = copy.copy(policy)
    copied._remembered = None
    return copied


def test_curve_fit_interpolates_the_measured_curve_and_scales_it_to_the_run():
    fit = VerifyTime(STEP_CURVE)
    assert fit(5) == 0.0                                            # nothing seen yet
    assert [fit.curve(n) for n in (1, 6, 8, 12, 24, 128)] == pytest.approx([1.0, 1.0, 1.0, 1.4, 2.6, 13.3])
    fit.add(4, 0.08)
    fit.add(32, 0.272)                                              # 3.4 x 0.08: the same unit
    assert fit(1) == pytest.approx(0.08) and fit(16) == pytest.approx(0.144)
    with pytest.raises(ValueError, match="verify_curve"):
        VerifyCurve({1: 1.0})


def test_a_flat_then_steep_verify_cost_buys_the_flat_stretch_that_a_line_would_not():
    """Nodes 0..6 are kept two steps in three; the verify costs STEP_CURVE: 7 nodes (8 tokens) cost one step."""
    def verify_of(t):
        return 0.1 * VerifyCurve(STEP_CURVE)(t)

    def chosen(policy):
        picks = []
        for i in range(40):
            n = policy.budget()
            picks.append(n)
            policy.update(step(n, [j for j in range(7) if j < n] if i % 3 else [], verify_of(n + 1)))
        return [n for i, n in enumerate(picks) if i > 8 and i % 8]
    assert set(chosen(CostAwareBudget(max_budget=64, verify_curve=STEP_CURVE))) == {7}
    line = chosen(CostAwareBudget(max_budget=64))                   # a straight line charges every node its slope
    assert statistics.mode(line) < 7


PROMPT = torch.tensor([1, 4, 2, 5, 1, 4, 7, 5, 1, 4, 2, 5, 1, 4, 9, 5, 1, 4, 2, 5, 1, 4])


def eagle(target):
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(target, hidden_dim=96), target.vocab_size, target.max_seq_len).eval()
    return EagleDrafter(head, target, top_k=4, depth=5)


def medusa(target):
    heads = MedusaHeads(target.lm_head, 3)
    torch.manual_seed(0)
    for block in heads.blocks:                                  # trained-looking heads: each guesses differently
        torch.nn.init.normal_(block.linear.weight, std=0.3)
    acc = torch.tensor([[0.6, 0.75, 0.8, 0.85], [0.4, 0.5, 0.6, 0.65], [0.3, 0.4, 0.45, 0.5]])
    return MedusaDrafter(heads, medusa_tree(acc, 40))


TREE_DRAFTERS = {"suffix": lambda target: SuffixDrafter(spec_factor=6.0), "eagle": eagle, "medusa": medusa}


def started(name, target):
    """The drafter after the target's prefill of PROMPT, as the tree loop starts it."""
    drafter = TREE_DRAFTERS[name](target)
    with torch.no_grad():
        tree_target = as_tree_target(target)
        features = tree_target.features(PROMPT[None, :-1], tree_target.new_cache()) if drafter.needs.features else None
    drafter.start(PROMPT, features)
    return drafter


@pytest.mark.parametrize("name", TREE_DRAFTERS)
def test_the_first_n_nodes_of_a_best_first_proposal_are_its_proposal_with_budget_n(tiny_target, name):
    """What the counterfactual rests on: one verified tree of N nodes stands for every budget n <= N."""
    drafter = started(name, tiny_target)
    assert drafter.needs.best_first
    big = drafter.propose(PROMPT, 32, GREEDY)
    assert big.k >= 8 and (name == "suffix" or not big.is_chain)
    for n in (1, 2, 3, 5, 8, big.k):
        small = drafter.propose(PROMPT, n, GREEDY)
        cut = big.limit(n)
        assert small.tokens.tolist() == cut.tokens.tolist(), n
        assert small.as_tree().parents.tolist() == cut.as_tree().parents.tolist(), n


@pytest.mark.parametrize("name", TREE_DRAFTERS)
def test_greedy_tree_decoding_with_a_cost_aware_budget_is_exact(tiny_target, name):
    out = tree_generate(tiny_target, TREE_DRAFTERS[name](tiny_target), PROMPT, 40,
                        budget=CostAwareBudget(max_budget=24))
    assert out.tokens == autoregressive_generate(tiny_target, PROMPT, 40).tokens
    assert len({len(s.proposed) for s in out.trace.steps}) > 1          # the budget moved


def test_a_drafter_not_listed_best_first_is_refused_a_cost_aware_budget(tiny_target):
    with pytest.raises(ValueError, match="best first"):
        tree_generate(tiny_target, LookaheadDrafter(), PROMPT, 8, budget=CostAwareBudget(max_budget=8))
    hand_written = MedusaDrafter(MedusaHeads(tiny_target.lm_head, 2), [(0, 0), (0,), (1,)])   # sorted by depth
    assert not hand_written.needs.best_first


def test_budgets_refuse_bad_values():
    with pytest.raises(ValueError, match="budget"):
        FixedBudget(0)
    with pytest.raises(ValueError, match="min_budget <= max_budget"):
        CostAwareBudget(max_budget=4, min_budget=8)
    with pytest.raises(ValueError, match="max_budget >= 1"):
        CostAwareBudget(max_budget=0)


class Oracle(Drafter):
    """Proposes the known answer (a chain, at no cost), every token shifted to another until the sequence holds
    `until` tokens: always wrong, then always right."""
    name, needs = "oracle", Needs(best_first=True)

    def __init__(self, answer: list[int], until: int, vocab_size: int):
        self.answer, self.until, self.vocab_size = answer, until, vocab_size

    def propose(self, tokens, k, sampling, generator=None):
        chain = torch.tensor(self.answer[len(tokens):len(tokens) + k] or [0])
        if len(tokens) < self.until:
            chain = (chain + 1) % self.vocab_size
        return Proposal(chain, None, torch.ones(len(chain)))


def test_tree_decoding_takes_plain_steps_when_the_drafter_is_wrong_and_stays_exact(tiny_target):
    ref = autoregressive_generate(tiny_target, PROMPT, 96)
    answer = PROMPT.tolist() + ref.tokens
    for until in (10**6, len(PROMPT) + 40):                         # always wrong; wrong for 40 tokens, then right
        out = tree_generate(tiny_target, Oracle(answer, until, tiny_target.vocab_size), PROMPT, 96,
                            budget=CostAwareBudget(max_budget=16, explore_every=4, verify_curve=STEP_CURVE))
        assert out.tokens == ref.tokens, until
        plain = [not s.proposed for s in out.trace.steps]
        assert sum(plain) >= len(plain) // 2, f"plain steps {sum(plain)} of {len(plain)}"
        if until < 10**6:
            late = out.trace.steps[-8:]
            assert sum(s.n_accepted for s in late) >= 8, "drafting resumed once the drafter was right"


def test_without_a_curve_the_verify_time_is_a_decayed_line_never_falling():
    fit = VerifyTime()
    fit.add(2, 0.10)
    assert fit(9) == pytest.approx(0.10), "one size seen: flat"
    fit.add(8, 0.16)
    assert fit(5) == pytest.approx(0.13, abs=0.005) and fit(8) > fit(2)
    falling = VerifyTime()
    falling.add(2, 0.2)
    falling.add(8, 0.1)
    assert falling(64) == pytest.approx(falling(2)), "a slope below zero is read as flat"


def test_a_tree_must_beat_a_plain_step_by_the_margin():
    """One node kept every step: 2 tokens a step. Priced so that the tree is 3% faster than plain decoding, plain
    steps win (within the 5% margin); priced 10% faster, the tree wins; with margin 0 the 3% tree wins too."""
    def run(gain: float, **kw) -> list[int]:
        policy, chosen = CostAwareBudget(max_budget=1, explore_every=100, prior=0, **kw), []
        plain = 0.1
        for i in range(12):
            n = policy.budget()
            chosen.append(n)
            seconds = plain if n == 0 else 2 * plain / (1 + gain)          # 2 tokens at (1 + gain) x plain's rate
            policy.update(step(n, [0] if n else [], seconds))
        return chosen[2:]
    assert set(run(0.03)) == {0}
    assert set(run(0.10)) == {1}
    assert set(run(0.03, margin=0.0)) == {1}
    with pytest.raises(ValueError, match="margin"):
        CostAwareBudget(margin=1.5)


def test_one_lucky_probe_does_not_start_drafting_but_a_drafter_that_stays_right_does():
    """The prior: a node's acceptance counts PRIOR_STEPS more steps that rejected it. Priced as on the 2-thread
    Xeon (a 2-token verify 1.1 steps, the heads 0.3 of a step), one node kept in one probe (1 of 1) is judged 1 of 3
    and the next steps are plain; kept at every probe, drafting starts by the second probe and goes on."""
    cpu_curve = {1: 1.0, 2: 1.1, 4: 1.25, 8: 1.3, 16: 1.75, 32: 1.85, 64: 2.8}

    def run(path_of, steps=12, **kw) -> list[int]:
        policy, chosen = CostAwareBudget(max_budget=4, verify_curve=cpu_curve, **kw), []
        for i in range(steps):
            n = policy.budget()
            chosen.append(n)
            policy.update(step(n, path_of(i, n), 0.1 * VerifyCurve(cpu_curve)(n + 1), draft=0.03 if n else 0.0))
        return chosen
    lucky = lambda i, n: [0] if i == 0 and n else []          # noqa: E731  right once, never again
    assert run(lucky, explore_every=100, prior=0)[1] > 0, "counted as 1 of 1 the node looks certain: it drafts"
    assert run(lucky, explore_every=100)[1:] == [0] * 11
    right = lambda i, n: list(range(n))                       # noqa: E731  every node kept, every step
    chosen = run(right, explore_every=4)
    assert chosen[0] > 0 and all(n > 0 for n in chosen[4:]), f"a drafter that is right keeps drafting: {chosen}"
    assert CostAwareBudget().prior == PRIOR_STEPS == 2
    with pytest.raises(ValueError, match="prior"):
        CostAwareBudget(prior=-1)
