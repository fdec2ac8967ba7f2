"""Fused acceptance for a batch: B rows of K draft tokens each, on the GPU end to end.

The same two rules as labkit/acceptance.py, for B sequences at once and without a host sync
per position: greedy acceptance (longest prefix equal to the target's argmax, then the
target's token) and the rejection sampling of Leviathan et al. 2023 / Chen et al. 2023
(keep x_i while u_i * q_draft(x_i) < p_target(x_i); at the first rejection, the next token
comes from norm(max(0, p_target - q_draft)); after K acceptances from p_target[K]).
Given the same uniforms u, the result equals labkit.core.acceptance.speculative_accept row by row:
the kernel returns the distribution the next token is drawn from (`next_probs`), and
`sample_next` draws it with torch.multinomial exactly as labkit does. Greedy runs the argmax of
all B x (K+1) positions in parallel, then one tiny program a row finds the first mismatch;
sampled runs one program a row.

Triton tutorial order: kernels, wrappers, torch references, check, benchmark.

    TRITON_INTERPRET=1 python -m labkit.kernels.acceptance     # check on CPU (interpreter)
"""
from __future__ import annotations

import torch

from labkit.core.acceptance import Acceptance

try:
    import triton
    import triton.language as tl
except ImportError:  # labkit works without Triton: kernels/__init__.py dispatches to the reference
    triton = None


if triton is not None:

    @triton.jit
    def _argmax_kernel(Logits, Argmax, V, stride_lb, stride_lk,
                       BLOCK_V: tl.constexpr):     # vocabulary entries per step
        """Argmax over V of logits[b, i], one program per (row b, position i): all positions at once."""
        b, i = tl.program_id(0), tl.program_id(1)
        offs = tl.arange(0, BLOCK_V)
        best = -float("inf")
        best_idx = 0
        for start in range(0, V, BLOCK_V):           # first index on ties, as torch.argmax
            cols = start + offs
            x = tl.load(Logits + b * stride_lb + i * stride_lk + cols, mask=cols < V,
                        other=-float("inf")).to(tl.float32)
            blk_max = tl.max(x, 0)
            blk_idx = tl.argmax(x, 0) + start
            take = blk_max > best
            best_idx = tl.where(take, blk_idx, best_idx)
            best = tl.where(take, blk_max, best)
        tl.store(Argmax + b * tl.num_programs(1) + i, best_idx)

    @triton.jit
    def _greedy_accept_kernel(Draft, Argmax, NAccepted, NextToken, K, stride_db,
                              BLOCK_K: tl.constexpr):  # K+1 rounded up to a power of two
        """Per row: n = the first position where the draft differs from the target's argmax; next = that argmax."""
        b = tl.program_id(0)
        offs = tl.arange(0, BLOCK_K)
        target = tl.load(Argmax + b * (K + 1) + offs, mask=offs <= K, other=-1)        # (BLOCK_K,)
        draft = tl.load(Draft + b * stride_db + offs, mask=offs < K, other=-2)         # -2 at i >= K: no match
        mismatch = (target != draft) & (offs <= K)                                     # position K always
        n = tl.min(tl.where(mismatch, offs, BLOCK_K), 0)
        tl.store(NAccepted + b, n.to(tl.int64))
        tl.store(NextToken + b, tl.sum(tl.where(offs == n, target, 0), 0))

    @triton.jit
    def _sampled_accept_kernel(Draft, Q, P, U, NAccepted, NextProbs, K, V,
                               stride_db, stride_qb, stride_qk, stride_pb, stride_pk, stride_ub, stride_ob,
                               BLOCK_V: tl.constexpr):  # vocabulary entries per step of the residual
        b = tl.program_id(0)
        offs = tl.arange(0, BLOCK_V)
        # 1. accept x_i while u_i * q(x_i) < p(x_i): u < p/q without dividing by 0
        n = 0
        alive = 1
        for i in range(K):
            x = tl.load(Draft + b * stride_db + i)
            p_x = tl.load(P + b * stride_pb + i * stride_pk + x).to(tl.float32)
            q_x = tl.load(Q + b * stride_qb + i * stride_qk + x).to(tl.float32)
            u = tl.load(U + b * stride_ub + i).to(tl.float32)
            ok = (u * q_x < p_x).to(tl.int32)
            n += alive * ok
            alive = alive * ok
        # 2. the next token's distribution: residual at row n, or p_target[K] (bonus) unnormalised
        bonus = n == K
        p_row = P + b * stride_pb + n * stride_pk
        q_row = Q + b * stride_qb + n * stride_qk
        res_sum = 0.0
        p_sum = 0.0
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            p = tl.load(p_row + cols, mask=cols < V, other=0.0).to(tl.float32)
            q = tl.load(q_row + cols, mask=(cols < V) & (n < K), other=0.0).to(tl.float32)
            res_sum += tl.sum(tl.maximum(p - q, 0.0), 0)
            p_sum += tl.sum(p, 0)
        use_p = bonus | (res_sum <= 0.0)             # p == q up to rounding: the residual is p itself
        denom = tl.where(bonus, 1.0, tl.where(res_sum <= 0.0, p_sum, res_sum))
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            p = tl.load(p_row + cols, mask=cols < V, other=0.0).to(tl.float32)
            q = tl.load(q_row + cols, mask=(cols < V) & (n < K), other=0.0).to(tl.float32)
            out = tl.where(use_p, p, tl.maximum(p - q, 0.0)) / denom
            tl.store(NextProbs + b * stride_ob + cols, out, mask=cols < V)
        tl.store(NAccepted + b, n)


