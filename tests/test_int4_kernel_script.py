"""scripts/int4_kernel.py's pass from the cache: as many weights as the streamed pass, and its verdict follows it."""
import importlib.util
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "int4_kernel.py"
spec = importlib.util.spec_from_file_location("int4_kernel_script", SCRIPT)
int4_kernel = importlib.util.module_from_spec(spec)
spec.loader.exec_module(int4_kernel)


def test_the_pass_from_the_cache_multiplies_as_many_weights_as_the_streamed_one():
    weights = [(torch.zeros(1), torch.zeros(1), n, k) for n, k in int4_kernel.BLOCK] * 28
    cached = int4_kernel.in_cache_layers(weights)
    gate_up = weights[2]
    assert all(w is gate_up for w in cached)                       # one layer, small enough to stay in the cache
    total, n, k = sum(n * k for _, _, n, k in weights), *int4_kernel.BLOCK[2]
    assert abs(len(cached) * n * k - total) <= n * k / 2


def test_the_floor_sentence_follows_the_measured_ratio():
    facts = {"in_cache": {"layer_bytes": 16.4 * 2**20, "calls": 48, "last_level_cache": 32 * 2**20}}
    cached = {1: 0.0066, 8: 0.0233}
    fast_memory = int4_kernel.floor_sentences({"vector": {1: 0.0164, 8: 0.0288}, "cached": cached}, facts)
    assert "1.42 x the streamed pass of one row (16.4 ms)" in fast_memory and "more than 1.3" in fast_memory
    assert "2.39 ms of arithmetic" in fast_memory and "32 MiB last-level cache" in fast_memory
    slow_memory = int4_kernel.floor_sentences({"vector": {1: 0.0227, 8: 0.0297}, "cached": cached}, facts)
    assert "1.03 x" in slow_memory and "at most 1.3" in slow_memory and "more than" not in slow_memory
