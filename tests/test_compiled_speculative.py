"""The compiled chain loop (labkit/decoding/compiled.py) against the eager loop and the autoregressive baseline.

On CPU: greedy output equals `autoregressive_generate` token for token with a draft model, prompt lookup and every
γ bucket (γ = 3, 5, 7 pad the verify), across EOS and max_new_tokens; with a greedy drafter each step proposes and
keeps what the eager loop's step does; sampled output has the target's exact distribution (χ², the functions of
test_sampling.py), a seed draws the eager loop's tokens, and a broken residual fails the same test. The steps are
traced by dynamo (backend "eager") in most tests and compiled by inductor in one; CUDA graphs run in the GPU
variants (scripts/gpu_check.py runs them).
"""
import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PatternOfSteps, host_syncs, perturbed, tiny_model
from scipy.stats import chisquare
from test_sampling import (
    CONFIGS,
    N_POS,
    N_RUNS,
    PROMPT,
    V,
    chi2_pvalues,
    exact_marginals,
)

import labkit.decoding.compiled as compiled
from labkit import (
    DraftModelDrafter,
    PromptLookupDrafter,
    SamplingConfig,
    autoregressive_generate,
    speculative_generate,
)
from labkit.bench.runner import load_recorded_steps
from labkit.core.adaptive import GammaPolicy
from labkit.core.trace import Step
from labkit.decoding.compiled import (
    BUCKETS,
    CompiledSpeculativeDecoder,
    DeviceAcceptance,
    bucket,
    compiled_speculative_generate,
    greedy_accept_on_device,
    speculative_accept_on_device,
)
from labkit.drafters import CutVocab, Windowed
from labkit.drafters.base import Needs
from labkit.drafters.replay import PacedDrafter, ReplayDrafter, ReplayedGamma
from labkit.tuning import CostAwareGamma

PROMPTS = [torch.tensor([5, 17, 33, 2, 9]), torch.tensor([1]), torch.tensor([7, 8, 9, 7, 8, 9, 7, 8])]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and inductor's GPU code need a GPU")


pytestmark = pytest.mark.usefixtures("one_thread")     # tiny models: one thread (tests/conftest.py)


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(seed=0)
    return target, perturbed(target, scale=0.3)


def test_buckets_round_gamma_up():
    assert [bucket(k) for k in range(9)] == [0, 1, 2, 4, 4, 8, 8, 8, 8] and BUCKETS == (0, 1, 2, 4, 8)


@pytest.mark.parametrize("compile", [False, True], ids=["static", "traced"])
@pytest.mark.parametrize("which", ["draft", "lookup"])
def test_greedy_equals_autoregressive_for_every_bucket(pair, which, compile):
    target, draft = pair
    drafter = DraftModelDrafter(draft) if which == "draft" else PromptLookupDrafter()
    dec = CompiledSpeculativeDecoder(target, drafter, max_len=64, compile=compile, compile_backend="eager")
    for prompt in PROMPTS:
        ref = autoregressive_generate(target, prompt, max_new_tokens=40).tokens
        for gamma in (1, 2, 3, 4, 5, 7, 8):                       # 3, 5, 7 pad the verify to the next bucket
            out = dec.generate(prompt, max_new_tokens=40, gamma=gamma)
            assert out.tokens == ref, (prompt.tolist(), gamma)
            assert out.trace.n_generated == 40 and out.trace.stop_reason == "max_new_tokens"
            assert all(s.gamma <= gamma and s.asked <= gamma for s in out.trace.steps)
            assert dec.cache.length == len(dec.tokens) - 1        # every committed token but the last


class Pattern(PatternOfSteps, GammaPolicy):
    """γ by step (PatternOfSteps): a cost-aware γ's plain steps until its next probe, in a pattern."""

    def gamma(self) -> int:
        return self.now()


