"""The compiled tree loop (labkit/decoding/compiled_tree.py) against the eager tree loop and plain decoding.

On CPU: greedy output equals `autoregressive_generate` token for token for suffix decoding's trees, Medusa's
static tree (random heads: exactness does not depend on their quality) and replayed trees, at budgets that pad
every bucket; each step keeps what the eager tree loop's step keeps; the device acceptance agrees with the host
rule on random trees; replayed tree acceptance equals the recording. Sampled: the device rule draws the joint of
the first two tokens as the target does (a chi-square test that a plausible broken rule fails), and the loop's
sampled output has the target's distribution (Medusa's top-k trees). The steps run eagerly or traced by dynamo,
whole or a block at a time; EAGLE-3 reads three blocks' outputs from the compiled verify; EAGLE-2's trees drafted on
the device are the reference drafter's, laid out there as on the host; CUDA graphs run in the GPU variant
(scripts/gpu_check.py runs it).
"""
import numpy as np
import pytest
import torch
from conftest import PatternOfSteps, host_syncs, tiny_model
from scipy.stats import chisquare
from test_sampling import CONFIGS, N_POS, N_RUNS, PROMPT, V, chi2_pvalues, exact_marginals

from labkit import SamplingConfig, autoregressive_generate
from labkit.core.tree import Tree
from labkit.core.tree_acceptance import greedy_tree_accept
from labkit.core.tree_budget import FixedBudget
from labkit.decoding import compiled
from labkit.decoding.compiled_tree import (
    TREE_BUCKETS,
    CompiledTreeDecoder,
    TreeAcceptanceOnDevice,
    greedy_tree_accept_on_device,
    lay_out,
    lay_out_on_device,
    sampled_tree_accept_on_device,
    tree_bucket,
)
from labkit.decoding.tree import tree_generate
from labkit.drafters.base import Needs
from labkit.drafters.draft_model import DraftModelDrafter
from labkit.drafters.eagle import EagleDrafter
from labkit.drafters.eagle_device import DeviceEagleDrafter
from labkit.drafters.medusa import MedusaDrafter
from labkit.drafters.replay import CostOnly, PacedDrafter, ReplayedBudget, ReplayTreeDrafter
from labkit.drafters.suffix import SuffixDrafter
from labkit.models.eagle_heads import Eagle3Head, EagleConfig, EagleHead
from labkit.models.medusa_heads import MedusaHeads

PROMPTS = [torch.tensor([5, 17, 33, 2, 9, 5, 17, 33, 2, 9, 5, 17]), torch.tensor([1]), torch.tensor([7, 8, 9, 7, 8])]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
MEDUSA_CHOICES = [(0,), (1,), (0, 0), (2,), (0, 1), (1, 0), (0, 0, 0), (3,), (0, 0, 1), (0, 0, 0, 0), (1, 1), (4,)]

pytestmark = pytest.mark.usefixtures("one_thread")     # tiny models: one thread (tests/conftest.py)


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0)


def medusa(target, seed=1):
    torch.manual_seed(seed)
    heads = MedusaHeads(target.lm_head, n_heads=4).to(target.device)
    for block in heads.blocks:                          # random, not zero: the heads guess something
        torch.nn.init.normal_(block.linear.weight, std=0.5)
    return MedusaDrafter(heads, MEDUSA_CHOICES)


class ReadsOwnTarget(SuffixDrafter):
    name = "own-target"
    needs = Needs(best_first=True, target=lambda target: object())   # a target of its own, as MTP heads read


def test_buckets_round_tree_sizes_up():
    assert [tree_bucket(n) for n in (0, 1, 8, 9, 16, 17, 33, 64)] == [0, 8, 8, 16, 16, 32, 64, 64]
    assert TREE_BUCKETS == (0, 8, 16, 32, 64)


