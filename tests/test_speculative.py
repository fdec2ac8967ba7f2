"""Greedy speculative decoding equals greedy autoregressive decoding, token for token, and rolls back exactly."""
import pytest
import torch
from conftest import tiny_model

from labkit import (
    BestRateGamma,
    DraftModelDrafter,
    HeuristicGamma,
    PromptLookupDrafter,
    SpeculativeDecoder,
    TreeDecoder,
    autoregressive_generate,
    speculative_generate,
    tree_generate,
)
from labkit.drafters.window import Windowed
from labkit.tuning import CostAwareGamma

PROMPTS = [torch.tensor([5, 17, 33, 2, 9]), torch.tensor([1]), torch.tensor([7, 8, 9, 7, 8, 9, 7, 8])]


@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["plain", "one-token", "repetitive"])
def test_draft_model_greedy_equals_autoregressive(tiny_target, tiny_draft, prompt, gamma):
    ref = autoregressive_generate(tiny_target, prompt, max_new_tokens=40)
    out = speculative_generate(tiny_target, DraftModelDrafter(tiny_draft), prompt, max_new_tokens=40, gamma=gamma)
    assert out.tokens == ref.tokens
    assert out.trace.n_generated == 40 and len(out.tokens) == 40


@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["plain", "one-token", "repetitive"])
def test_prompt_lookup_greedy_equals_autoregressive(tiny_target, prompt, gamma):
    ref = autoregressive_generate(tiny_target, prompt, max_new_tokens=40)
    out = speculative_generate(tiny_target, PromptLookupDrafter(), prompt, max_new_tokens=40, gamma=gamma)
    assert out.tokens == ref.tokens


@pytest.mark.parametrize("policy", [lambda: HeuristicGamma(start=3), lambda: BestRateGamma(start=2),
                                    lambda: CostAwareGamma(start=2)], ids=["heuristic", "best-rate", "cost-aware"])
def test_adaptive_gamma_greedy_equals_autoregressive(tiny_target, tiny_draft, policy):
    prompt = PROMPTS[0]
    ref = autoregressive_generate(tiny_target, prompt, max_new_tokens=50)
    out = speculative_generate(tiny_target, DraftModelDrafter(tiny_draft), prompt, 50, gamma=policy())
    assert out.tokens == ref.tokens
    assert len({s.gamma for s in out.trace.steps}) > 1, "an adaptive policy should have changed gamma"


def test_draft_equal_to_target_accepts_everything(tiny_target):
    out = speculative_generate(tiny_target, DraftModelDrafter(tiny_target), PROMPTS[0], max_new_tokens=30, gamma=4)
    assert out.trace.acceptance_rate == 1.0
    assert all(s.bonus for s in out.trace.steps[:-1])
    assert out.trace.tokens_per_forward == pytest.approx(30 / out.trace.n_target_forwards)
    assert out.trace.n_target_forwards == 6   # 5 tokens a pass: 4 drafted + the bonus


def test_unrelated_draft_still_exact_and_mostly_rejected(tiny_target):
    stranger = tiny_model(seed=123)
    ref = autoregressive_generate(tiny_target, PROMPTS[0], max_new_tokens=30)
    out = speculative_generate(tiny_target, DraftModelDrafter(stranger), PROMPTS[0], max_new_tokens=30, gamma=3)
    assert out.tokens == ref.tokens
    assert out.trace.acceptance_rate < 0.5


def test_trace_records_each_step(tiny_target, tiny_draft):
    out = speculative_generate(tiny_target, DraftModelDrafter(tiny_draft), PROMPTS[0], max_new_tokens=25, gamma=3)
    steps = out.trace.steps
    assert sum(s.n_committed for s in steps) == 25
    committed = [t for s in steps for t in s.proposed[: s.n_accepted] + [s.next_token]]
    assert committed == out.tokens
    for s in steps:
        assert len(s.p_target) == len(s.q_draft) == s.gamma
        assert all(0 <= p <= 1 for p in s.p_target + s.q_draft)
        assert s.bonus == (s.n_accepted == s.gamma)
    assert 0 < out.trace.acceptance_rate < 1


