"""The math of the Transformer's building blocks, as plain functions: RMSNorm, RoPE and SwiGLU.

labkit's model wraps each in a module (models/layers.py) so that a forward path can swap in a fused kernel; the
kernels (kernels/cpu) are tested against these functions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim, normalised in fp32 as transformers does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


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


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of a fused (..., 2F) gate-up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
