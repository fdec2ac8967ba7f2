"""How close does decoding get to the memory wall? Eager vs CUDA graph vs torch.compile (+ tuning) + CUDA graph.

For each model shape, greedy decoding of `--new-tokens` tokens after a random prompt, four ways,
one after the other in one process: labkit's eager loop (`autoregressive_generate`), the static
cache replayed as a CUDA graph, and the static cache compiled by inductor and replayed as a CUDA
graph (labkit/decoding/static.py), without and with gpt-fast's coordinate-descent tuning. Achieved bandwidth = bytes a step must move (`labkit.hw.decode_cost`: every
linear weight once, one embedding row, the KV slots attended and written) x steps/s, as a
fraction of the peak NVML reports (2 x max memory clock x bus width) and of a measured copy. An
NVML sampler records the DRAM bandwidth utilisation (GPM, Hopper) during each run as a cross-check.

Weights are random (this GPU box cannot download checkpoints): a step's time does not depend on
their values, and tokens are compared between the modes only to show they compute the same thing.

    python scripts/bench_decode.py                  # qwen2.5-1.5b and llama-2-7b shapes, bf16, CUDA
    python scripts/bench_decode.py --quick          # qwen2.5-1.5b only, 64 tokens: a smoke run
Writes data/bench/decode_cuda.{json,md,png}.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from labkit import autoregressive_generate
from labkit.bench.writer import markdown_table, subplots, write_outputs
from labkit.decoding.static import StaticDecoder
from labkit.hw import SHAPES, Sampler, decode_cost, describe, random_model
from labkit.hw.telemetry import per_step

ROOT = Path(__file__).resolve().parents[1]



def timed(fn, label: str):
    """Run fn for the timing, then again under the NVML sampler (its polling would slow a Python-bound
    eager loop); (first result, mean DRAM bandwidth utilisation % during the second, or None)."""
    out = fn()
    with Sampler(interval=0.1) as s:              # GPM needs ~100 ms between samples to say anything
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
    util = per_step(s.samples, [(t0, t1)])[0]["dram_bw_util"]
    if s.gpm_error:
        print(f"  {label}: {s.gpm_error}")
    return out, util


def bench_shape(name: str, prompt_len: int, new_tokens: int, peak_bw: float | None, copy_bw: float) -> dict:
    model = random_model(name)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.vocab_size, (prompt_len,), generator=g)
    max_len = prompt_len + new_tokens
    rows = []
    ref_tokens = None
    modes = [("labkit eager (autoregressive_generate)", None),
             ("static cache + CUDA graph", dict(compile=False, cuda_graph=True)),
             ("static cache + torch.compile + CUDA graph", dict(compile=True, cuda_graph=True)),
             # gpt-fast's inductor setting: each generated kernel's launch parameters tuned by timing them
             ("static cache + torch.compile (coordinate-descent tuned) + CUDA graph",
              dict(compile=True, cuda_graph=True, compile_options={"coordinate_descent_tuning": True}))]
    for label, opts in tqdm(modes, desc=name):
        if opts is None:
            autoregressive_generate(model, prompt, max_new_tokens=8)                     # warm-up
            torch.cuda.synchronize()
            gen, util = timed(partial(autoregressive_generate, model, prompt, max_new_tokens=new_tokens), label)
            context = prompt_len + new_tokens // 2
        else:
            dec = StaticDecoder(model, max_len=max_len, **opts)
            dec.warmup()
            gen, util = timed(partial(dec.generate, prompt, new_tokens), label)
            context = max_len - 1                                                         # attends every slot
        # the first token comes from the prefill; each later one costs one step
        tokens, tok_s = gen.tokens, (len(gen.tokens) - 1) / sum(s.verify_time for s in gen.trace.steps[1:])
        ref_tokens = ref_tokens or tokens
        agree = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
        nbytes = decode_cost(model.args, context).bytes        # weights, one embedding row, the KV read and written
        rows.append({"mode": label, "tokens_per_s": tok_s, "ms_per_token": 1e3 / tok_s, "bytes_per_step": nbytes,
                     "achieved_bandwidth": nbytes * tok_s,
                     "fraction_of_peak": nbytes * tok_s / peak_bw if peak_bw else None,
                     "fraction_of_copy": nbytes * tok_s / copy_bw, "nvml_dram_bw_util_pct": util,
                     "tokens_equal_to_eager": agree})
    del model
    torch.cuda.empty_cache()
    return {"shape": name, "model_args": asdict(SHAPES[name]), "prompt_len": prompt_len, "new_tokens": new_tokens,
            "rows": rows}


def markdown(result: dict) -> str:
    d = result["device"]
    lines = [f"# Greedy decode on {d['name']} ({result['date']})", "",
             f"bf16, random weights of each shape, batch 1, {result['torch']}. Peak bandwidth: "
             f"{d['peak_bandwidth_source']}; measured copy: {d['copy_bandwidth'] / 1e12:.2f} TB/s.", ""]
    rows = [{"shape": s["shape"], "new_tokens": s["new_tokens"], **r} for s in result["shapes"] for r in s["rows"]]
    lines += markdown_table(rows, {
        "model": "{shape}", "mode": "{mode}", "tokens/s": "{tokens_per_s:.0f}", "ms/token": "{ms_per_token:.2f}",
        "achieved GB/s": lambda r: f"{r['achieved_bandwidth'] / 1e9:.0f}",
        "% of peak": lambda r: f"{100 * r['fraction_of_peak']:.0f}" if r["fraction_of_peak"] else "n/a",
        "% of copy": lambda r: f"{100 * r['fraction_of_copy']:.0f}",
        "NVML DRAM util %": lambda r: (f"{r['nvml_dram_bw_util_pct']:.0f}" if r["nvml_dram_bw_util_pct"] is not None
                                       else "n/a"),
        "tokens = eager": "{tokens_equal_to_eager}/{new_tokens}"})
    lines += ["", "Bytes per step (labkit.hw.decode_cost): every linear weight once, one embedding row, the KV "
              "slots attended (the static cache attends all of its slots under a mask). 'tokens = eager': "
              "leading tokens equal to the eager run's (random weights give near-flat logits, so bf16 "
              "rounding differences between kernels may flip a later argmax)."]
    return "\n".join(lines) + "\n"


def plot(result: dict):
    shapes = result["shapes"]
    fig, axes = subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4), squeeze=False)
    for ax, s in zip(axes[0], shapes):
        labels = [r["mode"].replace(" + ", "\n+ ").replace(" (", "\n(") for r in s["rows"]]
        vals = [r["achieved_bandwidth"] / 1e12 for r in s["rows"]]
        bars = ax.bar(range(len(vals)), vals, color=["C7", "C1", "C2", "C3"][:len(vals)])
        for b, r in zip(bars, s["rows"]):
            ax.annotate(f"{r['tokens_per_s']:.0f} tok/s", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=8)
        if result["device"]["peak_bandwidth"]:
            ax.axhline(result["device"]["peak_bandwidth"] / 1e12, color="k", ls="--", label="peak (NVML)")
        ax.axhline(result["device"]["copy_bandwidth"] / 1e12, color="gray", ls=":", label="measured copy")
        ax.set_xticks(range(len(vals)), labels, fontsize=7)
        ax.set(ylabel="achieved bandwidth (TB/s)", title=f"{s['shape']} shape, bf16, batch 1")
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"decode vs the memory wall on {result['device']['name']}")
    fig.tight_layout()
    return fig


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen2.5-1.5b,llama-2-7b", help=f"comma-separated, of {list(SHAPES)}")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="qwen2.5-1.5b only, 64 new tokens")
    ap.add_argument("--out", default=str(ROOT / "data" / "bench"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode.py measures a GPU (CUDA graphs); on CPU see scripts/roofline.py and "
                         "tests/test_static_decode.py")
    shapes = ["qwen2.5-1.5b"] if args.quick else args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shape(s) {unknown}; choose from {list(SHAPES)}")
    new_tokens = 64 if args.quick else args.new_tokens
    profile = describe("cuda")
    peak = profile.facts.get("peak bandwidth")
    peak_bw = peak.value if hasattr(peak, "value") else None
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": f"torch {torch.__version__}",
              "device": {"name": profile.name, "peak_bandwidth": peak_bw,
                         "peak_bandwidth_source": peak.source if hasattr(peak, "source") else str(peak),
                         "copy_bandwidth": profile.bandwidth.value, "copy_source": profile.bandwidth.source,
                         "matmul_flops": profile.peak_flops.value, "matmul_source": profile.peak_flops.source},
              "shapes": [bench_shape(s, args.prompt_len, new_tokens, peak_bw, profile.bandwidth.value) for s in shapes]}
    write_outputs(Path(args.out) / "decode_cuda", result, markdown, plot)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
