"""The verify-cost curve of this machine: forward time over tokens per forward, for every path and precision.

Speculation pays when verifying k draft tokens costs about what one decode step costs. On a
CPU that holds only if the matrix kernel reads each weight once for all k tokens and keeps the
arithmetic units busy while the next weights arrive; stock kernels for 2-64 rows often do not.
This measures t(T) for T = 1..64 on each forward path (backends.py) and precision, next to the
two lines a forward cannot beat: the bandwidth line (weight bytes / measured copy bandwidth:
streaming the weights once) and the compute line (FLOPs of T tokens / measured matmul FLOP/s).

    python -m labkit verify-cost                       # the 1.5B target, every path, bf16 and fp32
    python -m labkit verify-cost --paths packed --precisions bf16 --tokens 1,8,32

Writes data/bench/verify_cost_<cpu>_<isa>.{json,md,png} (the CPU's name and ISA in the file name:
the numbers are this machine's).
"""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from ..hw.device import measure_copy_bandwidth, measure_matmul_flops
from ..hw.roofline import forward_cost
from ..models.backends import QUANTIZED
from ..models.calibrate import (  # noqa: F401
    cpu_slug,
    isa_label,
    load_average,
    machine,
    machine_slug,
    time_forwards,
)

TOKENS = (1, 2, 4, 8, 16, 32, 64)
BYTES = {"fp32": 4, "bf16": 2, "int8": 1, "int4": 0.5 + 4 / 32}   # int4: 4 bits + an fp16 (or bf16) scale and minimum per 32


def measure(model_name: str, paths: list[str], precisions: list[str], tokens: tuple[int, ...] = TOKENS,
            context: int = 256, repeats: int = 5, progress: bool = True) -> dict:
    """Time every (path, precision) on `model_name`; returns the rows and the machine's two lines.

    Each (path, precision) loads and runs in a fresh process: a model loaded after another one was
    freed finds less memory free in 2 MB pages, and its weights, on 4 KB pages, stream slower (measured
    here: the packed bf16 target's one-token forward took 27% longer loaded second than first)."""
    import multiprocessing
    m = machine()
    load_before = load_average()
    bandwidth = measure_copy_bandwidth("cpu", size_mib=512)
    flops = {p: measure_matmul_flops("cpu", _peak_dtype(p), n=2048) for p in sorted(set(precisions))
             if p not in QUANTIZED}
    rows = []
    pairs = [(path, precision) for precision in precisions for path in paths]
    spawn = multiprocessing.get_context("spawn")
    for path, precision in tqdm(pairs, desc="paths", disable=not progress):
        with spawn.Pool(1) as pool:
            row = pool.apply(time_one, (model_name, path, precision, tokens, context, repeats, torch.get_num_threads()))
        if "times_s" in row:
            row["bandwidth_line_s"] = row["weight_bytes"] / bandwidth.value
            fl = row.pop("flops")
            row["compute_line_s"] = ({str(T): f / flops[precision].value for T, f in fl.items()}
                                     if precision in flops else None)   # integer kernels: another peak, not drawn
        rows.append(row)
    return {"model": model_name, "machine": m, "isa": isa_label(m), "context": context, "repeats": repeats,
            "tokens": list(tokens), "bandwidth": {"value": bandwidth.value, "source": bandwidth.source},
            "matmul_flops": {p: {"value": f.value, "source": f.source} for p, f in flops.items()},
            "load_average": {"before": load_before, "after": load_average()},
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "rows": rows}


def _peak_dtype(precision: str) -> torch.dtype:
    """The matmul whose FLOP/s bound `precision`'s forwards: bf16 where the CPU multiplies bf16 (AVX-512 / AMX),
    else fp32 (labkit's bf16 kernel widens to fp32 there, and torch's bf16 matmul is a slow fallback)."""
    from ..models.backends import onednn_bf16
    return torch.bfloat16 if precision == "bf16" and onednn_bf16() else torch.float32


@torch.no_grad()
def time_one(model_name: str, path: str, precision: str, tokens: tuple[int, ...], context: int, repeats: int,
             threads: int) -> dict:
    """One row: `model_name` on `path` in `precision`, timed at every T (run in a process of its own)."""
    from ..models.loading import load_model
    torch.set_num_threads(threads)
    try:
        lm = load_model(model_name, precision, backend=path, device="cpu", progress=False)
    except ValueError as e:                          # a path this machine cannot run: say so in the table
        return {"path": path, "precision": precision, "skipped": str(e)}
    t = time_forwards(lm.model, context, tokens, repeats, progress=False)
    cost = {T: forward_cost(lm.model.args, T, context, dtype_bytes=BYTES[precision]) for T in tokens}
    return {"path": path, "precision": precision, "times_s": {str(T): t[T] for T in tokens},
            "ratio": {str(T): t[T] / t[tokens[0]] for T in tokens}, "weight_bytes": cost[tokens[0]].weight_bytes,
            "flops": {str(T): cost[T].flops for T in tokens}}


