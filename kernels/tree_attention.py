"""Tree attention: N draft-tree nodes attend to the cached prefix plus their own ancestors.

A verify pass over a token tree (SpecInfer, Medusa, EAGLE) feeds all N nodes at once; node i
may see the P cached prefix tokens and the nodes on its root path, itself included. The tree
is a parent vector (parents[i] < i, -1 for a root); a chain is parents = [-1, 0, 1, ...].
Keys/values of the nodes sit in the cache right after the prefix (slots P..P+N-1), as
labkit's KVCache writes them.

Triton tutorial order: the kernel (online softmax over the prefix, then over the tree with the
ancestor mask, after 06-fused-attention), its wrapper, the torch reference and a check, and a
benchmark against the reference and `scaled_dot_product_attention` with a boolean mask.

    TRITON_INTERPRET=1 python -m labkit.kernels.tree_attention     # check on CPU (interpreter)
    python -m labkit.kernels.tree_attention --bench                # on a CUDA device
"""
from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # labkit works without Triton: kernels/__init__.py dispatches to the reference
    triton = None


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """(N, N) bool: [i, j] is True when node j is node i or one of its ancestors.

    labkit.core.tree.Tree's transitive closure (repeated squaring: log2 N tensor ops, no Python loop
    over nodes). Build it once per tree: every layer's attention reuses it.
    """
    from labkit.core.tree import Tree
    parents = check_parents(parents)
    return Tree(parents).mask.to(parents.device)


def check_parents(parents: torch.Tensor) -> torch.Tensor:
    """A non-empty 1-D long vector; labkit.core.tree.Tree checks the order (each parent -1 or an earlier node)."""
    parents = torch.as_tensor(parents).long()
    if parents.dim() != 1 or parents.numel() == 0:
        raise ValueError(f"parents must be a non-empty 1-D vector of parent indices, got shape {tuple(parents.shape)}")
    return parents


def tree_mask(parents: torch.Tensor, prefix_len: int, anc: torch.Tensor | None = None) -> torch.Tensor:
    """(N, P+N) bool over prefix + tree slots: every node sees the whole prefix and its ancestors.

    anc: ancestor_mask(parents) when already built (once per tree), else built here."""
    anc = (ancestor_mask(parents) if anc is None else anc).bool()                      # (N, N)
    return torch.cat([anc.new_ones(anc.shape[0], prefix_len), anc], dim=1)            # (N, P+N)