@pytest.mark.parametrize("compile", [False, True, "blocks"], ids=["static", "traced", "traced-blocks"])
@pytest.mark.parametrize("which", ["suffix", "medusa"])
def test_greedy_equals_autoregressive(target, which, compile):
    for budget in (3, 12, 20):
        dec = CompiledTreeDecoder(target, SuffixDrafter() if which == "suffix" else medusa(target), max_len=128,
                                  compile=compile, compile_backend="eager")
        for prompt in PROMPTS:
            want = autoregressive_generate(target, prompt, max_new_tokens=24).tokens
            out = dec.generate(prompt, 24, budget=budget)
            assert out.tokens == want, (which, budget, prompt.tolist())
            assert out.trace.n_generated == 24 and sum(s.n_accepted + 1 for s in out.trace.steps) == 24


def test_each_step_keeps_what_the_eager_tree_step_keeps(target):
    prompt = PROMPTS[0]
    eager = tree_generate(target, medusa(target), prompt, 30, budget=12)
    fast = CompiledTreeDecoder(target, medusa(target), max_len=128).generate(prompt, 30, budget=12)
    assert fast.tokens == eager.tokens
    assert [(s.proposed, s.parents, s.path, s.next_token) for s in fast.trace.steps] == \
           [(s.proposed, s.parents, s.path, s.next_token) for s in eager.trace.steps]
    assert any(s.n_accepted > 0 for s in fast.trace.steps)          # the heads' trees were verified, not skipped


def test_device_acceptance_agrees_with_the_host_rule():
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        N, V = int(torch.randint(1, 20, (1,), generator=g)), 5
        parents = torch.tensor([int(torch.randint(-1, i, (1,), generator=g)) for i in range(N)])
        tree, tokens = Tree(parents), torch.randint(0, V, (N,), generator=g)
        logits = torch.randn(1 + N, V, generator=g)
        want = greedy_tree_accept(tree, tokens, logits)
        laid = lay_out(tree, width=tree_bucket(N))
        padded = torch.cat([logits, torch.randn(tree_bucket(N) - N, V, generator=g)])   # padding rows
        nodes = torch.cat([tokens, tokens.new_full((tree_bucket(N) - N,), -1)])     # padding: a token never picked
        got = greedy_tree_accept_on_device(laid, nodes, padded)
        n = int(got.n_accepted)
        assert n == want.n_accepted and int(got.next_token) == want.next_token, trial
        assert [r - 1 for r in got.keep_rows[1:n + 1].tolist()] == want.path, trial


def test_replayed_tree_acceptance_is_the_recorded_one(target):
    prompt = PROMPTS[2]
    continuation = autoregressive_generate(target, prompt, max_new_tokens=100).tokens
    recorded = [(32, 3), (64, 2), (32, 0), (12, 5), (20, 1), (9, 9)]
    replay = ReplayTreeDrafter(continuation, recorded, target.vocab_size, depth=6)
    for run in (lambda: tree_generate(target, replay, prompt, 100, budget=64),
                lambda: CompiledTreeDecoder(target, replay, max_len=180).generate(prompt, 100, budget=64)):
        out = run()
        assert out.tokens == continuation and not replay.diverged
        assert 0 < out.trace.draft_prefill_time < out.trace.prefill_time   # the drafter's start, timed apart
        got = [(s.gamma, s.n_accepted) for s in out.trace.steps if s.asked]      # not the last token's plain step
        assert got == replay.replayed and got[:len(recorded)] == recorded     # later ones: cut by what is left
        assert max(len(s.proposed) for s in out.trace.steps) == 64 and any(s.path and s.parents[s.path[-1]] >= 0
                                                                             for s in out.trace.steps)


def test_a_replayed_budget_replays_the_recorded_plain_steps_as_runs(target, monkeypatch):
    """ReplayedBudget: a recording's tree sizes, plain steps included, as the budget that chose them; the compiled
    loop takes each recorded run of plain steps at once, and the trace is the recording."""
    prompt = PROMPTS[2]
    continuation = autoregressive_generate(target, prompt, max_new_tokens=60).tokens
    recorded = [(0, 0)] * 5 + [(12, 2)] + [(0, 0)] * 3 + [(20, 1), (9, 3)]
    replay = ReplayTreeDrafter(continuation, recorded, target.vocab_size, depth=6)
    runs, run = [], CompiledTreeDecoder.plain_run
    monkeypatch.setattr(CompiledTreeDecoder, "plain_run", lambda self, r: runs.append(r) or run(self, r))
    out = CompiledTreeDecoder(target, PacedDrafter(replay, medusa(target)), max_len=140).generate(
        prompt, 60, budget=ReplayedBudget(replay))
    assert out.tokens == continuation and not replay.diverged and runs[:3] == [5, 3, 5]
    assert [(s.gamma, s.n_accepted) for s in out.trace.steps][:22] == (recorded * 2)[:22] == replay.replayed[:22]