def add_llama_cpp(result: dict, model_name: str) -> dict:
    """Append llama.cpp's row (its own kernels on the preset's GGUF file) to a measured `result`."""
    from . import llama_cpp
    row = llama_cpp.cost_row(llama_cpp.gguf_file(model_name), tuple(result["tokens"]), result["context"],
                             result["repeats"], result["machine"]["threads"])
    row["bandwidth_line_s"] = row["weight_bytes"] / result["bandwidth"]["value"]
    result["rows"].append(row)
    result["load_average"]["after"] = load_average()
    return result


def best_row(result: dict, precision: str) -> dict | None:
    """The measured row of `precision` with the fastest one-token forward."""
    rows = [r for r in result["rows"] if r["precision"] == precision and "times_s" in r]
    return min(rows, key=lambda r: r["times_s"][str(result["tokens"][0])]) if rows else None


def _compute_line_note(flops: dict) -> str:
    integer = "the quantized precisions' integer kernels have a peak of their own"
    if not flops:
        return f"No compute line: {integer}."
    peaks = ", ".join(f"{p} {v['value'] / 1e9:.0f} GFLOP/s" for p, v in flops.items())
    return f"Compute line: FLOPs of T tokens / {peaks} (a 2048³ matmul); {integer}: no compute line for them."


def markdown(result: dict) -> str:
    m, T = result["machine"], result["tokens"]
    lines = [f"# Verify cost: `{result['model']}` on {m['cpu']}", "",
             f"Measured {result['date']}: {m['cpu']} ({result['isa']}), {m['threads']} torch threads, torch "
             f"{m['torch']}; {result['context']} cached tokens, best of {result['repeats']} per point, each path and "
             f"precision loaded in a process of its own; load average "
             f"{result['load_average']['before'][0]} before, {result['load_average']['after'][0]} after.", "",
             f"Bandwidth line: weight bytes / {result['bandwidth']['value'] / 1e9:.1f} GB/s "
             f"({result['bandwidth']['source']}). " + _compute_line_note(result["matmul_flops"]), "",
             "| path | precision | t(1) ms | " + " | ".join(f"t({t})/t(1)" for t in T[1:])
             + " | bandwidth line ms | bandwidth line / t(1) |",
             "|---|---|---|" + "---|" * (len(T) - 1) + "---|---|"]
    for r in result["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['path']} | {r['precision']} | not run here: {r['skipped']} |")
            continue
        t1 = r["times_s"][str(T[0])]
        lines.append(f"| {r['path']} | {r['precision']} | {t1 * 1e3:.1f} | "
                     + " | ".join(f"{r['ratio'][str(t)]:.2f}" for t in T[1:])
                     + f" | {r['bandwidth_line_s'] * 1e3:.1f} | {r['bandwidth_line_s'] / t1:.0%} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path | None = None, ax=None):
    """t(T) per path and precision, with each precision's bandwidth and compute lines."""
    import matplotlib
    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    T = result["tokens"]
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 4.8))
    colours = {"reference": "tab:gray", "onednn": "tab:orange", "packed": "tab:blue", "packed-amx": "tab:green",
               "llama.cpp": "tab:red"}
    styles = {"fp32": "-", "bf16": "--", "int8": ":", "int4": "-."}
    for r in result["rows"]:
        if "times_s" not in r:
            continue
        ax.plot(T, [r["times_s"][str(t)] * 1e3 for t in T], styles.get(r["precision"], "-"), marker="o", ms=4,
                color=colours.get(r["path"], "black"), label=f"{r['path']}, {r['precision']}")
    for precision in dict.fromkeys(r["precision"] for r in result["rows"] if "times_s" in r):
        r = next(x for x in result["rows"] if x["precision"] == precision and "times_s" in x)
        bw = r["bandwidth_line_s"] * 1e3
        if r["compute_line_s"] is None:                 # quantised kernels (labkit's, llama.cpp's): no compute line
            ax.axhline(bw, color="tab:red", lw=2.5, alpha=0.25, label=f"{precision}: bandwidth line")
            continue
        roof = [max(bw, r["compute_line_s"][str(t)] * 1e3) for t in T]
        ax.plot(T, roof, styles.get(precision, "-"), color="black", lw=2.5, alpha=0.25,
                label=f"{precision}: max(bandwidth line, compute line)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(T, [str(t) for t in T])
    ax.set_xlabel("tokens per forward T (1 = a decode step, k+1 = verifying k draft tokens)")
    ax.set_ylabel("forward time (ms)")
    ax.set_title(f"{result['model']} on {result['machine']['cpu']} ({result['isa']}), "
                 f"{result['machine']['threads']} threads", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    if path is not None:
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return ax


def write(result: dict, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"verify_cost_{machine_slug(result['machine'])}"
    paths = [stem.with_suffix(".json"), stem.with_suffix(".md"), stem.with_suffix(".png")]
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    paths[1].write_text(markdown(result))
    plot(result, paths[2])
    return paths


def check_precisions(precisions: list[str]) -> list[str]:
    ok = ("fp32", "bf16", *QUANTIZED)
    bad = [p for p in precisions if p not in ok]
    if bad or not precisions:
        raise ValueError(f"--precisions takes a comma-separated list from {', '.join(ok)}, got {precisions}")
    return precisions
