"""Optional Triton kernels, each next to a torch reference (tree attention, fused acceptance).

labkit imports and works without Triton. The functions below pick the Triton kernel when
Triton is installed and the inputs live on a CUDA device, and the torch reference otherwise.
The kernels themselves (kernels.tree_attention.tree_attention, kernels.acceptance.*) also run
on CPU tensors under `TRITON_INTERPRET=1` set before Triton is first imported, slowly: that is
how the tests check them on a machine without a GPU.
"""
from __future__ import annotations

import torch

from ..core.acceptance import Acceptance
from . import acceptance as _acceptance
from . import tree_attention as _tree
from .acceptance import sample_next
from .tree_attention import ancestor_mask, random_tree, tree_mask

HAVE_TRITON = _tree.triton is not None


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


__all__ = ["HAVE_TRITON", "use_triton", "attend_tree", "greedy_accept", "sampled_accept", "sample_next",
           "ancestor_mask", "tree_mask", "random_tree"]