def test_a_replay_paced_by_medusa_heads_or_a_cost_reads_features_and_stays_exact(target):
    prompt = PROMPTS[0]
    continuation = autoregressive_generate(target, prompt, max_new_tokens=30).tokens
    calls = []
    for paced_by in (medusa(target), CostOnly(lambda: calls.append(1), "head")):
        replay = ReplayTreeDrafter(continuation, [(12, 2), (12, 4), (12, 0)], target.vocab_size)
        drafter = PacedDrafter(replay, paced_by)
        assert drafter.needs.features == paced_by.needs.features
        out = CompiledTreeDecoder(target, drafter, max_len=128).generate(prompt, 30, budget=12)
        assert out.tokens == continuation and not replay.diverged
    assert len(calls) == len(out.trace.steps)


def test_a_paced_replay_queues_its_cost_first_at_the_length_it_then_proposes(target):
    continuation = autoregressive_generate(target, PROMPTS[0], max_new_tokens=30).tokens
    events = []

    class Logged(ReplayTreeDrafter):
        def propose(self, tokens, k, sampling, generator=None):
            proposal = super().propose(tokens, k, sampling, generator)
            events.append(("replay", proposal.k))
            return proposal

    class Cost(CostOnly):
        def propose(self, tokens, k, sampling, generator=None):
            events.append(("cost", k))
            return super().propose(tokens, k, sampling, generator)

    replay = Logged(continuation, [(12, 2), (5, 4), (40, 0)], target.vocab_size)
    out = CompiledTreeDecoder(target, PacedDrafter(replay, Cost(lambda: None, "head")), max_len=128).generate(
        PROMPTS[0], 30, budget=20)
    assert out.tokens == continuation
    pairs = list(zip(events[::2], events[1::2]))
    assert pairs and all(c[0] == "cost" and r[0] == "replay" and c[1] == r[1] for c, r in pairs)
    assert [r[1] for _, r in pairs[:3]] == [12, 5, 20]           # the third capped by the budget


def test_a_tree_laid_out_on_the_device_is_the_host_layout():
    """lay_out_on_device (parents never read back) against lay_out, on random trees; its paths are max_depth wide,
    the columns past a tree's depth holding each node's own row, as lay_out pads a shallower node's."""
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        n = int(torch.randint(1, 65, (1,), generator=g))
        tree = Tree(torch.tensor([int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)]))
        width, depth = tree_bucket(n), int(tree.depth.max())
        host, device = lay_out(tree, width), lay_out_on_device(tree.parents, width, depth + 1)
        for name in host._fields:
            if name != "path_rows":
                assert torch.equal(getattr(host, name), getattr(device, name)), name
        assert torch.equal(device.path_rows[:, :depth], host.path_rows)
        assert torch.equal(device.path_rows[:, depth], torch.arange(1, width + 1))


def eagle_pair(kind, seed=2):
    """A target of 8 tokens, whose trees of top-k picks are often right several deep, and a random head for it."""
    model = tiny_model(seed=0, n_layers=3, vocab_size=8)
    torch.manual_seed(seed)
    cls, layers = (Eagle3Head, (0, 1, 2)) if kind == "eagle3" else (EagleHead, ())
    head = cls(EagleConfig.for_target(model, hidden_dim=32, layers=layers), model.vocab_size)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model, head


@pytest.mark.parametrize("kind,compile", [("eagle", False), ("eagle3", False), ("eagle3", True), ("eagle3", "blocks")],
                         ids=["eagle", "eagle3", "eagle3-traced", "eagle3-traced-layer"])
