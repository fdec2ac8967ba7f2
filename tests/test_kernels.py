"""The Triton kernels equal their torch references, and the references equal labkit's own math.

Without a GPU the kernels run under Triton's interpreter (fp32 and fp16 only: the
interpreter's bf16 tl.dot is wrong); conftest.py imports them in that mode and its `triton_interpreter` fixture
sets TRITON_INTERPRET while each of these tests runs, never for other tests. With a GPU they
run compiled, bf16 included.
"""
import pytest
import torch
import torch.nn.functional as F

from labkit import kernels
from labkit.core.acceptance import greedy_accept, speculative_accept
from labkit.core.sampling import sample
from labkit.kernels import acceptance as acc_k
from labkit.kernels import tree_attention as tree_k
from labkit.models.transformer import chain_mask

INTERPRET = not torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])
needs_triton = pytest.mark.skipif(not kernels.HAVE_TRITON, reason="Triton is not installed")
pytestmark = pytest.mark.usefixtures("triton_interpreter")


def chain(n):
    return torch.arange(n) - 1


def star(n):
    return torch.tensor([-1] + [0] * (n - 1))


def forest(n):
    """Two roots, each with a chain under it: parents may hold several -1."""
    return torch.tensor([-1, -1] + [i - 2 for i in range(2, n)])


TREES = {"chain": chain(20), "star": star(18), "random37": tree_k.random_tree(37, torch.Generator().manual_seed(1)),
         "forest": forest(9), "single": torch.tensor([-1]), "random16": tree_k.random_tree(16)}


def test_ancestor_mask_of_chain_star_and_random_tree():
    assert torch.equal(tree_k.ancestor_mask(chain(6)), torch.ones(6, 6, dtype=torch.bool).tril())
    m = tree_k.ancestor_mask(star(5))
    assert m[:, 0].all() and m.sum() == 5 + 4
    parents = TREES["random37"]
    m = tree_k.ancestor_mask(parents)
    for i in range(parents.numel()):
        path, j = {i}, i
        while parents[j] >= 0:
            j = int(parents[j])
            path.add(j)
        assert set(torch.nonzero(m[i])[:, 0].tolist()) == path


def test_bad_parents_are_refused():
    with pytest.raises(ValueError, match="earlier node"):
        tree_k.ancestor_mask(torch.tensor([-1, 2, 0]))
    with pytest.raises(ValueError, match="non-empty"):
        tree_k.ancestor_mask(torch.tensor([], dtype=torch.long))


