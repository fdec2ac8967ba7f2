"""Shadow proposals: on plain steps the drafter still guesses, unverified, and the committed tokens judge it."""
import pytest
import torch
from test_tree_budget import PROMPT, STEP_CURVE, Oracle

from labkit import autoregressive_generate, speculative_generate, tree_generate
from labkit.core.sampling import GREEDY, SamplingConfig
from labkit.core.trace import Step
from labkit.core.tree import Tree
from labkit.core.tree_budget import FixedBudget
from labkit.core.typical import typical_accept_rule
from labkit.decoding.loops import why_not_compiled
from labkit.drafters.base import Drafter, Needs, Proposal
from labkit.tuning import CostAwareBudget, CostAwareGamma, Shadow, Shadowed


def test_a_shadow_follows_the_committed_tokens_down_one_branch_and_settles_at_a_miss_or_a_leaf():
    #   root -> 7 (0) -> 8 (2) -> 9 (4)
    #        -> 5 (1) -> 8 (3)
    shadow = Shadow(start=3, tokens=[7, 5, 8, 8, 9], parents=[-1, -1, 0, 1, 2])
    committed = [1, 2, 3]
    assert shadow.follow(committed) == 0 and not shadow.settled          # nothing committed after it yet
    assert shadow.follow(committed + [5]) == 1 and shadow.path == [1] and not shadow.settled
    assert shadow.follow(committed + [5, 8]) == 1 and shadow.path == [1, 3] and shadow.settled   # a leaf
    assert shadow.reached_leaf
    miss = Shadow(start=3, tokens=[7, 5, 8, 8, 9], parents=[-1, -1, 0, 1, 2])
    assert miss.follow(committed + [7, 8, 4, 9]) == 2 and miss.path == [0, 2] and miss.settled
    assert not miss.reached_leaf                                          # node 4 (9) was not the target's 4


class Sloppy(Drafter):
    """A tree after each position: the answer's next four tokens as a chain, with the third one wrong every other
    position, and a wrong sibling of the first; at no cost."""
    name, needs = "sloppy", Needs(best_first=True)

    def __init__(self, answer: list[int], vocab_size: int):
        self.answer, self.vocab_size = answer, vocab_size

    def propose(self, tokens, k, sampling, generator=None):
        nxt = self.answer[len(tokens):len(tokens) + 4]
        if len(nxt) < 4:
            return Proposal.empty(torch.as_tensor(tokens))
        chain = list(nxt)
        if len(tokens) % 2:
            chain[2] = (chain[2] + 1) % self.vocab_size
        nodes = [(chain[0] + 1) % self.vocab_size] + chain                  # the wrong sibling comes first
        return Proposal(torch.tensor(nodes), None, torch.ones(5), Tree(torch.tensor([-1, -1, 1, 2, 3]))).limit(k)


class PlainWithShadows(CostAwareBudget):
    """Every step plain, a shadow of the largest tree every step (recorded)."""
    def __init__(self):
        super().__init__(max_budget=5, verify_curve=STEP_CURVE, shadow_share=0.99)
        self.seen: list[Shadow] = []

    def budget(self) -> int:
        self.last = 0
        return 0

    def shadow_size(self) -> int:
        return self.max_budget

    def add_shadow(self, shadow):
        super().add_shadow(shadow)
        self.seen.append(shadow)