PLAIN_RUNS = [0, 0, 0, 0, 0, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]      # runs of 5 and 10 plain steps


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.8)], ids=["greedy", "sampled"])
def test_plain_steps_run_on_the_device_one_token_wide(pair, sampling, monkeypatch):
    """Where the policy says γ = 0 and knows more plain steps follow, they run back to back (up to PLAIN_RUN, one
    host sync), each verifying the last token alone; every token is still a step of its own, the policy is told of
    each, and greedy output and steps are the eager loop's under the same policy."""
    target, draft = pair
    called, runs = [], []
    call, run = compiled.FixedShapeStep.__call__, CompiledSpeculativeDecoder.plain_run
    monkeypatch.setattr(compiled.FixedShapeStep, "__call__", lambda self: called.append(self) or call(self))
    monkeypatch.setattr(CompiledSpeculativeDecoder, "plain_run", lambda self, r: runs.append(r) or run(self, r))
    dec = CompiledSpeculativeDecoder(target, DraftModelDrafter(draft), max_len=96)
    out = dec.generate(PROMPTS[0], max_new_tokens=50, gamma=Pattern(PLAIN_RUNS), sampling=sampling, seed=0)
    widths = [step.tokens.shape[1] for step in called if step in dec.verify_steps.values()]   # not the draft's
    plain = [s for s in out.trace.steps if s.asked == 0]
    assert [s.asked for s in out.trace.steps[:18]] == PLAIN_RUNS and out.trace.n_generated == 50
    assert widths.count(1) == len(plain) and 2 not in widths[:-1] and runs[:4] == [5, 8, 2, 5]
    assert all(s.gamma == 0 and s.n_accepted == 0 for s in plain)
    if sampling.greedy:
        eager = speculative_generate(target, DraftModelDrafter(draft), PROMPTS[0], 50, gamma=Pattern(PLAIN_RUNS))
        assert out.tokens == eager.tokens == autoregressive_generate(target, PROMPTS[0], max_new_tokens=50).tokens
        assert [(s.gamma, s.n_accepted) for s in out.trace.steps] == [(s.gamma, s.n_accepted) for s in eager.trace.steps]


def test_a_cost_aware_gamma_knows_its_plain_steps_until_the_next_probe():
    policy = CostAwareGamma(start=4, max_gamma=8, probe_every=8, warmup=1)
    policy.update(Step([1, 2, 3, 4], 0, 5, False, 0.01, 0.01))          # a draft that costs a step and is never right
    assert policy.gamma() == 0 and policy.plain_steps() == 8
    for _ in range(3):
        policy.update(Step([], 0, 5, True, 0.0, 0.01))
    assert policy.gamma() == 0 and policy.plain_steps() == 5              # the probe stays where it was
    policy.expect_shadows()
    assert policy.plain_steps() == 1                                      # a shadow may come on any plain step


def test_longer_drafts_compile_wider_verifies_and_stay_exact(pair):
    target, _ = pair
    prompt = torch.tensor([3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14] * 3)         # a run lookup can copy far
    ref = autoregressive_generate(target, prompt, max_new_tokens=48).tokens
    dec = CompiledSpeculativeDecoder(target, PromptLookupDrafter(), max_len=120,
                                     max_gamma=16)
    assert dec.buckets == (0, 1, 2, 4, 8, 16) and [dec.bucket(k) for k in (0, 8, 9, 16)] == [0, 8, 16, 16]
    for gamma in (9, 12, 16):
        out = dec.generate(prompt, max_new_tokens=48, gamma=gamma)
        assert out.tokens == ref, gamma
        assert max(s.gamma for s in out.trace.steps) > 8 and all(s.gamma <= gamma for s in out.trace.steps)
    with pytest.raises(ValueError, match="pass gamma <= 16"):
        dec.generate(prompt, max_new_tokens=4, gamma=17)
    for bad in (4, 12, 64, True):
        with pytest.raises(ValueError, match="max_gamma must be 8, 16 or 32"):
            CompiledSpeculativeDecoder(target, PromptLookupDrafter(), max_len=64, max_gamma=bad)


@pytest.mark.parametrize("gamma", [2, 5])
def test_each_step_proposes_and_keeps_what_the_eager_step_does(pair, gamma):
    target, draft = pair
    for drafter in (DraftModelDrafter(draft), PromptLookupDrafter()):
        ref = speculative_generate(target, drafter, PROMPTS[0], max_new_tokens=30, gamma=gamma).trace.steps
        dec = CompiledSpeculativeDecoder(target, drafter, max_len=48)
        got = dec.generate(PROMPTS[0], max_new_tokens=30, gamma=gamma).trace.steps
        assert [(s.proposed, s.n_accepted, s.next_token, s.bonus) for s in got] == \
               [(s.proposed, s.n_accepted, s.next_token, s.bonus) for s in ref]
        assert all(s.verify_time > 0 for s in got) and dec.trace.method == f"compiled-speculative/{drafter.name}"