def test_eagle_trees_drafted_on_the_device_are_the_reference_trees(kind, compile):
    """DeviceEagleDrafter grows, in fixed shapes, the trees EagleDrafter grows on the host, step for step: in the
    eager tree loop (read back) and in the compiled one (the tree never read back before the verify), whose output
    is plain decoding's. Several-deep acceptances make the catch-ups read several pairs at a time."""
    model, head = eagle_pair(kind)
    prompt = torch.tensor([5, 1, 3, 2, 7, 5, 1, 3, 2, 7, 5, 1])
    want = autoregressive_generate(model, prompt, max_new_tokens=40).tokens
    for top_k, depth, budget in ((4, 5, 32), (3, 4, 20)):
        ref = tree_generate(model, EagleDrafter(head, model, top_k=top_k, depth=depth), prompt, 40, budget=budget)
        on_device = lambda: DeviceEagleDrafter(head, model, top_k=top_k, depth=depth, compile=compile,  # noqa: E731
                                               compile_backend="eager")
        read_back = tree_generate(model, on_device(), prompt, 40, budget=budget)
        fast = CompiledTreeDecoder(model, on_device(), max_len=128).generate(prompt, 40, budget=budget)
        assert ref.tokens == read_back.tokens == fast.tokens == want
        steps = [(s.proposed, s.parents, s.path) for s in ref.trace.steps]
        assert [(s.proposed, s.parents, s.path) for s in read_back.trace.steps] == steps
        assert [(s.proposed, s.parents, s.path) for s in fast.trace.steps] == steps
        assert max(s.n_accepted for s in fast.trace.steps) >= 2


class Pattern(PatternOfSteps, FixedBudget):
    """Tree sizes by step (PatternOfSteps): a cost-aware budget's plain steps until its next exploring one."""

    def __init__(self, pattern: list[int]):
        FixedBudget.__init__(self, max(pattern))
        PatternOfSteps.__init__(self, pattern)

    def budget(self) -> int:
        return self.now()


PLAIN_RUNS = [0, 0, 0, 0, 0, 12, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 16]   # runs of 5 and 10 plain steps


@pytest.mark.parametrize("kind", ["medusa", "eagle3 on the device"])
def test_plain_steps_run_on_the_device_one_token_wide(kind, monkeypatch):
    """Where the budget says 0 and knows more plain steps follow, they run back to back (up to PLAIN_RUN, one host
    sync), each verifying the root alone, not a padded 8-node tree; every token is a step of its own, the drafter
    gets every position's features afterwards (an EAGLE head catches up on 8 pairs at once), and output and steps
    are the eager tree loop's under the same budgets."""
    model, head = eagle_pair("eagle3")
    make = (lambda: medusa(model)) if kind == "medusa" else (lambda: DeviceEagleDrafter(head, model, top_k=4, depth=5))
    called, runs = [], []
    call, run = compiled.FixedShapeStep.__call__, CompiledTreeDecoder.plain_run
    monkeypatch.setattr(compiled.FixedShapeStep, "__call__", lambda self: called.append(self) or call(self))
    monkeypatch.setattr(CompiledTreeDecoder, "plain_run", lambda self, r: runs.append(r) or run(self, r))
    prompt = torch.tensor([5, 1, 3, 2, 7, 5, 1, 3, 2, 7, 5, 1])
    out = CompiledTreeDecoder(model, make(), max_len=160).generate(prompt, 50, budget=Pattern(PLAIN_RUNS))
    eager = tree_generate(model, make(), prompt, 50, budget=Pattern(PLAIN_RUNS))
    assert out.tokens == eager.tokens == autoregressive_generate(model, prompt, max_new_tokens=50).tokens
    assert [(s.proposed, s.path) for s in out.trace.steps] == [(s.proposed, s.path) for s in eager.trace.steps]
    widths = [step.tokens.shape[1] for step in called]
    plain = [s for s in out.trace.steps if s.asked == 0]
    assert [s.asked for s in out.trace.steps[:18]] == PLAIN_RUNS and runs[:4] == [5, 8, 2, 5]
    assert widths.count(1) == len(plain) and 17 in widths              # 12 or 16 nodes: the 16-node bucket


