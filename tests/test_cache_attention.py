"""The Triton attention over a static cache (kernels/cache_attention.py) against torch's attention, and the
compiled loops running it.

Without a GPU the kernel runs under Triton's interpreter (fp32 and fp16: the interpreter's bf16 tl.dot is wrong),
imported in that mode by conftest.py; torch.compile then calls it as an opaque op, on a GPU it is compiled into the
step. The kernel equals the reference on chain and tree steps at every grouping of query heads, cache tail and split
count; the compiled loops with it (plain decoding, a chain, a tree; eager, traced, inductor) decode what
`autoregressive_generate` decodes with torch's attention, token for token. The CUDA variant adds CUDA graphs, bf16 and
the benchmark (scripts/gpu_check.py runs it).
"""
import pytest
import torch
from conftest import tiny_model
from labkit.kernels import HAVE_TRITON
from labkit.kernels import cache_attention as ca
from labkit.kernels.tree_attention import random_tree

from labkit import autoregressive_generate
from labkit.decoding.compiled import CompiledSpeculativeDecoder
from labkit.decoding.compiled_tree import CompiledTreeDecoder
from labkit.decoding.static import StaticDecoder
from labkit.decoding.tree import tree_generate
from labkit.drafters.eagle import EagleDrafter
from labkit.drafters.eagle_device import DeviceEagleDrafter
from labkit.drafters.prompt_lookup import PromptLookupDrafter
from labkit.drafters.suffix import SuffixDrafter
from labkit.models.backends import attention_of, use_attention
from labkit.models.eagle_heads import Eagle3Head, EagleConfig

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
PROMPTS = [torch.tensor([5, 17, 33, 2, 9, 5, 17, 33, 2, 9, 5, 17]), torch.tensor([1]), torch.tensor([7, 8, 9, 7, 8])]

pytestmark = [pytest.mark.skipif(not HAVE_TRITON, reason="Triton is not installed"),
              pytest.mark.usefixtures("triton_interpreter", "one_thread")]


def inputs(H, Hkv, T, S, hd=32, B=1, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, n, hd, generator=g).to(DEVICE, dtype) for h, n in ((H, T), (Hkv, S), (Hkv, S))]


def random_parents(T, seed=0):
    return random_tree(T, torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (14, 2), (12, 2)], ids=lambda h: f"{h[0]}q-{h[1]}kv")
@pytest.mark.parametrize("T", [1, 2, 9, 33])
def test_the_kernel_equals_torchs_attention_on_chain_and_tree_steps(dtype, heads, T):
    S = 200
    q, k, v = inputs(*heads, T, S, dtype=dtype, seed=T)
    for n_cached, parents in ((70, list(range(-1, T - 1))), (70, random_parents(T)), (0, random_parents(T, 1)),
                              (S - T, list(range(-1, T - 1)))):             # a first step, a step filling the cache
        mask = ca.step_mask(n_cached, parents, S).to(DEVICE)
        want = ca.cache_attention_ref(q, k, v, mask)
        torch.testing.assert_close(ca.cache_attention(q, k, v, mask), want, rtol=TOL[dtype], atol=TOL[dtype])


def test_any_split_of_the_cache_gives_the_same_attention_and_batches_are_their_own():
    q, k, v = inputs(6, 2, 5, 300, B=2)
    mask = ca.step_mask(123, random_parents(5), 300).to(DEVICE)
    want = ca.cache_attention_ref(q, k, v, mask)
    for splits in (1, 2, 5, 16, 300):                       # 300: single slots, most programs see nothing
        torch.testing.assert_close(ca.cache_attention(q, k, v, mask, splits=splits), want, rtol=1e-5, atol=1e-5)
    one = ca.cache_attention(q[1:], k[1:], v[1:], mask)
    torch.testing.assert_close(ca.cache_attention(q, k, v, mask)[1:], one, rtol=0, atol=0)
    assert ca.default_splits(300) == 5 and ca.default_splits(10) == 1 and ca.default_splits(10 ** 5) == ca.MAX_SPLITS


def test_a_row_that_sees_no_slot_is_zero_not_nan():
    q, k, v = inputs(4, 2, 3, 100)
    mask = ca.step_mask(40, [-1, 0, 1], 100).to(DEVICE)
    mask[1] = False
    out = ca.cache_attention(q, k, v, mask)
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    torch.testing.assert_close(out[:, :, [0, 2]], ca.cache_attention_ref(q, k, v, mask)[:, :, [0, 2]])


def test_the_step_mask_is_the_compiled_loops_mask():
    """step_mask is what compiled.tree_mask makes on the device from a tree's ancestor block and the step's slots."""
    from labkit.core.tree import Tree
    from labkit.decoding.compiled import tree_mask
    parents = random_parents(9, 3)
    block = Tree(torch.tensor(parents)).mask
    assert torch.equal(ca.step_mask(50, parents, 128), tree_mask(block, torch.arange(50, 59), 128))


def test_bad_calls_say_what_to_pass():
    q, k, v = inputs(6, 2, 3, 64)
    mask = ca.step_mask(10, [-1, 0, 1], 64).to(DEVICE)
    with pytest.raises(ValueError, match=r"mask must be a \(T, S\) = \(3, 64\) bool tensor.*cache_attention_ref"):
        ca.cache_attention(q, k, v, mask.float())
    with pytest.raises(ValueError, match="mask must be"):
        ca.cache_attention(q, k, v, mask[:2])
    with pytest.raises(ValueError, match="mask must be"):
        ca.cache_attention(q, k, v, None)
    with pytest.raises(ValueError, match="splits must be an integer from 1 to the 64 slots"):
        ca.cache_attention(q, k, v, mask, splits=0)
    with pytest.raises(ValueError, match="splits must be"):
        ca.cache_attention(q, k, v, mask, splits=True)
    with pytest.raises(ValueError, match="GQA groups"):
        ca.cache_attention(q[:, :5], k, v, mask)