def test_another_drafter_reuses_the_compiled_target(pair):
    target, draft = pair
    dec = CompiledSpeculativeDecoder(target, PromptLookupDrafter(), max_len=48)
    steps = dec.verify_steps
    ref = autoregressive_generate(target, PROMPTS[0], max_new_tokens=30).tokens
    assert dec.generate(PROMPTS[0], 30, gamma=3).tokens == ref
    dec.use_drafter(DraftModelDrafter(draft))
    out = dec.generate(PROMPTS[0], 30, gamma=3)
    assert out.tokens == ref and dec.verify_steps is steps and out.trace.method == "compiled-speculative/draft"
    with pytest.raises(ValueError, match="vocabulary"):
        dec.use_drafter(DraftModelDrafter(tiny_model(vocab_size=50)))


def test_draft_equal_to_target_accepts_everything_and_catches_up_two_tokens(pair):
    target, _ = pair
    out = compiled_speculative_generate(target, DraftModelDrafter(target), PROMPTS[0], max_new_tokens=30, gamma=4)
    assert out.trace.acceptance_rate == 1.0 and out.trace.n_target_forwards == 6   # 4 drafted + the bonus a pass
    assert out.tokens == autoregressive_generate(target, PROMPTS[0], max_new_tokens=30).tokens
    assert 0 < out.trace.draft_prefill_time < out.trace.prefill_time       # the draft's reading, timed apart


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 9])
def test_max_new_tokens_edges(pair, max_new_tokens):
    target, draft = pair
    ref = autoregressive_generate(target, PROMPTS[0], max_new_tokens=max_new_tokens).tokens
    for drafter in (DraftModelDrafter(target), DraftModelDrafter(draft), PromptLookupDrafter()):
        out = compiled_speculative_generate(target, drafter, PROMPTS[0], max_new_tokens, gamma=8)
        assert out.tokens == ref and out.trace.n_generated == max_new_tokens
        assert out.trace.steps[-1].asked <= max_new_tokens - 1


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_eos_inside_the_draft_stops_there(pair, gamma):
    target, _ = pair
    ref = autoregressive_generate(target, PROMPTS[0], max_new_tokens=30).tokens
    eos = ref[7]
    ref_eos = autoregressive_generate(target, PROMPTS[0], max_new_tokens=30, eos_token_ids=(eos,)).tokens
    out = compiled_speculative_generate(target, DraftModelDrafter(target), PROMPTS[0], 30, gamma=gamma,
                                        eos_token_ids=(eos,))
    assert out.tokens == ref_eos == ref[: ref.index(eos) + 1] and out.trace.stop_reason == "eos"


class ReplayedOutput:
    """A stand-in for a CUDA graph on the CPU: each replay refills one static output in place, as a graph does."""

    def __init__(self, fn):
        self.fn, self.out = fn, fn().clone()

    def replay(self):
        self.out.copy_(self.fn())


def test_graph_style_outputs_refilled_in_place_stay_exact(pair, monkeypatch):
    """The graph path's bookkeeping on a CPU: every shape's logits live in one buffer that its next call overwrites."""
    monkeypatch.setattr(compiled, "capture_graph", lambda fn, warmups: (lambda g: (g, g.out))(ReplayedOutput(fn)))
    target, draft = pair
    cfg = SamplingConfig(temperature=0.8, top_k=20)
    for drafter in (DraftModelDrafter(draft), PromptLookupDrafter()):
        dec = CompiledSpeculativeDecoder(target, drafter, max_len=48)
        for step in [*dec.verify_steps.values(), *(dec.draft.steps.values() if dec.draft else [])]:
            step.cuda_graph = True
        for gamma in (3, 8):
            ref = speculative_generate(target, drafter, PROMPTS[0], 30, gamma=gamma)
            out = dec.generate(PROMPTS[0], 30, gamma=gamma)
            assert [(s.proposed, s.n_accepted) for s in out.trace.steps] == \
                   [(s.proposed, s.n_accepted) for s in ref.trace.steps]
            assert out.tokens == ref.tokens == autoregressive_generate(target, PROMPTS[0], 30).tokens
        for seed in range(3):
            assert dec.generate(PROMPTS[0], 30, gamma=4, sampling=cfg, seed=seed).tokens == \
                   speculative_generate(target, drafter, PROMPTS[0], 30, gamma=4, sampling=cfg, seed=seed).tokens


