"""Optional kernels, each next to its torch reference: Triton for GPUs here (tree attention, attention over a static
cache, fused acceptance), labkit's C++ for CPUs in kernels/cpu/ (packed bf16, int8 and int4 linears, attention,
pointwise).

One convention for every kernel: `op` and `op_ref` side by side, `available()` -> (bool, why) for the family,
and a test that ties each op to its reference (tests/test_kernels.py, tests/test_cpu_kernels.py). Dispatch is
in one place per family: here for the Triton ops, in labkit.models.backends for the CPU ones (the forward
path a model runs on) and for the attention a model's layers run (`use_attention`: torch's, or the Triton one over
a static cache, kernels/cache_attention.py).

labkit imports and works without Triton. The functions below pick the Triton kernel when
Triton is installed and the inputs live on a CUDA device, and the torch reference otherwise.
The kernels themselves (kernels.tree_attention.tree_attention, kernels.acceptance.*) also run
on CPU tensors under `TRITON_INTERPRET=1` set before Triton is first imported, slowly: that is
how the tests check them on a machine without a GPU.
"""
from __future__ import annotations

import torch

from labkit.core.acceptance import Acceptance

from . import acceptance as _acceptance
from . import tree_attention as _tree
from .acceptance import sample_next
from .tree_attention import ancestor_mask, random_tree, tree_mask

HAVE_TRITON = _tree.triton is not None


def available() -> tuple[bool, str]:
    """(True, the GPU) when the Triton kernels run here, else (False, why not): the references run instead."""
    if not HAVE_TRITON:
        return False, "Triton is not installed (pip install triton, on a machine with a CUDA GPU)"
    if not torch.cuda.is_available():
        return False, "no CUDA device: the Triton kernels run on GPUs (TRITON_INTERPRET=1 runs them on a CPU, slowly)"
    return True, torch.cuda.get_device_name()


def use_triton(t: torch.Tensor) -> bool:
    """The kernels run for CUDA tensors with Triton installed; everything else takes the reference."""
    return HAVE_TRITON and t.is_cuda


def attend_tree(q, k, v, parents, prefix_len: int, mask=None) -> torch.Tensor:
    """q (B, H, N, hd) over k, v (B, Hkv, S, hd): prefix [0, P) plus each node's ancestors -> (B, H, N, hd).

    mask: ancestor_mask(parents), built once per tree for all layers (built per call when None)."""
    fn = _tree.tree_attention if use_triton(q) else _tree.tree_attention_ref
    return fn(q, k, v, parents, prefix_len, mask=mask)


def greedy_accept(draft_tokens, target_logits) -> Acceptance:
    """Greedy acceptance for B rows: draft (B, K), target logits (B, K+1, V)."""
    fn = _acceptance.greedy_accept if use_triton(target_logits) else _acceptance.greedy_accept_ref
    return fn(draft_tokens, target_logits)


def sampled_accept(draft_tokens, q_draft, p_target, uniforms) -> Acceptance:
    """Rejection-sampling acceptance for B rows: draft (B, K), q (B, K, V), p (B, K+1, V), u (B, K)."""
    fn = _acceptance.sampled_accept if use_triton(p_target) else _acceptance.sampled_accept_ref
    return fn(draft_tokens, q_draft, p_target, uniforms)


__all__ = ["HAVE_TRITON", "available", "use_triton", "attend_tree", "greedy_accept", "sampled_accept",
           "sample_next", "ancestor_mask", "tree_mask", "random_tree"]