def test_rollback_cache_equals_recomputed(tiny_target, tiny_draft):
    dec = SpeculativeDecoder(tiny_target, DraftModelDrafter(tiny_draft), PROMPTS[0], max_new_tokens=30, gamma=4)
    for _ in range(6):
        dec.step()
    assert any(not s.bonus for s in dec.trace.steps), "the test needs at least one rejection"
    for model, cache in [(tiny_target, dec.cache), (tiny_draft, dec.drafter.cache)]:
        fresh = model.new_cache()
        model(torch.tensor(dec.tokens[: cache.length])[None], fresh)
        assert cache.length <= len(dec.tokens) - 1
        n = cache.length
        torch.testing.assert_close(cache.k[:, :, :, :n], fresh.k[:, :, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.v[:, :, :, :n], fresh.v[:, :, :, :n], rtol=1e-5, atol=1e-5)
    assert dec.cache.length == len(dec.tokens) - 1


def test_eos_inside_draft_stops_there(tiny_target):
    ref = autoregressive_generate(tiny_target, PROMPTS[0], max_new_tokens=30)
    eos = ref.tokens[7]
    first = ref.tokens.index(eos)
    ref_eos = autoregressive_generate(tiny_target, PROMPTS[0], max_new_tokens=30, eos_token_ids=(eos,))
    out = speculative_generate(tiny_target, DraftModelDrafter(tiny_target), PROMPTS[0], 30, gamma=5,
                               eos_token_ids=(eos,))
    assert out.tokens == ref_eos.tokens == ref.tokens[: first + 1]
    assert out.trace.stop_reason == "eos"


def test_context_limit_stops_cleanly():
    model = tiny_model(max_seq_len=20)
    prompt = torch.arange(1, 11)
    ref = autoregressive_generate(model, prompt, max_new_tokens=50)
    out = speculative_generate(model, DraftModelDrafter(model), prompt, max_new_tokens=50, gamma=4)
    assert out.tokens == ref.tokens
    # 20 slots of context: the 21st token is predicted from position 19 and never needs a slot
    assert len(prompt) + len(out.tokens) == 21 and out.trace.stop_reason == "context"


def synthetic_step(gamma: int, n_accepted: int, draft_per_token: float, verify: float):
    from labkit.core.trace import Step
    return Step(proposed=[1] * gamma, n_accepted=n_accepted, next_token=2, bonus=n_accepted == gamma,
                draft_time=gamma * draft_per_token, verify_time=verify)


def test_cost_aware_gamma_stops_drafting_when_it_does_not_pay_and_probes_with_back_off():
    """Every draft rejected and drafting expensive: γ = 0 (plain steps), with a probe every 4, then 8 plain steps."""
    policy = CostAwareGamma(start=3, warmup=2, probe_every=4)
    chosen = []
    for _ in range(40):
        g = policy.gamma()
        chosen.append(g)
        policy.update(synthetic_step(g, 0, draft_per_token=0.05, verify=0.10 + 0.01 * g))
    assert chosen[:2] == [3, 2], "the warm-up's second draft is the length that pays best were 0.8 accepted"
    drafts = [i for i, g in enumerate(chosen) if g > 0]                  # the warm-up's last draft, then probes
    assert chosen[2] == 0
    assert drafts[:5] == [0, 1, 6, 15, 32], f"drafts at steps {drafts}: 4, 8, 16 plain steps between probes"


def test_cost_aware_gamma_drafts_only_where_it_beats_plain_decoding_by_the_margin():
    """Half the drafts accepted at γ = 1 (1.5 tokens a step), plain and γ = 1 steps both timed, priced 3% and 10%
    faster than plain decoding: the 3% draft is within the 5% margin (plain steps), the 10% one drafts; margin 0
    drafts both."""
    def best(gain: float, **kw) -> int:
        policy = CostAwareGamma(start=1, max_gamma=1, warmup=0, **kw)
        for i in range(12):
            g = i % 2
            verify = 0.1 if g == 0 else 1.5 * 0.1 / (1 + gain)
            policy.update(synthetic_step(g, (i // 2) % 2 if g else 0, draft_per_token=0.0, verify=verify))
        return policy._best()
    assert best(0.03) == 0
    assert best(0.10) == 1
    assert best(0.03, margin=0.0) == 1
    with pytest.raises(ValueError, match="margin"):
        CostAwareGamma(margin=-0.1)


def test_cost_aware_gamma_warms_up_only_with_drafts_that_could_pay():
    """On a measured verify curve, half of each draft accepted: a draft costing half a target step a token,
    verified at a steep price, could not pay even were 0.8 of it accepted, so one timed step of `start` is the
    whole warm-up (plain steps follow); a draft costing a tenth of a step a token on a flat curve keeps `start`
    through the warm-up, and on the steep curve too once its first draft was all accepted."""
    def warmup(draft_per_token: float, curve: dict[int, float], accepted=lambda g: g // 2) -> list[int]:
        policy = CostAwareGamma(start=4, warmup=3, probe_every=8, verify_curve=curve)
        chosen = []
        for _ in range(3):
            g = policy.gamma()
            chosen.append(g)
            policy.update(synthetic_step(g, accepted(g), draft_per_token=draft_per_token, verify=0.1 * (1 + 0.3 * g)))
        return chosen
    steep, flat = {1: 1.0, 2: 1.3, 8: 3.1}, {1: 1.0, 2: 1.01, 8: 1.07}
    assert warmup(0.05, steep) == [4, 0, 0]
    assert warmup(0.01, flat) == [4, 4, 4]
    assert warmup(0.01, steep)[1] in (1, 2, 3), "a cheap draft on a steep curve warms up on a shorter chain"
    assert warmup(0.01, steep, accepted=lambda g: g) == [4, 4, 4], "unless it proved better than hoped"
    with pytest.raises(ValueError, match="hope"):
        CostAwareGamma(hope=1.0)


def test_cost_aware_gamma_sizes_its_first_draft_from_costs_measured_before_the_run():
    """Given the draft's and the target's one-token steps (as the bench measures them once), the first draft is
    sized for α = 0.8 as the warm-up's later ones are: the 4-bit pair's prices on the AVX2 EPYC's steep curve
    give 2 tokens, not `start`; a cheap draft on a flat curve keeps `start`; a draft that could not pay even
    then takes a plain step at once. Without them the first step drafts `start`."""
    steep, flat = {1: 1.0, 2: 1.17, 4: 1.34, 8: 2.47, 16: 4.89}, {1: 1.0, 2: 1.01, 8: 1.07}

    def first(costs, curve) -> int:
        return CostAwareGamma(start=4, verify_curve=curve, known_costs=costs).gamma()
    assert first((0.0186, 0.0456), steep) == 2
    assert first((0.002, 0.0456), flat) == 4
    assert first((0.04, 0.0456), steep) == 0
    assert CostAwareGamma(start=4, verify_curve=steep).gamma() == 4
    policy = CostAwareGamma(start=4, verify_curve=steep, known_costs=(0.0186, 0.0456))
    g = policy.gamma()
    policy.update(synthetic_step(g, g, draft_per_token=0.0186, verify=0.0456 * 1.255))
    assert policy.gamma() == 3, "a first draft accepted whole: the next one is sized at the α it measured (1)"
    for bad in ((0.02,), (0.0, 0.04), (0.02, -1), "fast", (True, 0.04)):
        with pytest.raises(ValueError, match="known_costs"):
            CostAwareGamma(known_costs=bad)


def test_cost_aware_gamma_drafts_long_when_verify_is_flat_and_drafts_are_good():
    policy = CostAwareGamma(start=2, warmup=3)
    for _ in range(10):
        g = policy.gamma()
        policy.update(synthetic_step(g, g if g else 0, draft_per_token=0.005, verify=0.1 + 0.001 * (g + 1)))
    assert policy.gamma() >= 8
    assert policy.tokens_per_second(policy.gamma()) > 2 * policy.tokens_per_second(0)


@pytest.mark.serial                 # asserts a bound on measured time
def test_cost_aware_gamma_takes_plain_steps_for_a_wrong_draft_and_drafts_again_once_it_is_right(tiny_target):
    """Chains through the real loop: an (at no cost) always-wrong draft gets plain steps, and the same draft
    right after 40 tokens gets drafting back; the output is plain decoding's either way."""
    from test_tree_budget import Oracle
    prompt = PROMPTS[0]
    ref = autoregressive_generate(tiny_target, prompt, 160)
    answer = prompt.tolist() + ref.tokens
    wrong = speculative_generate(tiny_target, Oracle(answer, 10**6, tiny_target.vocab_size), prompt, 160,
                                 CostAwareGamma(start=3, warmup=2, probe_every=4))
    plain = [s.plain_by_choice for s in wrong.trace.steps]
    assert wrong.tokens == ref.tokens and sum(plain) >= 0.9 * len(plain), f"{sum(plain)} plain of {len(plain)}"
    late = speculative_generate(tiny_target, Oracle(answer, len(prompt) + 12, tiny_target.vocab_size), prompt, 160,
                                CostAwareGamma(start=3, warmup=2, probe_every=4))
    assert late.tokens == ref.tokens and any(s.plain_by_choice for s in late.trace.steps[:12])
    assert sum(s.n_accepted for s in late.trace.steps[-6:]) >= 12, "drafting resumed once the draft was right"


def test_a_windowed_draft_reads_the_sinks_and_the_last_tokens_and_stays_exact(tiny_target, tiny_draft):
    """Windowed(draft, W): the draft's first forward reads the `sinks` first tokens and the last W of a long prompt, its
    cache never holds more than sinks + 2W + γ tokens, and the output is the target's, token for token."""
    prompt = torch.arange(3, 3 + 120) % 90                                   # (120,)
    ref = autoregressive_generate(tiny_target, prompt, 80)
    fed, held = [], []
    hook = tiny_draft.register_forward_pre_hook(lambda mod, args: fed.append(args[0].shape[1]))
    drafter = DraftModelDrafter(Windowed(tiny_draft, 16, sinks=4))
    commit = drafter.commit

    def watched(n, features=None):
        held.append(drafter.cache.length)
        commit(n, features)
    drafter.commit = watched
    try:
        out = speculative_generate(tiny_target, drafter, prompt, 80, gamma=3)
    finally:
        hook.remove()
    assert out.tokens == ref.tokens
    assert fed[0] == 4 + 16, f"the first draft forward read {fed[0]} tokens"
    assert max(held) <= 4 + 2 * 16 + 3 and sum(f == 16 for f in fed[1:]) >= 3, "fresh windows as the text grew"
    whole = DraftModelDrafter(tiny_draft)                                    # no window: the prompt is read whole
    assert speculative_generate(tiny_target, whole, prompt, 8, gamma=3).tokens == ref.tokens[:8]
    wide = speculative_generate(tiny_target, DraftModelDrafter(Windowed(tiny_draft, 200)), prompt, 40, gamma=3)
    plain = speculative_generate(tiny_target, DraftModelDrafter(tiny_draft), prompt, 40, gamma=3)
    assert [s.proposed for s in wide.trace.steps] == [s.proposed for s in plain.trace.steps], \
        "a window wider than the context drafts as no window does"
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        Windowed(tiny_draft, 0)
    with pytest.raises(ValueError, match="drafts one sequence at a time"):
        from labkit.decoding.batched import batched_speculative_generate
        batched_speculative_generate(tiny_target, DraftModelDrafter(Windowed(tiny_draft, 8)), [prompt], 4)


def test_the_auto_window_reads_the_whole_prompt_where_this_machine_reads_it_cheaply_enough(tiny_target, tiny_draft):
    """AutoWindow: the whole context while the extra reading costs at most SAVING target steps per new token, the
    window past that; a drafter given one reads as it chooses, prompt by prompt, and stays exact."""
    from labkit.drafters.window import SAVING, AutoWindow, WindowCosts
    costs = WindowCosts(draft_seconds_per_token=0.001, target_step_seconds=0.1)
    auto = AutoWindow(costs, new_tokens=64, window=16)
    budget = SAVING * 64 * 0.1                                               # 1.92 s: 1920 extra tokens
    assert auto.budget_seconds() == pytest.approx(budget)
    longest = auto.longest_whole_prompt()
    assert longest == 1920 + 16 + 4
    assert auto.choose(longest) is None and auto.choose(longest + 1) == 16
    assert AutoWindow(costs, new_tokens=8, window=16).choose(400) == 16, "a short answer does not earn the read back"
    assert AutoWindow(WindowCosts(0.01, 0.1), 64, 16).choose(400) == 16, "a draft 10x dearer to read: the window"
    assert "prompts up to 1940 tokens" in auto.describe()
    with pytest.raises(ValueError, match="new_tokens must be an integer >= 1"):
        AutoWindow(costs, new_tokens=0)

    prompt = torch.arange(3, 3 + 120) % 90                                   # (120,)
    ref = autoregressive_generate(tiny_target, prompt, 40)
    for draft_cost, read in ((1e-6, None), (1.0, 16)):
        drafter = DraftModelDrafter(Windowed(tiny_draft, AutoWindow(WindowCosts(draft_cost, 0.01), 40, window=16)))
        fed = []
        hook = tiny_draft.register_forward_pre_hook(lambda mod, args: fed.append(args[0].shape[1]))
        try:
            out = speculative_generate(tiny_target, drafter, prompt, 40, gamma=3)
        finally:
            hook.remove()
        assert drafter.reading.window == read and out.tokens == ref.tokens
        assert fed[0] == (119 if read is None else 4 + 16), f"the first draft forward read {fed[0]} tokens"
    measured = WindowCosts.measure(tiny_target, tiny_draft, context=32, repeats=1)
    assert measured.draft_seconds_per_token > 0 and measured.target_step_seconds > 0 and measured.draft_step_seconds > 0


def test_the_auto_window_credits_a_whole_context_read_with_no_more_than_drafting_can_save():
    """A draft whose step costs 0.45 of the target's, on a verify curve that grows fast with width: drafting saves
    at most 0.22 of a step per token even were 0.9 of it accepted, so reading the whole prompt is worth that much
    and no more (shorter prompts read whole); a draft at 0.1 of a step on a flat curve keeps SAVING."""
    from labkit.core.adaptive import expected_speedup
    from labkit.drafters.window import COPY_ALPHA, SAVING, AutoWindow, WindowCosts
    steep = {1: 1.0, 2: 1.17, 4: 1.34, 8: 2.47, 16: 4.89}
    dear = AutoWindow(WindowCosts(0.0026, 0.0446, 0.02), new_tokens=64, window=64, verify_curve=steep)
    t = {2: 1.17, 3: 1.255, 4: 1.34, 5: 1.6225}                     # the curve between its points: t(γ + 1) / t(1)
    best = max(expected_speedup(COPY_ALPHA, g, 0.02 / 0.0446, t[g + 1]) for g in (1, 2, 3, 4))
    assert dear.most_saving() == pytest.approx(1 - 1 / best) and dear.most_saving() < SAVING
    assert dear.budget_seconds() == pytest.approx(dear.most_saving() * 64 * 0.0446)
    unmeasured = AutoWindow(WindowCosts(0.0026, 0.0446), new_tokens=64, window=64, verify_curve=steep)
    assert dear.longest_whole_prompt() < unmeasured.longest_whole_prompt()
    assert dear.choose(350) == 64 and unmeasured.choose(350) is None
    assert "less than 0.3 because its own step costs 20.0 ms" in dear.describe()
    cheap = AutoWindow(WindowCosts(0.0026, 0.0446, 0.0045), 64, 64, verify_curve={1: 1.0, 64: 1.1})
    assert cheap.saving_per_token() == SAVING and "less than" not in cheap.describe()



def test_the_auto_window_measures_this_machine_only_when_a_prompt_outgrows_the_window(tiny_target, tiny_draft):
    """Given how to measure (as the CLI gives it), AutoWindow times nothing for prompts its window and sinks
    hold whole (they are read whole either way), measures once at the first longer prompt, and keeps that."""
    from functools import partial

    from labkit.drafters.window import AutoWindow, WindowCosts
    calls = []

    def measure():
        calls.append(1)
        return WindowCosts.measure(tiny_target, tiny_draft, context=32, repeats=1)

    auto = AutoWindow(measure, new_tokens=40, window=16)
    assert auto.choose(20) is None and auto.choose(16 + 4) is None and calls == []
    chosen = auto.choose(21)
    assert calls == [1] and isinstance(auto.costs, WindowCosts) and auto.costs.target_step_seconds > 0
    assert auto.choose(21) == chosen and auto.choose(1_000_000) == 16 and calls == [1], "measured once, then kept"

    prompt = torch.arange(3, 3 + 12) % 90                                    # (12,): fits the window
    lazy = AutoWindow(partial(WindowCosts.measure, tiny_target, tiny_draft), new_tokens=24, window=16)
    out = speculative_generate(tiny_target, DraftModelDrafter(Windowed(tiny_draft, lazy)), prompt, 24, gamma=3)
    assert callable(lazy.costs), "a short prompt's decode measured nothing"
    assert out.tokens == autoregressive_generate(tiny_target, prompt, 24).tokens

class Silent(PromptLookupDrafter):
    """Proposes nothing, ever: every step is a plain one."""
    def propose(self, tokens, k, sampling, generator=None):
        return super().propose(tokens, 0, sampling, generator)


def fed(model):
    """Wrap model.hidden: the list of token counts of each forward it runs."""
    calls, hidden = [], model.hidden
    model.hidden = lambda tokens, *a, **kw: calls.append(tokens.shape[-1]) or hidden(tokens, *a, **kw)
    return calls


@pytest.mark.parametrize("prompt", PROMPTS, ids=["plain", "one-token", "repetitive"])
def test_the_first_token_comes_from_the_prefill_as_in_plain_decoding(prompt):
    """No loop runs a forward more than plain decoding: the prefill reads the whole prompt and its logits give the
    first step's first row, so a step that drafts nothing then costs no forward and a draft of K feeds K tokens."""
    model = tiny_model(seed=4)
    calls = fed(model)
    ref = autoregressive_generate(model, prompt, max_new_tokens=12).tokens
    plain, calls[:] = list(calls), []
    assert plain == [prompt.numel()] + [1] * 11                        # the prompt, then one token per forward
    assert speculative_generate(model, Silent(), prompt, 12, gamma=4).tokens == ref
    assert calls == plain
    calls[:] = []
    assert tree_generate(model, Silent(), prompt, 12, budget=4).tokens == ref
    assert calls == plain
    calls[:] = []
    dec = SpeculativeDecoder(model, PromptLookupDrafter(), prompt, 12, gamma=3)
    assert dec.cache.length == prompt.numel() and calls == [prompt.numel()]
    step = dec.step()                                                  # the first: the draft alone, if any
    assert calls[1:] == ([len(step.proposed)] if step.proposed else [])
    assert dec.cache.length == len(dec.tokens) - 1                     # from now on: all but the last
    calls[:] = []
    tree = TreeDecoder(model, PromptLookupDrafter(), prompt, 12, budget=3)
    step = tree.step()
    assert calls[1:] == ([len(step.proposed)] if step.proposed else []) and tree.cache.length == len(tree.tokens) - 1
    assert dec.run().tokens == ref and tree.run().tokens == ref


def test_the_best_rate_gamma_drafts_long_where_drafts_are_cheap_and_right_and_plain_where_they_cost():
    """rate(γ) = E[tokens | α, γ] / (γ·c + t(γ+1)): a free draft that is always right drafts the longest γ; one that
    is never right and costs a step per token drafts nothing, and probes once every probe_every plain steps."""
    from labkit.core.trace import Step
    right = BestRateGamma(start=4, max_gamma=8, verify_curve={1: 1.0, 16: 1.0})
    assert right.gamma() == 4                                             # nothing measured: the starting length
    for _ in range(3):
        right.update(Step([1, 2, 3, 4], 4, 5, True, 0.0, 0.1))
    assert right.gamma() == 8
    wrong = BestRateGamma(start=4, max_gamma=8, probe_every=3)
    wrong.update(Step([1, 2, 3, 4], 0, 5, False, 0.4, 0.1))               # 0.1 s a draft token, none kept
    chosen = []
    for _ in range(8):
        chosen.append(g := wrong.gamma())
        wrong.update(Step([1] * g, 0, 5, False, 0.1 * g, 0.1) if g else Step([], 0, 5, True, 0.0, 0.1))
    assert chosen[:3] == [0, 0, 0] and chosen[3] > 0 and chosen[4:7] == [0, 0, 0], chosen
    with pytest.raises(ValueError, match="margin"):
        BestRateGamma(margin=1.5)
