"""A preallocated, position-indexed KV cache with rollback as a named method.

Slot `s` of every layer holds the key/value of the `s`-th token fed to the model. Speculative
decoding appends draft tokens, then `truncate(length)` drops the rejected ones (the
`cache.crop` of transformers, without reallocating). Follows gpt-fast's `KVCache`, but the cache
is an explicit argument of `forward` instead of state hung on the model.

`StaticKVCache` is the compiled decode path's variant (decoding/static.py): it writes at the slots in a
tensor and reads all of them under a mask, so every step has the same shapes; `LayerSlots` is one layer of
it, what a compiled block sees.
"""
from __future__ import annotations

import torch


class KVCache:
    """Keys and values of all layers: (L, B, Hkv, S, hd) each, valid in slots [0, length).

    Nothing reads a slot before it is written, so the buffers are left unset: zeroing a whole context's slots
    (112 MiB for the 1.5B target) would cost each request a pass over memory, for slots most requests never
    reach (data/bench/draft_opening_amd-epyc-avx2/request_setup.md). StaticKVCache, whose attention reads every slot
    under a mask, zeroes them."""

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (n_layers, batch_size, n_kv_heads, max_len, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # (L, B, Hkv, S, hd)
        self.v = torch.empty(shape, dtype=dtype, device=device)  # (L, B, Hkv, S, hd)
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
        n = nodes.numel()
        if nodes.device.type == "cpu" and torch.equal(nodes, torch.arange(n)):    # already in place: a plain step,
            self.length = start + n                                                # a chain's accepted prefix
            return
        src = start + nodes.to(self.k.device)                       # (n,)
        self.k[:, :, :, start:start + n] = self.k.index_select(3, src)
        self.v[:, :, :, start:start + n] = self.v.index_select(3, src)
        self.length = start + n

    def room(self) -> int:
        """How many more tokens fit."""
        return self.max_len - self.length


class StaticKVCache(KVCache):
    """A KVCache whose writes go to the slots in the tensor `slots` and whose reads return all slots.

    `slots` (T,) holds the slot (= position) of each token of the next forward. The attention
    sees every one of the `max_len` slots; the mask (slot <= position) hides the stale ones.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.k.zero_()                                       # read under the mask: a stale slot must be finite
        self.v.zero_()
        self.slots = torch.zeros(1, dtype=torch.long, device=self.k.device)    # (T,)

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Store (B, Hkv, T, hd) at `slots`; return the whole buffers (B, Hkv, max_len, hd)."""
        return LayerSlots(self.k[layer], self.v[layer], self.slots).write(0, k_new, v_new)


class LayerSlots:
    """One layer of a StaticKVCache, as the attention sees it: `write` stores at `slots` and returns the layer's
    whole buffers. What a compiled block reads, so that every layer passes it the same kind of input."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
        self.k, self.v, self.slots = k, v, slots            # (B, Hkv, max_len, hd) x 2, (T,)

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        self.k.index_copy_(2, self.slots, k_new)
        self.v.index_copy_(2, self.slots, v_new)
        return self.k, self.v
