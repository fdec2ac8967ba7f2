"""The reference building blocks of labkit's Transformer: RMSNorm, RoPE, SwiGLU and attention.

Each is a module so that a forward path (backends.py) can swap in a fused kernel for it; the
functions beside them are the math the kernels are tested against.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim, normalised in fp32 as transformers does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin of shape (B, 1, T, hd) for integer positions (B, T)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    angles = positions.float()[..., None] * inv_freq                # (B, T, hd/2)
    angles = torch.cat([angles, angles], dim=-1)[:, None]           # (B, 1, T, hd)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, hd) by position; the half-split layout of transformers' checkpoints."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Rotary(nn.Module):
    """RoPE on the queries and keys (a module so that a forward path can swap in a fused kernel)."""

    def forward(self, q, k, cos, sin):
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of a fused (..., 2F) gate-up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return swiglu(gate_up)


class SDPAttention(nn.Module):
    """The reference attention: torch's scaled_dot_product_attention, K/V heads shared by query groups."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)       # (B, H, T, hd)