def test_use_attention_swaps_every_layer_and_refuses_what_cannot_run(monkeypatch):
    model = tiny_model(seed=0)
    assert attention_of(model) == "sdpa"
    assert attention_of(use_attention(model, "triton")) == "triton"
    assert attention_of(use_attention(model, "sdpa")) == "sdpa"
    with pytest.raises(ValueError, match="unknown attention 'flash': choose from sdpa, triton"):
        use_attention(model, "flash")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if model.device.type == "cpu":
        with pytest.raises(ValueError, match="runs on CUDA GPUs; this model is on cpu: use attention='sdpa'"):
            use_attention(model, "triton")
    assert attention_of(model) == "sdpa"


def decoders(model, how: dict):
    """Plain decoding, a chain (prompt lookup) and a tree (suffix decoding), each built `how` (static-loop options)."""
    return [lambda p: StaticDecoder(model, max_len=128, **how).generate(p, 24),
            lambda p: CompiledSpeculativeDecoder(model, PromptLookupDrafter(), max_len=128, **how).generate(p, 24,
                                                                                                             gamma=4),
            lambda p: CompiledTreeDecoder(model, SuffixDrafter(), max_len=128, **how).generate(p, 24, budget=12)]


COMPILES = {"static": {}, "traced-blocks": dict(compile="blocks", compile_backend="eager"),
            "inductor": dict(compile="blocks")}


@pytest.mark.parametrize("compile", COMPILES)
def test_the_compiled_loops_with_the_triton_attention_decode_what_plain_decoding_does(compile, monkeypatch):
    model = tiny_model(seed=0).to(DEVICE)
    want = [autoregressive_generate(model, p, max_new_tokens=24).tokens for p in PROMPTS]   # torch's attention
    use_attention(model, "triton")
    for run in decoders(model, COMPILES[compile]):
        for prompt, tokens in zip(PROMPTS, want):
            out = run(prompt)
            assert out.tokens == tokens, prompt.tolist()
            assert out.trace.n_generated == 24
    # the kernel is what ran (or was traced into the step), not torch's: with its merge broken the tokens change.
    # Inductor compiles the graph traced-blocks traces (the kernel an opaque op in both), so that check covers it:
    # a second inductor build would only spend a minute compiling the same graph again
    if compile == "inductor":
        return
    monkeypatch.setattr(ca, "merge_splits", lambda acc, m, l_sum, dtype: (acc.sum(-2) / 2).to(dtype))
    for run in decoders(model, COMPILES[compile]):
        assert run(PROMPTS[0]).tokens != want[0]


def test_eagle3_trees_grown_on_the_device_with_the_triton_attention_are_the_reference_trees():
    """The EAGLE-3 head's own layer runs the kernel too (its catch-up and each level of the tree, masks over its own
    static cache): the same trees as EagleDrafter's with torch's attention, step for step, and plain decoding's
    output."""
    model = tiny_model(seed=0, n_layers=3, vocab_size=8)        # 8 tokens: top-k trees often right several deep
    torch.manual_seed(2)
    head = Eagle3Head(EagleConfig.for_target(model, hidden_dim=32, layers=(0, 1, 2)), model.vocab_size)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    prompt = torch.tensor([5, 1, 3, 2, 7, 5, 1, 3, 2, 7, 5, 1])
    want = autoregressive_generate(model, prompt, max_new_tokens=30).tokens
    ref = tree_generate(model, EagleDrafter(head, model, top_k=4, depth=5), prompt, 30, budget=32)
    use_attention(model, "triton")
    assert attention_of(use_attention(head, "triton")) == "triton"
    fast = CompiledTreeDecoder(model, DeviceEagleDrafter(head, model, top_k=4, depth=5, compile="blocks",
                                                         compile_backend="eager"), max_len=128).generate(prompt, 30,
                                                                                                          budget=32)
    assert ref.tokens == fast.tokens == want
    assert [(s.proposed, s.parents, s.path) for s in fast.trace.steps] == \
           [(s.proposed, s.parents, s.path) for s in ref.trace.steps]
    assert max(s.n_accepted for s in fast.trace.steps) >= 2


@CUDA
def test_cuda_graphs_with_the_triton_attention_decode_what_plain_decoding_does():
    model = tiny_model(seed=0).cuda()
    want = [autoregressive_generate(model, p, max_new_tokens=24).tokens for p in PROMPTS]
    use_attention(model, "triton")
    for run in decoders(model, dict(compile="blocks", cuda_graph=True)):
        assert [run(p).tokens for p in PROMPTS] == want


@CUDA
def test_cuda_benchmark_rows_are_exact_and_timed():
    rows = ca.benchmark(tokens=(1, 9), slots=(320,), shapes={"qwen2.5-1.5b": ca.BENCH_SHAPES["qwen2.5-1.5b"]})
    assert len(rows) == 2
    for row in rows:
        assert row["max_abs_err"] < 2e-2 and row["triton_us"] > 0 and row["sdpa_us"] > 0