def test_a_device_drafter_refuses_what_it_cannot_do_and_says_what_to_pass():
    model, head = eagle_pair("eagle3")
    with pytest.raises(ValueError, match="compile must be one of"):
        DeviceEagleDrafter(head, model, compile="fast")
    with pytest.raises(ValueError, match="needs the target on a CUDA device; use cuda_graph=False"):
        DeviceEagleDrafter(head, model, cuda_graph=True)
    with pytest.raises(ValueError, match="max_len must be an integer >= 2"):
        DeviceEagleDrafter(head, model, max_len=0)
    with pytest.raises(ValueError, match="top_k and depth must be >= 1"):
        DeviceEagleDrafter(head, model, top_k=0)
    drafter = DeviceEagleDrafter(head, model, top_k=2, depth=3, max_len=16)
    prompt = torch.arange(20) % model.vocab_size                  # longer than the cache it was built for
    drafter.start(prompt[:4], torch.zeros(3, 4 * model.args.dim))
    drafter.commit(3 + 16, torch.zeros(16, 4 * model.args.dim))
    with pytest.raises(ValueError, match="build it with max_len >= 20"):
        drafter.propose_on_device(prompt, 4)


def test_a_replay_paced_by_an_eagle3_head_on_the_device_reads_its_taps_and_stays_exact():
    model, head = eagle_pair("eagle3")
    prompt = torch.tensor([5, 1, 3, 2, 7, 5, 1, 3, 2, 7, 5, 1])
    continuation = autoregressive_generate(model, prompt, max_new_tokens=30).tokens
    paced_by = DeviceEagleDrafter(head, model, top_k=4, depth=5)
    calls = []
    paced_by.propose_on_device = lambda tokens, n, run=paced_by.propose_on_device: calls.append(n) or run(tokens, n)
    replay = ReplayTreeDrafter(continuation, [(12, 2), (12, 4), (12, 0)], model.vocab_size)
    dec = CompiledTreeDecoder(model, PacedDrafter(replay, paced_by), max_len=128)
    out = dec.generate(prompt, 30, budget=12)
    assert dec.taps == (0, 1, 2) and out.tokens == continuation and not replay.diverged
    assert calls[:3] == [12, 12, 12] and len(calls) == len(out.trace.steps)
    assert paced_by.n_features == len(prompt) + 30 - 1       # it was given every committed position's features
    assert paced_by.n_pairs > len(prompt) - 1                   # and read them past the prompt


def test_bad_requests_say_what_to_do(target):
    sampler = CompiledTreeDecoder(target, DraftModelDrafter(tiny_model(seed=1)), max_len=128)
    with pytest.raises(ValueError, match="samples its tokens.*top-k picks.*tree_generate"):
        sampler.start(PROMPTS[0], 8, sampling=SamplingConfig(temperature=1.0))
    dec = CompiledTreeDecoder(target, SuffixDrafter(), max_len=128)
    with pytest.raises(ValueError, match="up to 64 nodes"):
        dec.start(PROMPTS[0], 8, budget=65)
    with pytest.raises(ValueError, match="max_len >= "):
        dec.start(PROMPTS[0], 100)
    with pytest.raises(ValueError, match="max_len must be"):
        CompiledTreeDecoder(target, SuffixDrafter(), max_len=20)
    with pytest.raises(ValueError, match="a target of its own.*tree_generate"):
        CompiledTreeDecoder(target, ReadsOwnTarget(), max_len=128)


@CUDA
def test_cuda_graphs_tree_greedy_equals_autoregressive_on_gpu():
    model = tiny_model(seed=0).cuda()
    for compile in (False, "blocks"):
        dec = CompiledTreeDecoder(model, medusa(model), max_len=128, compile=compile, cuda_graph=True)
        for prompt in PROMPTS:
            want = autoregressive_generate(model, prompt, max_new_tokens=24).tokens
            assert dec.generate(prompt, 24, budget=12).tokens == want
        sampled = SamplingConfig(temperature=0.8, top_k=3)
        runs = [dec.generate(PROMPTS[0], 24, budget=12, sampling=sampled, seed=5).tokens for _ in range(2)]
        assert runs[0] == runs[1] and len(runs[0]) == 24                 # a seed fixes the device's draws


