"""The hardware view: the cost model against counted FLOPs and parameters, the roofline's
arithmetic, and the CPU fallback (no NVML here: one warning, measured numbers, no GPU numbers)."""
import sys
import warnings

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from labkit import SpeculativeDecoder
from labkit.drafters import DraftModelDrafter
from labkit.hw import (
    Roofline,
    Sampler,
    decode_cost,
    describe,
    forward_cost,
    linear_params,
    per_step,
    predicted_speedup,
    run_with_telemetry,
    tree_cost,
    verify_cost,
)
from labkit.hw import device as device_mod
from labkit.kernels.tree_attention import ancestor_mask, tree_attention_ref
from labkit.models.transformer import ModelArgs, count_params

QWEN_15B = ModelArgs(vocab_size=151936, dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, hidden_dim=8960,
                     qkv_bias=True, tie_embeddings=True)


def test_linear_params_are_the_models_weights_less_norms_and_biases(tiny_target):
    small = sum(p.numel() for n, p in tiny_target.named_parameters() if p.dim() == 1)   # norms and biases
    assert linear_params(tiny_target.args) == count_params(tiny_target) - small


@pytest.mark.parametrize("tokens,context", [(1, 0), (1, 9), (5, 7), (16, 3)])
def test_forward_flops_equal_torch_flop_counter(tiny_target, tokens, context):
    """Linears counted on the model's forward; attention counted on the explicit reference (the CPU's
    fused SDPA kernel is invisible to the flop counter), once per layer."""
    args = tiny_target.args
    cache = tiny_target.new_cache(max_len=64)
    if context:
        tiny_target(torch.arange(context)[None], cache)
    with FlopCounterMode(display=False) as linears:
        tiny_target(torch.arange(tokens)[None] + 3, cache)
    q = torch.zeros(1, args.n_heads, tokens, args.head_dim)
    kv = torch.zeros(1, args.n_kv_heads, context + tokens, args.head_dim)
    chain = torch.arange(tokens) - 1
    mask = ancestor_mask(chain)                          # built once per tree, outside the layers' count
    with FlopCounterMode(display=False) as attention:
        tree_attention_ref(q, kv, kv, chain, context, mask=mask)
    counted = linears.get_total_flops() + args.n_layers * attention.get_total_flops()
    assert forward_cost(args, tokens, context).flops == counted


def test_batch_multiplies_flops_and_kv_but_not_weights():
    one, many = decode_cost(QWEN_15B, 512), decode_cost(QWEN_15B, 512, batch=16)
    assert many.flops == 16 * one.flops and many.kv_read_bytes == 16 * one.kv_read_bytes
    assert many.weight_bytes - one.weight_bytes == 15 * QWEN_15B.dim * 2     # just the embedding rows
    assert verify_cost(QWEN_15B, 4, 512) == forward_cost(QWEN_15B, 5, 512) == tree_cost(QWEN_15B, 5, 512)
    assert 3.0e9 < one.weight_bytes < 3.2e9                                   # 1.54B params in bf16


def test_roofline_decode_is_memory_bound_and_verify_nearly_free():
    roof = Roofline(bandwidth=3.35e12, peak_flops=989e12)                    # H100 SXM datasheet numbers
    decode, verify8 = decode_cost(QWEN_15B, 1024), verify_cost(QWEN_15B, 7, 1024)
    assert roof.bound(decode) == "memory" and decode.intensity < 2
    assert roof.time(verify8) / roof.time(decode) < 1.05                      # 8 tokens for the price of 1
    n = roof.crossover_tokens(QWEN_15B, 1024)
    assert roof.bound(forward_cost(QWEN_15B, n, 1024)) == "compute"
    assert roof.bound(forward_cost(QWEN_15B, n - 1, 1024)) == "memory"
    assert 100 < n < 600                                                      # ~ridge 295 FLOP/B over 2 FLOP/param/B


def test_predicted_speedup_fades_with_batch():
    roof = Roofline(bandwidth=3.35e12, peak_flops=989e12)
    draft = ModelArgs(**{**QWEN_15B.__dict__, "dim": 896, "n_layers": 24, "n_heads": 14, "hidden_dim": 4864,
                         "head_dim": 64})
    speedups = [predicted_speedup(roof, QWEN_15B, draft, b, gamma=4, alpha=0.8, context=512) for b in (1, 16, 256)]
    assert speedups[0] > 1.3 and speedups[0] > speedups[1] > speedups[2] and speedups[2] < 1


def test_bad_cost_requests_are_refused():
    with pytest.raises(ValueError, match="tokens >= 1"):
        forward_cost(QWEN_15B, 0, 10)


def nvml_failure() -> str | None:
    """Why NVML cannot start on this machine (the exception's type name), or None where it can."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception as e:  # no pynvml, or no driver: NVMLError_LibraryNotFound on this CPU box
        return type(e).__name__
    return None


def nvml_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "NVML" in str(w.message)]


def test_cpu_profile_is_measured_and_says_once_there_is_no_nvml(monkeypatch):
    """Without NVML: exactly one warning, naming the reason, however often the profile is asked for (a fresh
    process's first ask warns: the module's once-flag is reset). With NVML: no warning at all."""
    monkeypatch.setattr(device_mod, "_nvml_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile = describe("cpu", quick=True)
        describe("cpu", quick=True)
        device_mod.nvml_handle()
    said = nvml_warnings(caught)
    reason = nvml_failure()
    if reason is None:
        assert said == [], "NVML works here: nothing to warn about"
    else:
        assert len(said) == 1, f"the missing NVML ({reason}) should be said exactly once, got {said}"
        assert reason in said[0] and "no GPU telemetry" in said[0]
    assert profile.kind == "cpu" and profile.bandwidth.value > 1e8 and profile.peak_flops.value > 1e8
    assert profile.bandwidth.source.startswith("measured") and profile.peak_flops.source.startswith("measured")
    assert "logical cores" in profile.facts and "peak bandwidth" not in profile.facts   # no invented GPU facts


def test_missing_nvml_is_said_exactly_once_on_any_machine(monkeypatch):
    """pynvml made unimportable (as on a laptop without it): the first handle request warns, later ones don't."""
    monkeypatch.setattr(device_mod, "_nvml_warned", False)
    monkeypatch.setitem(sys.modules, "pynvml", None)                 # import pynvml -> ImportError
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handles = [device_mod.nvml_handle() for _ in range(3)] + [Sampler(interval=0.01).handle]
    assert handles == [None] * 4
    said = [w for w in caught if "NVML" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in said]
    assert said[0].category is RuntimeWarning and "ModuleNotFoundError" in str(said[0].message)


def test_sampler_on_the_host_lines_up_with_decoder_steps(tiny_target, tiny_draft):
    dec = SpeculativeDecoder(tiny_target, DraftModelDrafter(tiny_draft), torch.tensor([5, 17, 33]), 12, gamma=3)
    rows, sampler = run_with_telemetry(dec, interval=0.001)
    assert len(rows) == len(dec.trace.steps) and sampler.samples
    assert all(r["start"] <= r["end"] for r in rows)
    if sampler.handle is None:
        assert sampler.source.startswith("host") and all(s.dram_bw_util is None for s in sampler.samples)
        assert all(s.memory_used > 0 for s in sampler.samples)
    whole = per_step(sampler.samples, [(sampler.samples[0].t, sampler.samples[-1].t)])
    assert whole[0]["n_samples"] == len(sampler.samples)


def test_sampler_refuses_a_bad_interval():
    with pytest.raises(ValueError, match="interval"):
        Sampler(interval=0)
