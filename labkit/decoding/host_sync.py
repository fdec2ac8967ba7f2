"""A compiled step's one host sync, read by name.

A compiled loop keeps a step's results on the device until it must decide on the host (what was accepted, the
tokens, the tree's shape), then reads them all at once: one concatenation on the device, one `.tolist()`, one
wait. `read_back` does that and hands each result back under its name, so no caller counts offsets.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch


def read_back(**parts: torch.Tensor) -> SimpleNamespace:
    """Each named tensor's values as a list (ints for an integer tensor, floats otherwise), read in one host sync.
    All of them on one device; every value passes through float64, exact for integers below 2**53."""
    flat = [t.reshape(-1) for t in parts.values()]
    integral = [not t.dtype.is_floating_point for t in flat]
    values = torch.cat([t.double() for t in flat]).tolist() if flat else []       # the one sync
    got, i = {}, 0
    for name, t, whole in zip(parts, flat, integral):
        chunk, i = values[i:i + t.numel()], i + t.numel()
        got[name] = [int(v) for v in chunk] if whole else chunk
    return SimpleNamespace(**got)