if triton is not None:

    @triton.jit
    def attend_block(q, k_ptrs, v_ptrs, s_valid, d_valid, visible, m_i, l_i, acc, qk_scale,
                     DOT_PRECISION: tl.constexpr):
        """One block of keys in an online softmax (06-fused-attention's inner step): q (BLOCK_M, BLOCK_D) against
        the keys at k_ptrs (BLOCK_D, BLOCK_N), each row's scores where `visible` (BLOCK_M, BLOCK_N) allows, folded
        into its running max m_i, sum l_i (log2 units) and weighted values acc with the values at v_ptrs
        (BLOCK_N, BLOCK_D). Returns the new (m_i, l_i, acc)."""
        kT = tl.load(k_ptrs, mask=s_valid[None, :] & d_valid[:, None], other=0.0)             # (BLOCK_D, BLOCK_N)
        qk = tl.dot(q, kT, input_precision=DOT_PRECISION) * qk_scale                         # (BLOCK_M, BLOCK_N)
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                          # rows that saw nothing yet
        p = tl.exp2(qk - m_safe[:, None])                                                     # (BLOCK_M, BLOCK_N)
        alpha = tl.exp2(m_i - m_safe)
        v = tl.load(v_ptrs, mask=s_valid[:, None] & d_valid[None, :], other=0.0)              # (BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        return m_new, l_i * alpha + tl.sum(p, 1), acc

    @triton.jit
    def _tree_attention_kernel(
        Q, K, V, Mask, Out,
        stride_qb, stride_qh, stride_qn,
        stride_kb, stride_kh, stride_ks,
        stride_vb, stride_vh, stride_vs,
        stride_ob, stride_oh, stride_on,
        n_heads, prefix_len, n_nodes, head_dim, sm_scale,
        GROUPS: tl.constexpr,    # query heads per key/value head (GQA); 1 for plain multi-head
        BLOCK_M: tl.constexpr,   # tree-node queries per program (>= 16: tl.dot's minimum)
        BLOCK_N: tl.constexpr,   # keys per inner step
        BLOCK_D: tl.constexpr,   # head_dim rounded up to a power of two
        DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (a GPU's tl.dot would use TF32), else "tf32"
    ):
        start_m = tl.program_id(0)
        bh = tl.program_id(1)
        b, h = bh // n_heads, bh % n_heads
        h_kv = h // GROUPS
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)                             # (BLOCK_M,) node ids
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        m_valid = offs_m < n_nodes
        d_valid = offs_d < head_dim
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :],
                    mask=m_valid[:, None] & d_valid[None, :], other=0.0)               # (BLOCK_M, BLOCK_D)
        k_base = K + b * stride_kb + h_kv * stride_kh
        v_base = V + b * stride_vb + h_kv * stride_vh
        qk_scale = sm_scale * 1.44269504                                               # exp(x) = exp2(x * log2 e)
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")                      # running max
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                                    # running sum of exp
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)                           # running weighted values
        # 1. the cached prefix: every node sees all of it, no mask but the bounds
        # 2. the tree slots: a node sees its ancestors and itself (the mask's row)
        for phase in tl.static_range(2):
            if phase == 0:
                lo, hi = 0, prefix_len
            else:
                lo, hi = prefix_len, prefix_len + n_nodes
            for start_n in range(lo, hi, BLOCK_N):
                slots = start_n + offs_n                                               # (BLOCK_N,)
                s_valid = slots < hi
                if phase == 0:
                    visible = m_valid[:, None] & s_valid[None, :]
                else:
                    nodes = slots - prefix_len
                    seen = tl.load(Mask + offs_m[:, None] * n_nodes + nodes[None, :],
                                   mask=m_valid[:, None] & s_valid[None, :], other=0)
                    visible = seen != 0
                m_i, l_i, acc = attend_block(q, k_base + slots[None, :] * stride_ks + offs_d[:, None],
                                             v_base + slots[:, None] * stride_vs + offs_d[None, :],
                                             s_valid, d_valid, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]                            # padded rows: 0, not nan
        tl.store(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, parents: torch.Tensor,
                   prefix_len: int, block_m: int = 16, block_n: int = 64,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """Triton tree attention. q: (B, H, N, hd); k, v: (B, Hkv, S, hd) with S >= P+N -> (B, H, N, hd).

    mask: ancestor_mask(parents) (N, N), made once per tree and passed to every layer's call;
    built here when None.
    """
    if triton is None:
        raise RuntimeError("Triton is not installed: use tree_attention_ref (or kernels.attend_tree, which picks)")
    B, H, N, hd = q.shape
    Hkv = check_shapes(q, k, v, parents, prefix_len)
    mask = (ancestor_mask(parents) if mask is None else mask).to(q.device, torch.int8).contiguous()  # (N, N)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty_like(q)                                                            # (B, H, N, hd)
    grid = (triton.cdiv(N, block_m), B * H)
    _tree_attention_kernel[grid](
        q, k, v, mask, out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        H, prefix_len, N, hd, 1.0 / math.sqrt(hd),
        GROUPS=H // Hkv, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(hd)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out


def check_qkv(q, k, v) -> int:
    """q (B, H, N, hd) against k, v (B, Hkv, S, hd), or a ValueError that says what does not match; returns Hkv."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"q must be (B, H, N, hd) and k, v (B, Hkv, S, hd); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, H, N, hd = q.shape
    if k.shape[0] != B or k.shape[3] != hd or H % k.shape[1]:
        raise ValueError(f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)} (batch, head_dim, GQA groups)")
    return k.shape[1]


def check_shapes(q, k, v, parents, prefix_len: int) -> int:
    """Validate the call; return the number of key/value heads."""
    check_qkv(q, k, v)
    N = q.shape[2]
    if parents.shape != (N,):
        raise ValueError(f"parents has shape {tuple(parents.shape)} but q has N={N} tree nodes")
    if not 0 <= prefix_len or prefix_len + N > k.shape[2]:
        raise ValueError(f"prefix_len={prefix_len} + N={N} tree nodes exceed the {k.shape[2]} cached slots")
    return k.shape[1]


def tree_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, parents: torch.Tensor,
                       prefix_len: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference: explicit masked softmax in fp32. Same arguments as tree_attention."""
    B, H, N, hd = q.shape
    groups = H // check_shapes(q, k, v, parents, prefix_len)
    S = prefix_len + N
    k_all = k[:, :, :S].repeat_interleave(groups, dim=1).float()                        # (B, H, S, hd)
    v_all = v[:, :, :S].repeat_interleave(groups, dim=1).float()                        # (B, H, S, hd)
    scores = q.float() @ k_all.transpose(-1, -2) / math.sqrt(hd)                         # (B, H, N, S)
    visible = tree_mask(parents, prefix_len, anc=mask).to(q.device)                     # (N, S)
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ v_all).to(q.dtype)                                      # (B, H, N, hd)


def random_tree(n_nodes: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A random tree, root first: node i hangs under a uniformly drawn earlier node."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, n_nodes)]
    return torch.tensor(parents)


def check(B=2, H=4, Hkv=2, N=37, P=100, hd=32, dtype=torch.float16, device="cpu", seed=0) -> float:
    """Max abs difference between the kernel and the reference on a random tree; raises if too large."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, hd, generator=g).to(device, dtype)
    k = torch.randn(B, Hkv, P + N, hd, generator=g).to(device, dtype)
    v = torch.randn(B, Hkv, P + N, hd, generator=g).to(device, dtype)
    parents = random_tree(N, g).to(device)
    err = (tree_attention(q, k, v, parents, P).float() - tree_attention_ref(q, k, v, parents, P).float()).abs().max()
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    if not err <= tol:
        raise AssertionError(f"tree attention differs from the reference by {err:.2e} (> {tol:.0e})")
    return float(err)


def benchmark(n_nodes=(16, 32, 64, 128, 256), prefixes=(512, 1024, 2048, 4096, 8192), B=1, H=12, Hkv=2,
              hd=128, dtype=torch.bfloat16) -> list[dict]:
    """Kernel vs reference vs SDPA with a boolean mask, K/V repeated per query head or read in place with
    enable_gqa (median ms, CUDA only); Qwen2.5-1.5B's head shape."""
    import torch.nn.functional as F
    rows = []
    for P in prefixes:
        for N in n_nodes:
            q = torch.randn(B, H, N, hd, device="cuda", dtype=dtype)
            k = torch.randn(B, Hkv, P + N, hd, device="cuda", dtype=dtype)
            v = torch.randn(B, Hkv, P + N, hd, device="cuda", dtype=dtype)
            parents = random_tree(N).cuda()
            anc = ancestor_mask(parents)                   # once per tree, as a verify pass does for all layers
            mask = tree_mask(parents, P, anc=anc)                                        # (N, P+N)
            ref = tree_attention_ref(q, k, v, parents, P, mask=anc)
            out = tree_attention(q, k, v, parents, P, mask=anc)
            err = float((out.float() - ref.float()).abs().max())

            def sdpa():                                    # K/V copied out to every query head
                kk, vv = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
                return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)

            def sdpa_gqa():                                # K/V read in place (labkit's model does this)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            ms = {name: triton.testing.do_bench(fn) for name, fn in
                  [("triton", lambda: tree_attention(q, k, v, parents, P, mask=anc)),
                   ("torch_ref", lambda: tree_attention_ref(q, k, v, parents, P, mask=anc)), ("sdpa_mask", sdpa),
                   ("sdpa_gqa_mask", sdpa_gqa)]}
            kv_bytes = 2 * B * Hkv * (P + N) * hd * q.element_size()
            rows.append({"prefix": P, "nodes": N, "max_abs_err": err, **{f"{n}_ms": t for n, t in ms.items()},
                         "triton_kv_GBps": kv_bytes / ms["triton"] / 1e6})
    return rows


if __name__ == "__main__":
    import sys
    rows = benchmark() if "--bench" in sys.argv else [(dt, check(dtype=dt)) for dt in (torch.float32, torch.float16)]
    print(*rows, sep="\n")