def test_a_gamma_policy_with_plain_steps_stays_exact(pair):
    target, draft = pair
    ref = autoregressive_generate(target, PROMPTS[0], max_new_tokens=50).tokens
    out = compiled_speculative_generate(target, DraftModelDrafter(perturbed(target, 3.0)), PROMPTS[0], 50,
                                        gamma=CostAwareGamma(start=2, max_gamma=16))
    assert out.tokens == ref
    assert any(s.gamma == 0 for s in out.trace.steps), "a hopeless draft should get plain steps (γ = 0)"


def test_device_acceptance_rules_agree_with_the_host_rules():
    draft = torch.tensor([3, 1, 2])                                                    # (K,)
    logits = torch.full((4, 5), -9.0)
    logits[[0, 1, 2, 3], [3, 1, 4, 0]] = 0.0                                           # the target: 3, 1, 4, 0
    acc = greedy_accept_on_device(draft, logits)
    assert isinstance(acc, DeviceAcceptance) and int(acc.n_accepted) == 2 and acc.tokens[:3].tolist() == [3, 1, 4]
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0]])                               # (K+1, V), K = 1
    q = torch.tensor([[0.0, 0.0, 1.0]])                                                # the draft always says 2
    g = torch.Generator().manual_seed(0)
    picks = [speculative_accept_on_device(torch.tensor([2]), q, p, g) for _ in range(400)]
    assert all(int(a.n_accepted) == 0 for a in picks)                                  # p(2) = 0: always rejected
    assert {int(a.tokens[0]) for a in picks} == {0, 1}                                 # drawn from the residual


def test_sampling_without_a_sync_draws_what_multinomial_draws():
    """Token j wins with probability p_j / sum(p), and a seed gives torch.multinomial's draws (the eager loop's)."""
    weights = torch.tensor([0.5, 0.0, 1.5, 2.0, 1.0]).expand(20000, 5)                # unnormalised, one impossible
    wins = compiled.sample_without_sync(weights, torch.Generator().manual_seed(0))    # (20000, 1)
    assert torch.equal(wins, torch.multinomial(weights, 1, generator=torch.Generator().manual_seed(0)))
    counts = np.bincount(wins[:, 0].numpy(), minlength=5)
    assert counts[1] == 0
    assert chisquare(counts[[0, 2, 3, 4]], (weights[0, [0, 2, 3, 4]] / weights[0].sum()).numpy() * 20000).pvalue > 1e-3


def compiled_counts(target, drafter, cfg: SamplingConfig, gamma: int) -> np.ndarray:
    dec = CompiledSpeculativeDecoder(target, drafter, max_len=PROMPT.numel() + N_POS + 8)
    counts = np.zeros((N_POS, V))
    for seed in range(N_RUNS):
        out = dec.generate(PROMPT, N_POS, gamma=gamma, sampling=cfg, seed=seed)
        counts[np.arange(N_POS), out.tokens] += 1
    return counts


@pytest.fixture(scope="module")
def small_pair():
    """test_sampling.py's pair with one layer each: a forward half as long, the same kind of test."""
    return (tiny_model(seed=3, vocab_size=V, std=0.4, n_layers=1),
            tiny_model(seed=4, vocab_size=V, std=0.4, n_layers=1))


@pytest.mark.parametrize("which", ["draft", "lookup"])
def test_sampled_output_has_the_targets_distribution(small_pair, which):
    target, draft = small_pair
    drafter = DraftModelDrafter(draft) if which == "draft" else PromptLookupDrafter(max_ngram=1)
    counts = compiled_counts(target, drafter, CONFIGS[0], gamma=2)
    assert min(chi2_pvalues(counts, exact_marginals(target, CONFIGS[0]))) > 1e-3