def test_reference_on_a_chain_equals_the_models_causal_attention():
    """A chain is ordinary causal attention: the reference agrees with SDPA under labkit's chain mask."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, N, P, hd = 2, 4, 2, 7, 11, 16
    q, k, v = (torch.randn(B, h, n, hd, generator=g) for h, n in [(H, N), (Hkv, P + N), (Hkv, P + N)])
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                          attn_mask=chain_mask(P, N))
    torch.testing.assert_close(tree_k.tree_attention_ref(q, k, v, chain(N), P), want, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tree", list(TREES), ids=str)
@pytest.mark.parametrize("prefix_len", [0, 5, 70])
def test_tree_attention_kernel_matches_reference(tree, prefix_len, dtype):
    parents = TREES[tree].to(DEVICE)
    g = torch.Generator().manual_seed(prefix_len)
    B, H, Hkv, hd, N = 2, 4, 2, 16, parents.numel()
    q = torch.randn(B, H, N, hd, generator=g).to(DEVICE, dtype)
    k = torch.randn(B, Hkv, prefix_len + N + 3, hd, generator=g).to(DEVICE, dtype)   # slots past P+N ignored
    v = torch.randn(B, Hkv, prefix_len + N + 3, hd, generator=g).to(DEVICE, dtype)
    out = tree_k.tree_attention(q, k, v, parents, prefix_len, block_n=32)
    want = tree_k.tree_attention_ref(q, k, v, parents, prefix_len)
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)


@needs_triton
def test_tree_attention_kernel_multi_head_and_odd_head_dim():
    """No GQA (H == Hkv) and a head_dim that is not a power of two (masked to the block)."""
    g = torch.Generator().manual_seed(3)
    parents = TREES["random37"].to(DEVICE)
    q = torch.randn(1, 3, 37, 24, generator=g).to(DEVICE)
    k, v = (torch.randn(1, 3, 50 + 37, 24, generator=g).to(DEVICE) for _ in range(2))
    torch.testing.assert_close(tree_k.tree_attention(q, k, v, parents, 50),
                               tree_k.tree_attention_ref(q, k, v, parents, 50), rtol=1e-4, atol=1e-4)


def test_tree_attention_refuses_mismatched_shapes():
    q, k = torch.zeros(1, 4, 5, 16), torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match="exceed"):
        tree_k.tree_attention_ref(q, k, k, chain(5), prefix_len=4)
    with pytest.raises(ValueError, match="tree nodes"):
        tree_k.tree_attention_ref(q, k, k, chain(6), prefix_len=0)


def planted_draft(logits: torch.Tensor, rejects: dict[int, int]) -> torch.Tensor:
    """The target's own argmax as the draft (all accepted), except row r rejected at position rejects[r]."""
    draft = logits[:, :-1].argmax(-1)                                                   # (B, K)
    for row, pos in rejects.items():
        draft[row, pos] = (draft[row, pos] + 1) % logits.shape[-1]
    return draft


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_triton)], ids=["ref", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_greedy_acceptance_equals_labkit_row_by_row(use_kernel, dtype):
    g = torch.Generator().manual_seed(0)
    B, K, V = 6, 5, 1500                                                                # V > one block of 1024
    logits = torch.randn(B, K + 1, V, generator=g).to(dtype)
    logits[3, 2, :] = 0.0                                                               # a tie: the first index wins
    draft = planted_draft(logits, {1: 0, 2: 3, 4: 4})
    fn = acc_k.greedy_accept if use_kernel else acc_k.greedy_accept_ref
    got = fn(draft.to(DEVICE), logits.to(DEVICE))
    for b in range(B):
        want = greedy_accept(draft[b], logits[b])
        assert (int(got.n_accepted[b]), int(got.next_token[b])) == (want.n_accepted, want.next_token)
    assert got.n_accepted.tolist()[:3] == [K, 0, 3]


def probs(shape, g, sharpness=4.0):
    p = torch.rand(shape, generator=g).pow(sharpness)
    return p / p.sum(-1, keepdim=True)


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_triton)], ids=["ref", "triton"])
@pytest.mark.parametrize("seed", range(4))
def test_sampled_acceptance_equals_labkit_given_the_same_uniforms(use_kernel, seed):
    """Same generator, same uniforms: the same accepted count and the same next token as speculative_accept."""
    g = torch.Generator().manual_seed(100 + seed)
    B, K, V = 8, 4, 200
    p_target, q_draft = probs((B, K + 1, V), g), probs((B, K, V), g, sharpness=2.0)
    q_draft[0] = p_target[0, :K]                                                        # p == q: all accepted
    q_draft[1, 0] = p_target[1, 0]                                                      # residual 0 if rejected
    draft = torch.stack([torch.multinomial(q_draft[b], 1, generator=g)[:, 0] for b in range(B)])  # (B, K)
    draft[2, 0] = int(p_target[2, 0].argmin())                                         # very likely rejected
    fn = acc_k.sampled_accept if use_kernel else acc_k.sampled_accept_ref
    n_accepted = []
    for b in range(B):
        g_lab, g_ours = torch.Generator().manual_seed(seed * B + b), torch.Generator().manual_seed(seed * B + b)
        want = speculative_accept(draft[b], q_draft[b], p_target[b], g_lab)
        u = torch.rand(K, generator=g_ours)                                             # what labkit drew first
        got = fn(draft[b:b + 1].to(DEVICE), q_draft[b:b + 1].to(DEVICE), p_target[b:b + 1].to(DEVICE),
                 u[None].to(DEVICE))
        assert int(got.n_accepted[0]) == want.n_accepted
        if not use_kernel:   # the kernel's sums round in another order: compare its distribution below
            assert int(sample(got.next_probs[0].cpu(), g_ours)) == want.next_token
        n_accepted.append(want.n_accepted)
    assert n_accepted[0] == K and n_accepted[2] == 0


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_sampled_acceptance_kernel_matches_reference(dtype):
    g = torch.Generator().manual_seed(7)
    B, K, V = 9, 6, 1100
    p_target, q_draft = probs((B, K + 1, V), g), probs((B, K, V), g)
    q_draft[0] = p_target[0, :K]
    q_draft[3, :2] = p_target[3, :2]
    draft = torch.stack([torch.multinomial(q_draft[b], 1, generator=g)[:, 0] for b in range(B)])
    u = torch.rand(B, K, generator=g)
    args = [t.to(DEVICE) for t in (draft, q_draft.to(dtype), p_target.to(dtype), u)]
    got, want = acc_k.sampled_accept(*args), acc_k.sampled_accept_ref(*args)
    torch.testing.assert_close(got.n_accepted, want.n_accepted)
    torch.testing.assert_close(got.next_probs, want.next_probs, rtol=1e-5, atol=1e-7)
    assert int(got.n_accepted[0]) == K


def test_dispatch_uses_the_reference_on_cpu():
    assert not kernels.use_triton(torch.zeros(1))
    ok, why = kernels.available()
    assert ok == (kernels.HAVE_TRITON and torch.cuda.is_available()) and why
    logits = torch.randn(2, 4, 50)
    draft = planted_draft(logits, {1: 1})
    assert kernels.greedy_accept(draft, logits).n_accepted.tolist() == [3, 1]


def test_acceptance_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"\(B, K\+1, V\)"):
        acc_k.greedy_accept_ref(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 10))
    with pytest.raises(ValueError, match="uniforms"):
        acc_k.sampled_accept_ref(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 10), torch.zeros(2, 4, 10),
                                 torch.zeros(3))


def test_labkit_imports_and_decodes_without_triton():
    """With Triton absent (blocked in a fresh interpreter), labkit and the dispatch fall back to the references."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\nfrom labkit import kernels\n"
            "from labkit.decoding.batched import batched_speculative_generate\n"
            "from labkit.drafters import DraftModelDrafter\n"
            "from labkit.models.transformer import ModelArgs, Transformer\n"
            "m = Transformer(ModelArgs(vocab_size=50, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=64))\n"
            "out = batched_speculative_generate(m.init_random(std=0.2), DraftModelDrafter(m), [torch.tensor([1, 2]), "
            "torch.tensor([3])], 6)\n"
            "q = torch.randn(1, 2, 3, 16); k = torch.randn(1, 1, 8, 16)\n"
            "kernels.attend_tree(q, k, k, torch.tensor([-1, 0, 0]), 5)\n"
            "print(kernels.HAVE_TRITON, [len(g.tokens) for g in out])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "[6,", "6]"]
