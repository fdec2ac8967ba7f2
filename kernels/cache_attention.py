"""Attention over a static KV cache under a slot mask: the compiled loops' decode and verify attention.

The compiled loops (decoding/static.py, compiled.py, compiled_tree.py) keep keys and values in a StaticKVCache of
S = max_len slots, and give a step's T tokens a (T, S) mask of the slots each may see: the committed tokens and,
among the step's own slots, itself and what it follows (a chain's earlier tokens, a tree node's ancestors). The
reference is torch's `scaled_dot_product_attention` with that mask (models/layers.SDPAttention). On a GPU, inside a
CUDA graph, that call costs far more than the few kilobytes of keys it reads at batch 1; this kernel is the same
math shaped for decoding:

1. One program serves all G = H / Hkv query heads that share a key/value head: its rows are the step's T tokens x
   G heads (row r: token r // G, head r % G), so each key and value is read once per K/V head, not once per query
   head, and a one-token step still fills tl.dot's 16 rows with 6-8 real ones instead of 1.
2. The S slots are split into `splits` ranges, one program each (flash-decoding), so that a one-token step of a
   model with 2 K/V heads keeps more than 2 of the GPU's multiprocessors busy; each writes its unnormalised sum
   with its softmax maximum and total, and `merge_splits` rescales and adds them.
3. A block of slots that no row of the program sees (past the step's last slot: the cache's unused tail) is
   skipped: its mask bytes are read, not its keys and values.

Triton tutorial order: the kernel, its wrapper (a `torch.library.triton_op`, so torch.compile keeps it inside a
compiled block and a CUDA graph records it), the merge, the reference, a check, and a benchmark inside CUDA graphs
against the reference at the shapes the compiled loops run.

    TRITON_INTERPRET=1 python -m labkit.kernels.cache_attention     # check on CPU (interpreter)
    python -m labkit.kernels.cache_attention --bench                # on a CUDA device
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .tree_attention import check_qkv, random_tree, tree_mask

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    from .tree_attention import attend_block  # the online-softmax step over one block of keys
except ImportError:  # labkit works without Triton: models.backends.use_attention keeps torch's attention
    triton = None

BLOCK_N = 64             # slots per inner step
MAX_SPLITS = 16          # ranges of the cache, one program each (per K/V head and block of rows)


if triton is not None:

    @triton.jit
    def _cache_attention_kernel(
        Q, K, V, Mask, Acc, Max, Sum,
        stride_qb, stride_qh, stride_qt,
        stride_kb, stride_kh, stride_ks,
        stride_vb, stride_vh, stride_vs,
        stride_mt,
        n_kv_heads, n_tokens, n_slots, split_len, head_dim, sm_scale,
        GROUPS: tl.constexpr,    # query heads per key/value head (GQA); 1 for plain multi-head
        BLOCK_M: tl.constexpr,   # rows (token x query head of the group) per program, >= 16: tl.dot's minimum
        BLOCK_N: tl.constexpr,   # slots per inner step
        BLOCK_D: tl.constexpr,   # head_dim rounded up to a power of two
        DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (a GPU's tl.dot would use TF32), else "tf32"
    ):
        start_m, bh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n_splits = tl.num_programs(2)
        b, h_kv = bh // n_kv_heads, bh % n_kv_heads
        rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)                               # (BLOCK_M,)
        t = rows // GROUPS                                                             # the row's token
        h = h_kv * GROUPS + rows % GROUPS                                              # the row's query head
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        r_valid = t < n_tokens
        d_valid = offs_d < head_dim
        q = tl.load(Q + b * stride_qb + h[:, None] * stride_qh + t[:, None] * stride_qt + offs_d[None, :],
                    mask=r_valid[:, None] & d_valid[None, :], other=0.0)               # (BLOCK_M, BLOCK_D)
        k_base = K + b * stride_kb + h_kv * stride_kh
        v_base = V + b * stride_vb + h_kv * stride_vh
        qk_scale = sm_scale * 1.44269504                                               # exp(x) = exp2(x * log2 e)
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")                      # running max (log2 units)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                                    # running sum of exp
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)                           # running weighted values
        lo = split * split_len
        hi = tl.minimum(lo + split_len, n_slots)
        for start_n in range(lo, hi, BLOCK_N):
            slots = start_n + offs_n                                                   # (BLOCK_N,)
            s_valid = slots < hi
            seen = tl.load(Mask + t[:, None] * stride_mt + slots[None, :],
                           mask=r_valid[:, None] & s_valid[None, :], other=0) != 0     # (BLOCK_M, BLOCK_N)
            if tl.max(tl.max(seen.to(tl.int32), 1), 0) > 0:                            # some row sees a slot here
                m_i, l_i, acc = attend_block(q, k_base + slots[None, :] * stride_ks + offs_d[:, None],
                                             v_base + slots[:, None] * stride_vs + offs_d[None, :],
                                             s_valid, d_valid, seen, m_i, l_i, acc, qk_scale, DOT_PRECISION)
        # partial results, (B, H, T, splits[, hd]) contiguous: the row's (b, h, t) and this split
        part = ((b * n_kv_heads * GROUPS + h) * n_tokens + t) * n_splits + split            # (BLOCK_M,)
        tl.store(Acc + part[:, None] * head_dim + offs_d[None, :], acc, mask=r_valid[:, None] & d_valid[None, :])
        tl.store(Max + part, m_i, mask=r_valid)
        tl.store(Sum + part, l_i, mask=r_valid)

    def _splits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kernel's partial results: (acc (B, H, T, splits, hd), max (B, H, T, splits), sum (B, H, T, splits)),
        fp32; `merge_splits` makes the attention of them. Arguments as `cache_attention`'s, mask as int8."""
        B, H, T, hd = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        acc = torch.empty(B, H, T, splits, hd, device=q.device, dtype=torch.float32)
        m = torch.empty(B, H, T, splits, device=q.device, dtype=torch.float32)
        l_sum = torch.empty(B, H, T, splits, device=q.device, dtype=torch.float32)
        groups = H // Hkv
        block_m = 16 if T * groups <= 16 else 32 if T * groups <= 32 else 64
        split_len = triton.cdiv(triton.cdiv(S, splits), BLOCK_N) * BLOCK_N
        grid = (triton.cdiv(T * groups, block_m), B * Hkv, splits)
        launch = wrap_triton(_cache_attention_kernel) if COMPILED else _cache_attention_kernel
        launch[grid](
            q, k, v, mask, acc, m, l_sum,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), mask.stride(0),
            Hkv, T, S, split_len, hd, 1.0 / math.sqrt(hd),
            GROUPS=groups, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(hd)),
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )
        return acc, m, l_sum

    # a GPU's kernel is a triton_op, which torch.compile places inside the compiled code (and so in a CUDA graph);
    # the interpreter's (TRITON_INTERPRET=1, a CPU) is an opaque custom op that the compiled code calls
    COMPILED = isinstance(_cache_attention_kernel, triton.runtime.JITFunction)
    if COMPILED:
        cache_attention_splits = triton_op("labkit::cache_attention_splits", mutates_args=())(_splits)
    else:
        cache_attention_splits = torch.library.custom_op("labkit::cache_attention_splits", mutates_args=())(_splits)

        @cache_attention_splits.register_fake
        def _(q, k, v, mask, splits):
            B, H, T, hd = q.shape
            part = q.new_empty(B, H, T, splits, dtype=torch.float32)
            return q.new_empty(B, H, T, splits, hd, dtype=torch.float32), part, torch.empty_like(part)


