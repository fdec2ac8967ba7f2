"""Regional compilation: one decoder block compiled once per input shape and run for every layer (and every model
of that shape), where compiling a whole forward would take n_layers times longer. The compiled decode loops
(labkit.decoding.static, compiled, compiled_tree) and the drafters that draft on the device (eagle_device) run
their blocks through it."""
from __future__ import annotations

import torch

from .kv_cache import LayerSlots, StaticKVCache


def block_step(block, x, cos, sin, k, v, slots, mask):
    """One decoder block over x (B, T, D), its keys and values stored in k, v (B, Hkv, max_len, hd) at `slots`.
    The unit of regional compilation: compiled once, it serves every layer (no layer index to specialise on)."""
    return block(x, cos, sin, LayerSlots(k, v, slots), 0, mask)


_COMPILED_BLOCKS: dict = {}


def compile_blocks(backend: str = "inductor", options: dict | None = None):
    """A `Transformer.blocks` run_block that runs each layer through one compiled `block_step`: one compile per
    input shape, shared by every layer (and every model of that shape). Compiling one block instead of the whole
    forward cuts the compile time about n_layers-fold; inside a CUDA graph the uncompiled glue (embedding, final
    norm, LM head) costs no launches."""
    key = (backend, repr(sorted((options or {}).items())))
    if key not in _COMPILED_BLOCKS:
        # one entry per input shape (widths x models): let dynamo keep them all (its default keeps 8)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        step = torch.compile(block_step, backend=backend, fullgraph=True, dynamic=False, options=options)

        def run_block(block, x, cos, sin, cache: StaticKVCache, layer: int, mask):
            return step(block, x, cos, sin, cache.k[layer], cache.v[layer], cache.slots, mask)
        _COMPILED_BLOCKS[key] = run_block
    return _COMPILED_BLOCKS[key]


COMPILE_MODES = (False, True, "blocks")
