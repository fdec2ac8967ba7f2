"""Recording a function once as a CUDA graph and replaying it: the decode loops' steps (labkit.decoding.static,
compiled, compiled_tree) and the drafters' own device work (Medusa's heads), each a fixed-shape function whose
inputs are buffers filled in place."""
from __future__ import annotations

import torch


def capture_graph(fn, warmups: int = 2):
    """Run `fn` `warmups` times on a side stream (compilation, autotuning, allocations), then record one
    call as a CUDA graph; (graph, fn's output tensors, which every replay refills in place)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
