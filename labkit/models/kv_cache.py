"""A preallocated, position-indexed KV cache with rollback as a named method.

Slot `s` of every layer holds the key/value of the `s`-th token fed to the model. Speculative
decoding appends draft tokens, then `truncate(length)` drops the rejected ones (the
`cache.crop` of transformers, without reallocating). Follows gpt-fast's `KVCache`, but the cache
is an explicit argument of `forward` instead of state hung on the model.
"""
from __future__ import annotations

import torch


class KVCache:
    """Keys and values of all layers: (L, B, Hkv, S, hd) each, valid in slots [0, length)."""

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (n_layers, batch_size, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, Hkv, S, hd)
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, Hkv, S, hd)
        self.length = 0
        self.max_len = max_len

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Store (B, Hkv, T, hd) at slots [length, length+T); return all valid (B, Hkv, length+T, hd)."""
        end = self.length + k_new.shape[2]
        self.k[layer, :, :, self.length:end] = k_new
        self.v[layer, :, :, self.length:end] = v_new
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n_tokens: int) -> None:
        """Mark `n_tokens` more slots as valid (after every layer has written them)."""
        self.length += n_tokens

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` tokens; the slots after it are overwritten later."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length

    def commit_path(self, nodes: torch.Tensor, start: int) -> None:
        """Keep tree nodes `nodes` (slots start+nodes, in order) right after slot `start`; drop the rest."""
        src = start + nodes.to(self.k.device)                       # (n,)
        n = src.numel()
        self.k[:, :, :, start:start + n] = self.k.index_select(3, src)
        self.v[:, :, :, start:start + n] = self.v.index_select(3, src)
        self.length = start + n

    def room(self) -> int:
        """How many more tokens fit."""
        return self.max_len - self.length