@pytest.mark.parametrize("which", ["draft", "lookup"])
def test_on_a_cpu_a_seed_draws_what_the_eager_loop_draws(small_pair, which):
    """Same seed, same draws in the same order (draft tokens, then u, then the residual's sample): the same tokens."""
    target, draft = small_pair
    drafter = DraftModelDrafter(draft) if which == "draft" else PromptLookupDrafter(max_ngram=1)
    dec = CompiledSpeculativeDecoder(target, drafter, max_len=PROMPT.numel() + 12 + 8)
    for seed in range(40):
        for cfg in CONFIGS:                                               # t=1; t=0.7 with top-k and top-p
            eager = speculative_generate(target, drafter, PROMPT, 12, gamma=3, sampling=cfg, seed=seed)
            assert dec.generate(PROMPT, 12, gamma=3, sampling=cfg, seed=seed).tokens == eager.tokens


def broken_accept(draft, q_draft, p_target, generator=None) -> DeviceAcceptance:
    """A classic bug: on rejection resample from p_target instead of the residual max(0, p - q)."""
    acc = speculative_accept_on_device(draft, q_draft, p_target, generator)
    n = acc.n_accepted.view(1)
    redraw = torch.multinomial(p_target.index_select(0, n), 1, generator=generator)[0]     # (1,)
    fixed = torch.where(n == draft.shape[0], acc.tokens.index_select(0, n), redraw)
    return DeviceAcceptance(acc.n_accepted, acc.tokens.scatter(0, n, fixed))


def test_broken_rule_fails_the_same_test(small_pair, monkeypatch):
    target, draft = small_pair
    monkeypatch.setattr(compiled, "speculative_accept_on_device", broken_accept)
    counts = compiled_counts(target, DraftModelDrafter(draft), CONFIGS[0], gamma=2)
    assert min(chi2_pvalues(counts, exact_marginals(target, CONFIGS[0]))) < 1e-6


def recorded_run(target, prompt, recorded, max_new_tokens):
    continuation = autoregressive_generate(target, prompt, max_new_tokens=max_new_tokens).tokens
    return ReplayDrafter(continuation, recorded, target.vocab_size), continuation


def test_a_replayed_policy_replays_the_recorded_plain_steps_as_runs(pair, monkeypatch):
    """ReplayedGamma: a recording's γ choices, plain steps included, as the policy that made them; the compiled loop
    takes each recorded run of plain steps at once, and the trace is the recording."""
    target, draft = pair
    recorded = [(0, 0)] * 5 + [(4, 2)] + [(0, 0)] * 3 + [(8, 0), (3, 3)]
    replay, continuation = recorded_run(target, PROMPTS[0], recorded, max_new_tokens=40)
    runs, run = [], CompiledSpeculativeDecoder.plain_run
    monkeypatch.setattr(CompiledSpeculativeDecoder, "plain_run", lambda self, r: runs.append(r) or run(self, r))
    dec = CompiledSpeculativeDecoder(target, PacedDrafter(replay, DraftModelDrafter(draft)), max_len=64)
    out = dec.generate(PROMPTS[0], 40, gamma=ReplayedGamma(replay))
    assert out.tokens == continuation and not replay.diverged and runs[:3] == [5, 3, 5]
    assert [(s.gamma, s.n_accepted) for s in out.trace.steps][:22] == (recorded * 2)[:22] == replay.replayed[:22]


@pytest.mark.parametrize("paced", [False, True], ids=["replay", "paced-by-a-draft-model"])
def test_replayed_acceptance_is_the_recorded_one_eager_and_compiled(pair, paced):
    target, draft = pair
    recorded = [(4, 4), (4, 2), (0, 0), (8, 0), (3, 3), (6, 5), (1, 1)]
    replay, continuation = recorded_run(target, PROMPTS[0], recorded, max_new_tokens=40)
    drafter = PacedDrafter(replay, DraftModelDrafter(draft)) if paced else replay
    for run in (lambda: speculative_generate(target, drafter, PROMPTS[0], 40, gamma=8),
                lambda: compiled_speculative_generate(target, drafter, PROMPTS[0], 40, gamma=8)):
        out = run()
        assert out.tokens == continuation and not replay.diverged
        got = [(s.gamma, s.n_accepted) for s in out.trace.steps]
        assert got == replay.replayed and got[:-1] == (recorded * 3)[:len(got) - 1]   # the last is cut by the limit