def check_batch(draft_tokens: torch.Tensor, target: torch.Tensor, q_draft: torch.Tensor | None = None,
                uniforms: torch.Tensor | None = None) -> None:
    if draft_tokens.dim() != 2 or target.dim() != 3 or target.shape[:2] != (draft_tokens.shape[0],
                                                                             draft_tokens.shape[1] + 1):
        raise ValueError(f"need draft_tokens (B, K) and target (B, K+1, V); got {tuple(draft_tokens.shape)} and "
                         f"{tuple(target.shape)}")
    if q_draft is not None and q_draft.shape != (draft_tokens.shape[0], draft_tokens.shape[1], target.shape[2]):
        raise ValueError(f"q_draft must be (B, K, V) = {(*draft_tokens.shape, target.shape[2])}, "
                         f"got {tuple(q_draft.shape)}")
    if uniforms is not None and uniforms.shape != draft_tokens.shape:
        raise ValueError(f"uniforms must be (B, K) like draft_tokens, got {tuple(uniforms.shape)}")


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor, block_v: int = 1024) -> Acceptance:
    """Triton greedy acceptance. draft_tokens: (B, K); target_logits: (B, K+1, V)."""
    check_batch(draft_tokens, target_logits)
    B, K1, V = target_logits.shape
    draft_tokens, target_logits = draft_tokens.long().contiguous(), target_logits.contiguous()
    argmax = torch.empty(B, K1, dtype=torch.int64, device=draft_tokens.device)         # (B, K+1)
    n = torch.empty(B, dtype=torch.int64, device=draft_tokens.device)
    nxt = torch.empty(B, dtype=torch.int64, device=draft_tokens.device)
    _argmax_kernel[(B, K1)](target_logits, argmax, V, target_logits.stride(0), target_logits.stride(1),
                            BLOCK_V=min(block_v, triton.next_power_of_2(V)))
    _greedy_accept_kernel[(B,)](draft_tokens, argmax, n, nxt, K1 - 1, draft_tokens.stride(0),
                                BLOCK_K=triton.next_power_of_2(K1))
    return Acceptance(n, nxt, n == K1 - 1)


def sampled_accept(draft_tokens: torch.Tensor, q_draft: torch.Tensor, p_target: torch.Tensor,
                   uniforms: torch.Tensor, block_v: int = 1024) -> Acceptance:
    """Triton rejection-sampling acceptance. draft (B, K), q_draft (B, K, V), p_target (B, K+1, V), u (B, K)."""
    check_batch(draft_tokens, p_target, q_draft, uniforms)
    B, K1, V = p_target.shape
    draft_tokens = draft_tokens.long().contiguous()
    q_draft, p_target, uniforms = q_draft.contiguous(), p_target.contiguous(), uniforms.contiguous()
    n = torch.empty(B, dtype=torch.int64, device=draft_tokens.device)
    next_probs = torch.empty(B, V, dtype=torch.float32, device=draft_tokens.device)
    _sampled_accept_kernel[(B,)](draft_tokens, q_draft, p_target, uniforms, n, next_probs, K1 - 1, V,
                                 draft_tokens.stride(0), q_draft.stride(0), q_draft.stride(1),
                                 p_target.stride(0), p_target.stride(1), uniforms.stride(0), next_probs.stride(0),
                                 BLOCK_V=min(block_v, triton.next_power_of_2(V)))
    return Acceptance(n, None, n == K1 - 1, next_probs)