def default_splits(n_slots: int) -> int:
    """How many ranges a cache of `n_slots` is split into: one per BLOCK_N slots, at most MAX_SPLITS."""
    return max(1, min(MAX_SPLITS, -(-n_slots // BLOCK_N)))


def merge_splits(acc: torch.Tensor, m: torch.Tensor, l_sum: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The attention (B, H, T, hd) from the splits' partial results: each split's sum rescaled to the common maximum.
    A row that saw no slot at all gives 0 (the reference gives NaN; labkit's masks always show a token itself)."""
    top = m.amax(-1, keepdim=True)                                                       # (B, H, T, 1)
    w = torch.exp2(m - torch.where(top == float("-inf"), 0.0, top))                      # (B, H, T, splits)
    total = (l_sum * w).sum(-1, keepdim=True)                                           # (B, H, T, 1)
    out = (acc * w[..., None]).sum(-2) / torch.where(total == 0, 1.0, total)             # (B, H, T, hd)
    return out.to(dtype)


def check_shapes(q, k, v, mask) -> None:
    """Validate the call, with what to pass instead."""
    check_qkv(q, k, v)
    T = q.shape[2]
    if mask is None or mask.dtype != torch.bool or mask.shape != (T, k.shape[2]):
        got = None if mask is None else (tuple(mask.shape), mask.dtype)
        raise ValueError(f"mask must be a (T, S) = ({T}, {k.shape[2]}) bool tensor of the slots each token sees, "
                         f"got {got}: for other masks use cache_attention_ref (torch's attention)")


def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    splits: int | None = None) -> torch.Tensor:
    """Triton attention of q (B, H, T, hd) over k, v (B, Hkv, S, hd) where mask (T, S) allows -> (B, H, T, hd).

    splits: ranges of the S slots, one program each (default `default_splits(S)`)."""
    if triton is None:
        raise RuntimeError("Triton is not installed: use cache_attention_ref (torch's attention)")
    check_shapes(q, k, v, mask)
    splits = default_splits(k.shape[2]) if splits is None else splits
    if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= k.shape[2]:
        raise ValueError(f"splits must be an integer from 1 to the {k.shape[2]} slots, got {splits!r}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    acc, m, l_sum = cache_attention_splits(q, k, v, mask.view(torch.int8), splits)
    return merge_splits(acc, m, l_sum, q.dtype)


def cache_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The reference: torch's scaled_dot_product_attention under the mask, K/V heads shared by query groups (what
    labkit's model runs, models/layers.SDPAttention)."""
    check_shapes(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)       # (B, H, T, hd)


def step_mask(n_cached: int, parents: list[int], n_slots: int) -> torch.Tensor:
    """(T, S) bool: a step of T tokens (a tree, parents[i] < i, -1 under the last committed token; a chain is
    [-1, 0, 1, ...]) written after `n_cached` committed slots of a cache of `n_slots`: each token sees the committed
    slots, itself and its ancestors, and nothing after the step (as compiled.tree_mask makes it)."""
    seen = tree_mask(torch.tensor(parents), n_cached)                                     # (T, n_cached + T)
    return torch.cat([seen, seen.new_zeros(len(parents), n_slots - n_cached - len(parents))], dim=1)  # (T, S)


def check(B=1, H=6, Hkv=2, T=5, n_cached=70, S=200, hd=32, dtype=torch.float32, device="cpu", seed=0) -> float:
    """Max abs difference between the kernel and the reference on a random tree step; raises if too large."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, hd, generator=g).to(device, dtype)
    k = torch.randn(B, Hkv, S, hd, generator=g).to(device, dtype)
    v = torch.randn(B, Hkv, S, hd, generator=g).to(device, dtype)
    mask = step_mask(n_cached, random_tree(T, g).tolist(), S).to(device)
    err = (cache_attention(q, k, v, mask).float() - cache_attention_ref(q, k, v, mask).float()).abs().max()
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    if not err <= tol:
        raise AssertionError(f"cache attention differs from the reference by {err:.2e} (> {tol:.0e})")
    return float(err)


# the head shapes the GPU check times (query heads, K/V heads, head_dim)
BENCH_SHAPES = {"qwen2.5-1.5b": (12, 2, 128), "llama-2-7b": (32, 32, 128)}


def benchmark(tokens=(1, 9, 33), slots=(320, 2048, 8192), n_cached_of=lambda S: S // 2, shapes=BENCH_SHAPES,
              dtype=torch.bfloat16) -> list[dict]:
    """Kernel vs torch's attention under the same (T, S) mask, each recorded in a CUDA graph and replayed (median
    microseconds a call, as inside the compiled loops' graphs); the mask shows half the cache, the rest is unused
    tail (a chain step at T tokens). CUDA only."""
    rows = []
    for shape, (H, Hkv, hd) in shapes.items():
        for S in slots:
            for T in tokens:
                q = torch.randn(1, H, T, hd, device="cuda", dtype=dtype)
                k = torch.randn(1, Hkv, S, hd, device="cuda", dtype=dtype)
                v = torch.randn(1, Hkv, S, hd, device="cuda", dtype=dtype)
                n_cached = n_cached_of(S)
                mask = step_mask(n_cached, list(range(-1, T - 1)), S).cuda()
                err = float((cache_attention(q, k, v, mask).float() - cache_attention_ref(q, k, v, mask).float())
                            .abs().max())
                us = {name: 1e3 * triton.testing.do_bench_cudagraph(fn) for name, fn in
                      [("triton", lambda: cache_attention(q, k, v, mask)),
                       ("sdpa", lambda: cache_attention_ref(q, k, v, mask))]}
                kv_bytes = 2 * Hkv * (n_cached + T) * hd * q.element_size()
                rows.append({"shape": shape, "heads": f"{H}/{Hkv}x{hd}", "slots": S, "cached": n_cached,
                             "tokens": T, "max_abs_err": err, "triton_us": us["triton"], "sdpa_us": us["sdpa"],
                             "sdpa_over_triton": us["sdpa"] / us["triton"],
                             "triton_kv_GBps": kv_bytes / us["triton"] / 1e3})
    return rows


if __name__ == "__main__":
    import sys
    rows = benchmark() if "--bench" in sys.argv else [(dt, check(dtype=dt)) for dt in (torch.float32, torch.float16)]
    print(*rows, sep="\n")
