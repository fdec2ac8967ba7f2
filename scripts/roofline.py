"""Time per target forward vs tokens verified (1..64), next to the roofline's prediction.

This is the "verify is nearly free" curve: while a forward is memory-bound, feeding k tokens
costs about what feeding one does, so drafting k and verifying them in one pass pays. Where
the curve bends up (the roofline's ridge) bounds the useful γ, and the batch size B.

    nice -n 10 python scripts/roofline.py                         # embedded 1.5B target, bf16, CPU
    nice -n 10 python scripts/roofline.py --threads 1 --cpu-time  # one core, CPU time: a shared machine
    python scripts/roofline.py --device cuda --random-init        # the same ModelArgs, random weights

On CUDA each forward is also captured as a CUDA graph and replayed, plain (`graph_s`) and
compiled by torch.compile (`measured_s`): the curve then shows the device, not the Python and
kernel-launch overhead of an eager forward (kept as `eager_s`).

--random-init builds the target's architecture with random weights (a GPU box that cannot
download the checkpoint): a forward's time does not depend on the weights' values.
Writes data/bench/roofline_<device>.{json,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from labkit.bench.forward_time import time_forward
from labkit.bench.writer import subplots, write_outputs
from labkit.hw import SHAPES, Roofline, describe, forward_cost
from labkit.hw.device import add_timing_args, timing_clock
from labkit.models.calibrate import time_forwards
from labkit.models.hub import DEFAULT_TARGET
from labkit.models.transformer import ModelArgs, Transformer

ROOT = Path(__file__).resolve().parents[1]
TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def load_target(args) -> Transformer:
    if not args.random_init:
        from labkit.models.loading import load_model
        return load_model(args.model, dtype="bf16", device=args.device, progress=False).model
    config = json.loads((Path(args.config)).read_text()) if args.config else None
    model_args = ModelArgs.from_hf_config(config) if config else SHAPES["qwen2.5-1.5b"]
    model = Transformer(model_args).to(torch.bfloat16)
    return model.init_random().to(args.device).eval().requires_grad_(False)


def plot(result: dict):
    rows, roof = result["rows"], result["roofline"]
    fig, (ax1, ax2) = subplots(1, 2, figsize=(12, 4.5))
    T = [r["tokens"] for r in rows]
    ax1.plot(T, [r["measured_s"] * 1e3 for r in rows], "o-",
             label="measured (compiled, CUDA graph)" if rows[0].get("eager_s") else "measured")
    if rows[0].get("eager_s"):
        ax1.plot(T, [r["graph_s"] * 1e3 for r in rows], "o-", color="C1", alpha=0.6, label="measured, CUDA graph")
        ax1.plot(T, [r["eager_s"] * 1e3 for r in rows], "o-", color="C7", alpha=0.6, label="measured, eager")
    ax1.plot(T, [r["predicted_s"] * 1e3 for r in rows], "--", label="roofline prediction")
    ax1.plot(T, [r["memory_s"] * 1e3 for r in rows], ":", color="gray",
             label="bytes / bandwidth")
    ax1.set(xscale="log", xlabel="tokens per forward (k)", ylabel="ms per target forward",
            title=f"{result['model']} on {result['device']['name']}\n"
                  f"bf16, {result['threads']} thread(s), {result['clock']} clock, {result['context']} cached tokens")
    ax1.set_xticks(T, [str(t) for t in T], fontsize=7)
    ax1.legend()
    xs = [2 ** i for i in range(-2, 12)]
    ax2.plot(xs, [min(roof["peak_flops"], x * roof["bandwidth"]) / 1e9 for x in xs], "k-", label="roofline")
    ax2.scatter([r["intensity"] for r in rows], [r["flops"] / r["measured_s"] / 1e9 for r in rows], c="C0",
                label="measured forwards")
    for r in rows[::3]:
        ax2.annotate(f"k={r['tokens']}", (r["intensity"], r["flops"] / r["measured_s"] / 1e9), fontsize=7)
    ax2.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte)", ylabel="GFLOP/s",
            title=f"ridge at {roof['ridge']:.0f} FLOP/B")
    ax2.legend(loc="lower right")
    fig.text(0.01, 0.01, f"bandwidth: {result['device']['bandwidth']['source']}; "
                         f"compute: {result['device']['peak_flops']['source']}", fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return fig


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_TARGET)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--random-init", action="store_true", help="random weights of the model's shape (no download)")
    ap.add_argument("--config", help="config.json for --random-init (default: Qwen2.5-1.5B's shape)")
    ap.add_argument("--context", type=int, default=256, help="cached tokens before each forward")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    add_timing_args(ap)
    ap.add_argument("--out", default=str(ROOT / "data" / "bench"))
    args = ap.parse_args(argv)
    clock = timing_clock(args.device, args.threads, args.cpu_time)
    load_before = os.getloadavg()[0]
    profile = describe(args.device, clock=clock)
    roof = Roofline.of(profile)
    model = load_target(args)
    tokens = tuple(t for t in TOKENS if t <= args.max_tokens)
    times = time_forwards(model, args.context, tokens, args.repeats, clock)
    eager = graphed = None
    if torch.device(args.device).type == "cuda":      # the device's time, not the kernel launches'
        eager = times
        graphed = {T: time_forward(model, 1, T, args.context) for T in tqdm(tokens, desc="CUDA graphs")}
        times = {T: time_forward(model, 1, T, args.context, compile=True) for T in tqdm(tokens, desc="compiled")}
    rows = []
    for T, t in times.items():
        cost = forward_cost(model.args, T, args.context)
        rows.append({"tokens": T, "measured_s": t, "eager_s": eager[T] if eager else None,
                     "graph_s": graphed[T] if graphed else None,
                     "predicted_s": roof.time(cost),
                     "memory_s": cost.bytes / roof.bandwidth, "compute_s": cost.flops / roof.peak_flops,
                     "flops": cost.flops, "bytes": cost.bytes, "intensity": cost.intensity,
                     "achieved_bandwidth": cost.bytes / t})
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
              "load_average_1min_before_after": [load_before, os.getloadavg()[0]],
              "model": args.model + (" (random weights)" if args.random_init else ""), "model_args": asdict(model.args),
              "dtype": "bfloat16", "context": args.context, "repeats": args.repeats,
              "threads": torch.get_num_threads(), "clock": "thread CPU time" if args.cpu_time else "wall",
              "device": {"name": profile.name, "kind": profile.kind, "bandwidth": asdict(profile.bandwidth),
                         "peak_flops": asdict(profile.peak_flops), "facts": {k: str(v) for k, v in profile.facts.items()}},
              "roofline": {"bandwidth": roof.bandwidth, "peak_flops": roof.peak_flops, "ridge": roof.ridge,
                           "crossover_tokens": roof.crossover_tokens(model.args, args.context)},
              "rows": rows}
    out, name = Path(args.out), f"roofline_{profile.kind}"
    write_outputs(out / name, result, fig=plot)
    t1 = times[tokens[0]]
    for r in rows:
        print(f"k={r['tokens']:3d}  {r['measured_s'] * 1e3:8.1f} ms  x{r['measured_s'] / t1:5.2f} of k=1   "
              f"predicted {r['predicted_s'] * 1e3:8.1f} ms")
    print(f"wrote {out / name}.json and .png")
    return result


if __name__ == "__main__":
    main()
