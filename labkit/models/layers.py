"""The reference building blocks of labkit's Transformer: RMSNorm, RoPE, SwiGLU and attention.

Each is a module so that a forward path (backends.py) can swap in a fused kernel for it; the
math they compute is in core/ops.py, which the kernels are tested against.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.ops import apply_rope, rms_norm, rope_cos_sin, swiglu  # noqa: F401  (re-exported)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Rotary(nn.Module):
    """RoPE on the queries and keys (a module so that a forward path can swap in a fused kernel)."""

    def forward(self, q, k, cos, sin):
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class SwiGLU(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return swiglu(gate_up)


class SDPAttention(nn.Module):
    """The reference attention: torch's scaled_dot_product_attention, K/V heads shared by query groups."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)       # (B, H, T, hd)
