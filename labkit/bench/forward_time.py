"""How long one forward of (batch, tokens) takes on a GPU, without Python or launch overheads.

The cost side of the roofline and batch-cost scripts: `static_forward` (labkit.decoding.static)
captured as a CUDA graph, optionally compiled with dynamic shapes, replayed and timed with CUDA
events. CPU timings go through labkit.models.calibrate instead.
"""
from __future__ import annotations

import torch

from ..decoding.static import static_forward
from ..models.cuda_graph import capture_graph
from ..models.kv_cache import StaticKVCache
from ..models.transformer import Transformer

_compiled: dict[str, object] = {}


def compiled_static_forward():
    """`static_forward` compiled once with dynamic shapes: one graph for every batch, token count and cache size."""
    if "fn" not in _compiled:
        # one graph per model and per size class (dynamo specialises sizes 1 and >1): allow a few models' worth
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
        _compiled["fn"] = torch.compile(static_forward, dynamic=True, fullgraph=True)
    return _compiled["fn"]


@torch.no_grad()
def time_forward(model: Transformer, batch: int, tokens: int, context: int, compile: bool = False,
                 repeats: int = 20) -> float:
    """CUDA: median seconds of one forward of (batch, tokens) after `context` cached slots, replayed as a CUDA graph.

    What the device takes for the forward, without Python or per-kernel launch costs (compile=True
    also fuses the small ops, as a tuned server does). The cache's content does not change the
    cost, so it is left as zeros; each replay rewrites the same slots.
    """
    if model.device.type != "cuda":
        raise ValueError("time_forward replays CUDA graphs: put the model on a CUDA device")
    a, p = model.args, model.embed_tokens.weight
    cache = StaticKVCache(a.n_layers, batch, a.n_kv_heads, context + tokens, a.head_dim, p.dtype, p.device)
    cache.slots = torch.arange(context, context + tokens, device=p.device)           # (T,)
    feed = torch.randint(0, model.vocab_size, (batch, tokens), device=p.device)      # (B, T)
    forward = compiled_static_forward() if compile else static_forward
    graph, _ = capture_graph(lambda: forward(model, cache, feed))
    runs = []
    for _ in range(repeats + 1):                                                     # the first replay warms up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) / 1e3)
    return sorted(runs[1:])[len(runs[1:]) // 2]