@CUDA
def test_cuda_tree_step_makes_one_host_sync():
    """The step's one read of the verdict, and no other wait for the GPU: Medusa's heads replayed as a graph, the
    acceptance indexing with one-element tensors, the commit queued before the read."""
    model = tiny_model(seed=0).cuda()
    dec = CompiledTreeDecoder(model, medusa(model), max_len=128, cuda_graph=True)
    dec.generate(PROMPTS[0], 24, budget=12)                                   # records the graphs
    for sampling in (SamplingConfig(), SamplingConfig(temperature=0.8, top_k=3)):
        dec.start(PROMPTS[0], 24, budget=12, sampling=sampling, seed=0)
        assert [host_syncs(dec.step) for _ in range(4)] == [1] * 4


@CUDA
def test_cuda_eagle_trees_drafted_on_the_device_cost_the_step_one_host_sync():
    """EAGLE-2's tree grown and reranked as two CUDA graphs, laid out on the device: greedy output is plain
    decoding's, and a step still waits for the GPU once."""
    model, head = (x.cuda() for x in eagle_pair("eagle3"))
    prompt = torch.tensor([5, 1, 3, 2, 7, 5, 1, 3, 2, 7, 5, 1])
    want = autoregressive_generate(model, prompt, max_new_tokens=40).tokens
    drafter = DeviceEagleDrafter(head, model, top_k=4, depth=5, compile="blocks", cuda_graph=True)
    dec = CompiledTreeDecoder(model, drafter, max_len=128, compile="blocks", cuda_graph=True)
    assert dec.generate(prompt, 40, budget=32).tokens == want
    dec.start(prompt, 40, budget=32)
    assert [host_syncs(dec.step) for _ in range(4)] == [1] * 4
    assert dec.generate(prompt, 40, budget=Pattern(PLAIN_RUNS)).tokens == want
    dec.start(prompt, 40, budget=Pattern(PLAIN_RUNS))                         # runs of 5, 8 and 2 plain steps
    assert [host_syncs(dec.step) for _ in range(4)] == [1] * 4 and dec.trace.n_generated >= 15


@pytest.mark.parametrize("compile", [False, "blocks"], ids=["static", "traced-blocks"])
def test_eagle3_reads_three_blocks_from_the_verify_and_stays_exact(compile):
    deeper = tiny_model(seed=0, n_layers=3)
    torch.manual_seed(2)
    head = Eagle3Head(EagleConfig.for_target(deeper, hidden_dim=32, layers=(0, 1, 2)), deeper.vocab_size)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    prompt = PROMPTS[0]
    eager = tree_generate(deeper, EagleDrafter(head, deeper, top_k=3, depth=3), prompt, 24, budget=10)
    dec = CompiledTreeDecoder(deeper, EagleDrafter(head, deeper, top_k=3, depth=3), max_len=128, compile=compile,
                              compile_backend="eager")
    fast = dec.generate(prompt, 24, budget=10)
    assert dec.taps == (0, 1, 2) and fast.tokens == eager.tokens
    assert fast.tokens == autoregressive_generate(deeper, prompt, max_new_tokens=24).tokens
    assert [(s.proposed, s.path) for s in fast.trace.steps] == [(s.proposed, s.path) for s in eager.trace.steps]