def test_recorded_steps_load_from_a_committed_benchmark():
    results = Path(__file__).resolve().parents[1] / "data" / "bench" / "code_edit" / "results.jsonl"
    steps = load_recorded_steps(results, "suffix", max_gamma=8)
    assert steps and all(0 <= n <= g <= 8 for g, n in steps) and any(n > 0 for _, n in steps)
    with pytest.raises(ValueError, match="its methods: .*'lookup'"):
        load_recorded_steps(results, "no-such-method")
    with pytest.raises(ValueError, match="greedy"):
        ReplayDrafter([1, 2], [(2, 1)], 96).propose(torch.tensor([1]), 2, SamplingConfig(temperature=1.0))


class ReadsFeatures(PromptLookupDrafter):
    needs = Needs(features=True)           # as Medusa and EAGLE do


def test_bad_requests_say_what_to_do(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="cuda_graph=True needs the model on a CUDA device"):
        CompiledSpeculativeDecoder(target, PromptLookupDrafter(), max_len=32, cuda_graph=True)
    for drafter in (DraftModelDrafter(Windowed(draft, 16)), DraftModelDrafter(CutVocab(draft, torch.arange(8)))):
        with pytest.raises(ValueError, match=r"DraftModelDrafter\(model\) \(no wrapper, stop_below"):
            CompiledSpeculativeDecoder(target, drafter, max_len=32)
    with pytest.raises(ValueError, match="tree loop"):
        CompiledSpeculativeDecoder(target, ReadsFeatures(), max_len=32)
    with pytest.raises(ValueError, match="drafter must be a labkit Drafter"):
        CompiledSpeculativeDecoder(target, "lookup", max_len=32)
    with pytest.raises(ValueError, match="max_len must be an integer"):
        CompiledSpeculativeDecoder(target, PromptLookupDrafter(), max_len=4)
    dec = CompiledSpeculativeDecoder(target, PromptLookupDrafter(), max_len=32)
    with pytest.raises(ValueError, match="max_len >= 38"):
        dec.generate(torch.arange(10), max_new_tokens=20)
    with pytest.raises(ValueError, match="pass gamma <= 8"):
        dec.generate(PROMPTS[0], max_new_tokens=4, gamma=9)
    with pytest.raises(ValueError, match="token ids, not text"):
        dec.generate("def f():", max_new_tokens=4)
    with pytest.raises(ValueError, match="vocabulary"):
        CompiledSpeculativeDecoder(target, DraftModelDrafter(tiny_model(vocab_size=50)), max_len=32)


def test_inductor_compiles_every_shape_and_stays_exact():
    model = tiny_model(seed=3, n_layers=1, dim=32, hidden_dim=64, vocab_size=64)
    prompt = torch.tensor([1, 2, 3, 1, 2, 3, 1, 2])
    ref = autoregressive_generate(model, prompt, max_new_tokens=24).tokens
    dec = CompiledSpeculativeDecoder(model, PromptLookupDrafter(), max_len=40, compile=True)
    out = dec.generate(prompt, max_new_tokens=24, gamma=3)       # each shape is compiled when first used
    assert out.tokens == ref and 4 in {bucket(s.gamma) for s in out.trace.steps}       # γ = 3 padded to 4


@CUDA
def test_cuda_graphs_greedy_equals_autoregressive_on_gpu():
    target = tiny_model(seed=0).cuda()                                   # fp32: no bf16 rounding ties
    draft = perturbed(tiny_model(seed=0), scale=0.3).cuda()
    for drafter in (DraftModelDrafter(draft), PromptLookupDrafter()):
        dec = CompiledSpeculativeDecoder(target, drafter, max_len=64, cuda_graph=True)
        for prompt in PROMPTS:
            ref = autoregressive_generate(target, prompt, max_new_tokens=40).tokens
            for gamma in (1, 3, 5, 8):
                out = dec.generate(prompt, max_new_tokens=40, gamma=gamma)
                assert out.tokens == ref, (drafter.name, prompt.tolist(), gamma)
                assert all(s.verify_time > 0 for s in out.trace.steps)