def test_a_shadow_keeps_the_nodes_that_verifying_its_tree_would_keep(tiny_target):
    """The proposal made unverified at each plain step, judged by the tokens the next steps committed, against the
    same proposal verified for real by the target after the same tokens: the same accepted path."""
    ref = autoregressive_generate(tiny_target, PROMPT, 24)
    answer = PROMPT.tolist() + ref.tokens
    drafter, policy = Sloppy(answer, tiny_target.vocab_size), PlainWithShadows()
    out = tree_generate(tiny_target, drafter, PROMPT, 24, budget=Shadowed(policy, drafter))
    assert out.tokens == ref.tokens and all(not s.proposed for s in out.trace.steps)
    settled = [s for s in policy.seen if s.settled]
    assert len(settled) >= 15 and {len(s.path) for s in settled} >= {2, 4}, "both a miss and a whole chain"
    for shadow in settled:
        prefix = torch.tensor(answer[:shadow.start])
        verified = tree_generate(tiny_target, drafter, prefix, 8, budget=FixedBudget(5)).trace.steps[0]
        assert verified.path == shadow.path, shadow.start


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=0.8, top_p=0.9)], ids=["greedy", "sampled"])
def test_a_tree_run_of_plain_steps_is_plain_decoding_token_for_token_sampled_too(tiny_target, sampling):
    """Every step plain (budget 0) with a shadow proposed before it: the tree loop picks the target's token after the
    root as plain decoding does, drawing from the same generator, so a seeded sampled run commits the very tokens
    of a seeded plain run (not only their distribution); Medusa's typical acceptance, greedy, the greedy tokens."""
    ref = autoregressive_generate(tiny_target, PROMPT, 24, sampling, seed=5)
    drafter = Sloppy(PROMPT.tolist() + ref.tokens, tiny_target.vocab_size)
    out = tree_generate(tiny_target, drafter, PROMPT, 24, Shadowed(PlainWithShadows(), drafter), sampling, seed=5)
    assert out.tokens == ref.tokens
    assert all(not s.proposed and s.asked == 0 for s in out.trace.steps) and out.trace.steps[0].shadow == 5
    if sampling.greedy:
        typical = tree_generate(tiny_target, drafter, PROMPT, 24, Shadowed(PlainWithShadows(), drafter),
                                accept_rule=typical_accept_rule())
        assert typical.tokens == ref.tokens


def steps_to_drafting(steps, after_tokens: int) -> tuple[int, int]:
    """(the first step after `after_tokens` new tokens, the first step that kept a drafted token; len(steps) if none)"""
    starts = [sum(s.n_committed for s in steps[:i]) for i in range(len(steps))]
    first_right = next(i for i, n in enumerate(starts) if n >= after_tokens)
    return first_right, next((i for i, s in enumerate(steps) if s.n_accepted > 0), len(steps))


def test_plain_steps_find_out_from_shadows_when_drafting_pays_and_verify_no_probe(tiny_target):
    """An always-wrong draft: every step plain, and no tree is ever verified (without shadows, probes are); the
    same draft right after 40 tokens: drafting starts within four steps of it. The output is plain decoding's.
    (A tiny model's step costs what the drafter's Python does, so the shadows get most of a step here.)"""
    ref = autoregressive_generate(tiny_target, PROMPT, 96)
    answer, V = PROMPT.tolist() + ref.tokens, tiny_target.vocab_size

    def run(until: int, shadow_share: float = 0.9):
        drafter = Oracle(answer, until, V)
        budget = CostAwareBudget(max_budget=16, explore_every=4, verify_curve=STEP_CURVE, shadow_share=shadow_share)
        return tree_generate(tiny_target, drafter, PROMPT, 96, budget=Shadowed(budget, drafter))
    wrong = run(10**6)
    assert wrong.tokens == ref.tokens
    assert all(not s.proposed for s in wrong.trace.steps), "no tree verified: shadows instead of probes"
    assert sum(s.shadow > 0 for s in wrong.trace.steps) >= len(wrong.trace.steps) // 2
    probing = run(10**6, shadow_share=0.0)
    assert probing.tokens == ref.tokens and any(s.proposed for s in probing.trace.steps), "without shadows: probes"
    late = run(len(PROMPT) + 40)
    assert late.tokens == ref.tokens
    first_right, first_kept = steps_to_drafting(late.trace.steps, after_tokens=40)
    assert first_kept - first_right <= 4, (first_right, first_kept)
    assert all(not s.proposed for s in late.trace.steps[:first_right]), "no probe while the draft was wrong"


def test_a_cheap_chain_drafter_shadows_its_plain_steps_and_ends_its_warmup_after_one_draft(tiny_target):
    """Through the chain loop: a free, always-wrong draft is verified once (the first step times it), then every step
    is plain with a shadow; right after 40 tokens it drafts again within four steps (a tiny model's steps are timed,
    and the shadows are paid from that time). The verify curve is given, as the bench gives the machine's: fitted
    from one run's steps, its slope rests on the first step's timing alone and moves the α that pays by chance."""
    def policy(drafter):
        return Shadowed(CostAwareGamma(start=3, shadow_share=0.9, verify_curve=STEP_CURVE), drafter)
    ref = autoregressive_generate(tiny_target, PROMPT, 96)
    answer, V = PROMPT.tolist() + ref.tokens, tiny_target.vocab_size
    oracle = Oracle(answer, 10**6, V)
    wrong = speculative_generate(tiny_target, oracle, PROMPT, 96, policy(oracle))
    assert wrong.tokens == ref.tokens
    assert [bool(s.proposed) for s in wrong.trace.steps].count(True) == 1, "one warm-up draft, then only shadows"
    assert sum(s.shadow > 0 for s in wrong.trace.steps) >= len(wrong.trace.steps) // 2
    oracle = Oracle(answer, len(PROMPT) + 40, V)
    late = speculative_generate(tiny_target, oracle, PROMPT, 96, policy(oracle))
    assert late.tokens == ref.tokens
    first_right, first_kept = steps_to_drafting(late.trace.steps, after_tokens=40)
    assert first_kept - first_right <= 4, (first_right, first_kept)