def greedy_accept_ref(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Acceptance:
    """The torch reference of greedy_accept (labkit.core.acceptance.greedy_accept for B rows)."""
    check_batch(draft_tokens, target_logits)
    K = draft_tokens.shape[1]
    target_tokens = target_logits.argmax(-1)                                             # (B, K+1)
    matches = (target_tokens[:, :K] == draft_tokens).long()                             # (B, K)
    n = matches.cumprod(1).sum(1)                                                        # (B,)
    return Acceptance(n, target_tokens.gather(1, n[:, None])[:, 0], n == K)


def sampled_accept_ref(draft_tokens: torch.Tensor, q_draft: torch.Tensor, p_target: torch.Tensor,
                       uniforms: torch.Tensor) -> Acceptance:
    """The torch reference of sampled_accept (labkit.core.acceptance.speculative_accept for B rows, u given)."""
    check_batch(draft_tokens, p_target, q_draft, uniforms)
    B, K = draft_tokens.shape
    p_x = p_target[:, :K].float().gather(2, draft_tokens[..., None])[..., 0]             # (B, K)
    q_x = q_draft.float().gather(2, draft_tokens[..., None])[..., 0]                      # (B, K)
    n = (uniforms.float() * q_x < p_x).long().cumprod(1).sum(1)                          # (B,)
    rows = torch.arange(B, device=n.device)
    p_n = p_target[rows, n].float()                                                      # (B, V)
    q_n = torch.cat([q_draft, q_draft.new_zeros(B, 1, q_draft.shape[2])], 1)[rows, n].float()  # (B, V), 0 at K
    residual = (p_n - q_n).clamp(min=0)                                                  # (B, V)
    res_sum = residual.sum(-1, keepdim=True)                                             # (B, 1)
    use_p = (res_sum <= 0)                                                               # p == q up to rounding
    residual = torch.where(use_p, p_n, residual) / torch.where(use_p, p_n.sum(-1, keepdim=True), res_sum)
    bonus = n == K                                                                       # (B,)
    return Acceptance(n, None, bonus, torch.where(bonus[:, None], p_n, residual))


def sample_next(acc: Acceptance, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw each row's next token (B,) from next_probs, row by row as labkit.core.sampling.sample does."""
    return torch.stack([torch.multinomial(row.cpu(), 1, generator=generator)[0] for row in acc.next_probs])


def check(B=5, K=6, V=300, dtype=torch.float32, device="cpu", seed=0) -> None:
    """Kernels against the references on random inputs with planted agreement; raises on a mismatch."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g).to(device, dtype)
    draft = logits[:, :K].argmax(-1)                                                     # all accepted ...
    draft[1, 2] = (draft[1, 2] + 1) % V                                                  # ... but row 1 at 2
    draft[2, 0] = (draft[2, 0] + 1) % V                                                  # and row 2 at 0
    got, want = greedy_accept(draft, logits), greedy_accept_ref(draft, logits)
    for field in ("n_accepted", "next_token", "bonus"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field))
    p_target = torch.rand(B, K + 1, V, generator=g).pow(4).to(device)
    p_target = (p_target / p_target.sum(-1, keepdim=True)).to(dtype)
    q_draft = torch.rand(B, K, V, generator=g).pow(4).to(device)
    q_draft = (q_draft / q_draft.sum(-1, keepdim=True)).to(dtype)
    u = torch.rand(B, K, generator=g).to(device)
    got, want = sampled_accept(draft, q_draft, p_target, u), sampled_accept_ref(draft, q_draft, p_target, u)
    torch.testing.assert_close(got.n_accepted, want.n_accepted)
    torch.testing.assert_close(got.next_probs, want.next_probs, rtol=1e-5, atol=1e-6)


def benchmark(batch_sizes=(1, 4, 16, 64), K=8, V=151_936) -> list[dict]:
    """Fused kernels vs the torch references (median ms, CUDA only), Qwen2.5's vocabulary."""
    rows = []
    for B in batch_sizes:
        logits = torch.randn(B, K + 1, V, device="cuda")
        draft = logits[:, :K].argmax(-1)
        p = logits.softmax(-1)
        q = torch.randn(B, K, V, device="cuda").softmax(-1)
        u = torch.rand(B, K, device="cuda")
        rows.append({"batch": B, "K": K, "V": V,
                     "greedy_triton_ms": triton.testing.do_bench(lambda: greedy_accept(draft, logits)),
                     "greedy_torch_ms": triton.testing.do_bench(lambda: greedy_accept_ref(draft, logits)),
                     "sampled_triton_ms": triton.testing.do_bench(lambda: sampled_accept(draft, q, p, u)),
                     "sampled_torch_ms": triton.testing.do_bench(lambda: sampled_accept_ref(draft, q, p, u))})
    return rows


if __name__ == "__main__":
    import sys
    rows = benchmark() if "--bench" in sys.argv else [check(dtype=dt) or f"{dt}: kernels match the references"
                                                      for dt in (torch.float32, torch.float16)]
    print(*rows, sep="\n")