@CUDA
def test_cuda_chain_step_makes_one_host_sync():
    """The step's one read of the verdict, and no other wait for the GPU: a host drafter's tokens travel from
    page-locked memory, a draft model drafts on the device; greedy and sampled."""
    target = tiny_model(seed=0).cuda()
    draft = perturbed(tiny_model(seed=0), scale=0.3).cuda()
    prompt = PROMPTS[0]
    replay, _ = recorded_run(target, prompt, [(4, 2), (3, 3)], max_new_tokens=40)
    greedy, sampled = SamplingConfig(), SamplingConfig(temperature=0.8)
    for drafter, samplings in ((DraftModelDrafter(draft), (greedy, sampled)),
                               (PromptLookupDrafter(), (greedy, sampled)),
                               (PacedDrafter(replay, DraftModelDrafter(draft)), (greedy,))):   # a replay: greedy only
        dec = CompiledSpeculativeDecoder(target, drafter, max_len=64, cuda_graph=True)
        dec.generate(prompt, max_new_tokens=40, gamma=4)                      # records the graphs
        for sampling in samplings:
            dec.start(prompt, 40, gamma=4, sampling=sampling, seed=0)
            assert [host_syncs(dec.step) for _ in range(4)] == [1] * 4, (drafter.name, sampling)
    dec = CompiledSpeculativeDecoder(target, DraftModelDrafter(draft), max_len=96, cuda_graph=True)
    dec.generate(prompt, max_new_tokens=50, gamma=Pattern(PLAIN_RUNS))          # records the graphs
    for sampling in (greedy, sampled):                                           # runs of 5, 8 and 2 plain steps
        dec.start(prompt, 50, gamma=Pattern(PLAIN_RUNS), sampling=sampling, seed=0)
        assert [host_syncs(dec.step) for _ in range(4)] == [1] * 4, ("plain runs", sampling)
        assert dec.trace.n_generated >= 15


@CUDA
def test_cuda_compiled_graphs_greedy_equals_autoregressive_on_gpu():
    """inductor's GPU code for every verify width and both draft steps, each replayed as a CUDA graph."""
    target = tiny_model(seed=0).cuda()
    dec = CompiledSpeculativeDecoder(target, DraftModelDrafter(perturbed(tiny_model(seed=0), 0.3).cuda()), max_len=64,
                                     compile=True, cuda_graph=True)
    dec.warmup()
    for prompt in PROMPTS:
        ref = autoregressive_generate(target, prompt, max_new_tokens=40).tokens
        for gamma in (1, 3, 8):
            assert dec.generate(prompt, max_new_tokens=40, gamma=gamma).tokens == ref, (prompt.tolist(), gamma)


@CUDA
def test_cuda_sampled_output_has_the_targets_distribution(small_pair):
    target, draft = (copy.deepcopy(m).cuda() for m in small_pair)
    counts = compiled_counts(target, DraftModelDrafter(draft), CONFIGS[1], gamma=2)   # top-k, top-p; no-sync draws
    pvalues = chi2_pvalues(counts, exact_marginals(small_pair[0], CONFIGS[1]))
    assert min(p for p in pvalues if not np.isnan(p)) > 1e-3     # a position with one possible token has no test


@CUDA
def test_cuda_replayed_acceptance_with_a_paced_draft():
    target, draft = (m.cuda() for m in (tiny_model(seed=0), perturbed(tiny_model(seed=0), 0.3)))
    recorded = [(4, 4), (4, 2), (0, 0), (8, 0), (3, 3)]
    replay, continuation = recorded_run(target, PROMPTS[0], recorded, max_new_tokens=40)
    dec = CompiledSpeculativeDecoder(target, PacedDrafter(replay, DraftModelDrafter(draft)), max_len=64,
                                     cuda_graph=True)
    out = dec.generate(PROMPTS[0], 40, gamma=8)
    assert out.tokens == continuation and [(s.gamma, s.n_accepted) for s in out.trace.steps] == replay.replayed