def test_shadows_are_held_to_their_share_of_the_plain_steps_time_and_come_where_probes_would_have():
    """With a 1% share the shadows cost at most 1% of the plain steps' time and one shadow besides: one that costs
    half a plain step comes first (which times it), then once its debt is paid and the next is banked (100 plain
    steps on); one that costs 100 steps, the first only; one that costs a tenth of a step also where an exploring
    step would have been (8, 16, 32, ... plain steps apart) whenever the last one is paid for."""
    def shadow_steps(seconds: float, explore_every: int) -> list[int]:
        policy = CostAwareBudget(max_budget=8, verify_curve=STEP_CURVE, explore_every=explore_every)
        policy.expect_shadows()
        steps = []
        for i in range(150):
            assert policy.budget() == 0
            if policy.shadow_size():
                steps.append(i)
                policy.add_shadow(Shadow(start=i, tokens=[1, 2], parents=[-1, 0], seconds=seconds, settled=True))
            policy.update(Step([], 0, 0, False, 0.0, 0.1, parents=[], path=[], asked=0))
        return steps
    assert shadow_steps(0.05, explore_every=1000) == [0, 100]
    assert shadow_steps(10.0, explore_every=8) == [0]
    steps = shadow_steps(0.01, explore_every=8)
    assert {16, 32, 64, 128} <= set(steps) and 8 not in steps and len(steps) > 5     # at 8 the first is not paid yet
    assert all(0.01 * i <= 0.01 * 0.1 * step + 0.01 + 1e-12 for i, step in enumerate(steps))   # share + one shadow


def test_a_shadow_share_outside_zero_to_one_is_refused_with_what_it_means():
    for bad in (-0.1, 1.0, 2, True, "1%"):
        with pytest.raises(ValueError, match="shadow_share is a share of the plain steps' time"):
            CostAwareBudget(shadow_share=bad)
        with pytest.raises(ValueError, match="shadow_share is a share of the plain steps' time"):
            CostAwareGamma(shadow_share=bad)
    off = CostAwareBudget(shadow_share=0, verify_curve=STEP_CURVE)
    off.expect_shadows()                                              # a loop that shadows, a policy that does not
    assert off.budget() > 0 and not off.shadows, "0: no shadows, the first step a probe as before"


def test_without_the_wrapper_a_cost_aware_policy_makes_no_shadows_and_the_wrapper_refuses_what_it_cannot_run(
        tiny_target):
    """The loops never shadow by themselves: a bare CostAwareGamma probes; Shadowed refuses a policy that cannot
    learn from shadows, keeps the compiled loop off (why_not_compiled says why) and refuses to guess before a loop
    has started it."""
    ref = autoregressive_generate(tiny_target, PROMPT, 48)
    answer, V = PROMPT.tolist() + ref.tokens, tiny_target.vocab_size
    bare = speculative_generate(tiny_target, Oracle(answer, 10**6, V), PROMPT, 48,
                                CostAwareGamma(start=3, shadow_share=0.9))
    assert bare.tokens == ref.tokens and all(s.shadow == 0 for s in bare.trace.steps)
    with pytest.raises(ValueError, match="has no shadow_size"):
        Shadowed(FixedBudget(4), Oracle(answer, 0, V))
    wrapped = Shadowed(CostAwareGamma(start=3), Oracle(answer, 0, V))
    assert "only the eager loops" in why_not_compiled(tiny_target, Oracle(answer, 0, V), wrapped, GREEDY, False)
    with pytest.raises(RuntimeError, match="start"):
        Shadowed(PlainWithShadows(), Oracle(answer, 0, V)).budget()