def joint_two_tokens(accept, tokens: torch.Tensor, n: int, seed: int = 0) -> np.ndarray:
    """Counts (4, 4) of the first two tokens a step commits, over n steps on a two-level tree of fixed tokens: the
    root's children 0, 1 and node 0's children 2, 3. Each row's distribution depends on the path (p(y | x))."""
    torch.manual_seed(0)                                                               # the same p every call
    p0 = torch.distributions.Dirichlet(torch.ones(4)).sample(torch.Size([]))           # (4,)
    p_next = torch.distributions.Dirichlet(torch.ones(4)).sample((4,))                # (4, 4) p(y | x)
    g = torch.Generator().manual_seed(seed)
    tree = Tree(torch.tensor([-1, -1, 0, 0]))
    laid = lay_out(tree, width=8)
    nodes = torch.cat([tokens, tokens.new_full((4,), -1)])                             # (8,) padded
    p_rows = torch.cat([p0[None], p_next[tokens], torch.full((4, 4), 0.25)])           # (1+8, 4): padding rows
    counts = np.zeros((4, 4))
    for _ in range(n):
        acc = accept(laid, nodes, p_rows, g)
        k = int(acc.n_accepted)
        out = [int(nodes[r - 1]) for r in acc.keep_rows[1:k + 1]] + [int(acc.next_token)]
        if len(out) == 1:
            out.append(int(torch.multinomial(p_next[out[0]], 1, generator=g)))
        counts[out[0], out[1]] += 1
    return counts, (p0[:, None] * p_next).double().numpy()


def fresh_draw_when_none_agrees(t, nodes, p_target, generator=None) -> TreeAcceptanceOnDevice:
    """A plausible bug: when no child matches, draw the next token afresh from p, not the residual (the row's draw)."""
    acc = sampled_tree_accept_on_device(t, nodes, p_target, generator)
    last_row = acc.keep_rows[acc.n_accepted]
    fresh = compiled.sample_without_sync(p_target[last_row], generator)[0]
    return acc._replace(next_token=fresh)


@pytest.mark.parametrize("tokens", [[2, 0, 1, 3], [2, 2, 1, 1]], ids=["distinct siblings", "repeated siblings"])
def test_sampled_device_acceptance_draws_what_the_target_draws(tokens):
    """chi-square on the joint of the first two tokens: p(x) p(y | x), whatever tokens the tree holds."""
    def pvalue(counts, p):
        keep = p.flatten() * counts.sum() > 5
        obs, exp = counts.flatten()[keep], p.flatten()[keep]
        return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue

    assert pvalue(*joint_two_tokens(sampled_tree_accept_on_device, torch.tensor(tokens), 20_000, seed=1)) > 1e-3
    assert pvalue(*joint_two_tokens(fresh_draw_when_none_agrees, torch.tensor(tokens), 20_000, seed=1)) < 1e-6


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)], ids=["cpu", "cuda-graphs"])
def test_sampled_output_has_the_targets_distribution(device):
    """Medusa's top-k trees on the compiled loop: each position's token is distributed as the target's own samples
    (temperature 0.7, top-k 5, top-p 0.9: the filtered distribution); on a GPU with the verify replayed as a CUDA
    graph and the draws made on the device."""
    cfg = CONFIGS[1]
    target = tiny_model(seed=3, vocab_size=V, std=0.4, n_layers=1)
    torch.manual_seed(1)
    heads = MedusaHeads(target.lm_head, n_heads=2)
    for block in heads.blocks:
        torch.nn.init.normal_(block.linear.weight, std=0.5)
    exact = exact_marginals(target, cfg)                              # on the CPU, before the model moves
    target, heads = target.to(device), heads.to(device)
    dec = CompiledTreeDecoder(target, MedusaDrafter(heads, [(0,), (1,), (0, 0), (2,), (0, 1)]),
                              max_len=PROMPT.numel() + N_POS + 70, cuda_graph=device == "cuda")
    counts, accepted = np.zeros((N_POS, V)), 0
    for seed in range(N_RUNS):
        out = dec.generate(PROMPT, N_POS, budget=5, sampling=cfg, seed=seed)
        counts[np.arange(N_POS), out.tokens] += 1
        accepted += sum(s.n_accepted for s in out.trace.steps)
    assert accepted > N_RUNS // 4                                    # the trees were accepted from, not just verified
    assert (counts[exact == 0] == 0).all()                          # top-k / top-p: never a token they cut
    assert min(p for p in chi2_pvalues(counts, exact) if not np.isnan(p)) > 1e-3   # (nan: one possible token)
