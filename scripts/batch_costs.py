"""On a GPU: where does batched speculation stop paying? Measured forward costs x measured acceptance.

The GPU box cannot download the embedded pair, and a random draft agrees with nothing, so an
end-to-end batched run there would measure only its costs. This script measures exactly those,
as the device sees them: one forward of the target over B rows x T tokens (T = 1 for a decode
step, γ+1 for a verify) and one draft decode step, each captured as a CUDA graph and replayed
and compiled (labkit/decoding/static.py: no launch overhead in the numbers). Leviathan's formula then combines
them with the acceptance rate α the real pair reached in the committed CPU batch run:

    speedup(B, γ) = E[tokens](α, γ) x t_target(B, 1) / (γ x t_draft(B, 1) + t_target(B, γ+1))

next to the roofline's prediction from the same device's measured bandwidth and FLOP/s. It is a
prediction from measured parts, labelled so; the end-to-end batched runs are scripts/bench_batch.py.

    python scripts/batch_costs.py                         # CUDA; B = 1..256, γ = 2, 4, 8
Writes data/bench/batch_costs_cuda.{json,md,png}.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from labkit.bench.forward_time import time_forward
from labkit.bench.writer import markdown_table, subplots, write_outputs
from labkit.core.adaptive import expected_tokens
from labkit.hw import Roofline, describe, predicted_speedup, random_model

ROOT = Path(__file__).resolve().parents[1]


def measured_alpha(path: Path) -> dict[int, float]:
    """γ -> mean acceptance rate of the real pair in the committed batch run (over its batch sizes)."""
    rows = json.loads(path.read_text())["rows"]
    return {g: sum(r["acceptance"] for r in rows if r["gamma"] == g) / sum(r["gamma"] == g for r in rows)
            for g in sorted({r["gamma"] for r in rows})}


def markdown(result: dict) -> str:
    columns = {"B": "{batch}", "target 1 tok ms": "{target_ms:.2f}", "draft 1 tok ms": "{draft_ms:.2f}"}
    for g in map(str, result["gammas"]):
        columns |= {f"verify γ={g} ms": lambda r, g=g: f"{r['verify_ms'][g]:.2f}",
                    f"speedup γ={g}": lambda r, g=g: f"{r['speedup'][g]:.2f}",
                    f"roofline γ={g}": lambda r, g=g: f"{r['roofline'][g]:.2f}"}
    lines = [f"# Batched speculation on {result['device']}: measured costs x measured α ({result['date']})", "",
             f"Qwen2.5-Coder 1.5B target / 0.5B draft shapes, bf16, random weights, {result['context']} cached tokens, "
             f"{result['forwards']} (median of 20). α from {result['alpha_source']}: "
             + ", ".join(f"γ={g}: {a:.2f}" for g, a in result["alpha"].items()) + ".", ""]
    return "\n".join(lines + markdown_table(result["rows"], columns)) + "\n"


def plot(result: dict):
    fig, (ax1, ax2) = subplots(1, 2, figsize=(12, 4.5))
    B = [r["batch"] for r in result["rows"]]
    for i, g in enumerate(result["gammas"]):
        ax1.plot(B, [r["speedup"][str(g)] for r in result["rows"]], "o-", color=f"C{i}",
                 label=f"γ={g}, α={result['alpha'][str(g)]:.2f}: measured costs")
        ax1.plot(B, [r["roofline"][str(g)] for r in result["rows"]], "--", color=f"C{i}", alpha=0.6,
                 label=f"γ={g}: roofline")
        ax2.plot(B, [r["verify_ms"][str(g)] / r["target_ms"] for r in result["rows"]], "o-", color=f"C{i}",
                 label=f"verify of γ+1={g + 1} tokens a row")
    ax2.plot(B, [r["draft_ms"] / r["target_ms"] for r in result["rows"]], "s-", color="C7", label="draft step")
    ax1.axhline(1, color="k", lw=0.8)
    ax1.set(xscale="log", xlabel="batch size B", ylabel="predicted speedup over batched AR",
            title=f"where speculation fades on {result['device']}")
    ax2.set(xscale="log", xlabel="batch size B", ylabel="cost / target decode step at the same B",
            title="forward cost, CUDA-graph replay")
    for ax in (ax1, ax2):
        ax.set_xticks(B, [str(b) for b in B])
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--gammas", default="2,4")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--no-compile", action="store_true",
                    help="replay eager kernels (each forward's graph then also pays ~1 µs a kernel); "
                         "skips torch.compile's minutes of compiling dynamic-shape graphs")
    ap.add_argument("--alpha-from", default=str(ROOT / "data" / "bench" / "batch_cpu.json"),
                    help="a bench_batch.py result of the real pair, whose acceptance rates are used")
    ap.add_argument("--out", default=str(ROOT / "data" / "bench"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("batch_costs.py times CUDA-graph replays on a GPU; on CPU run scripts/bench_batch.py")
    alpha = measured_alpha(Path(args.alpha_from))
    gammas = [int(g) for g in args.gammas.split(",")]
    missing = [g for g in gammas if g not in alpha]
    if missing:
        raise SystemExit(f"{args.alpha_from} has no acceptance rate for γ={missing}; it has γ={list(alpha)}")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    profile = describe("cuda")
    roof = Roofline.of(profile)
    target, draft = random_model("qwen2.5-1.5b"), random_model("qwen2.5-0.5b")
    compile = not args.no_compile
    rows = []
    for B in tqdm(batch_sizes, desc="batch sizes"):
        t_target = time_forward(target, B, 1, args.context, compile=compile)
        t_draft = time_forward(draft, B, 1, args.context, compile=compile)
        row = {"batch": B, "target_ms": 1e3 * t_target, "draft_ms": 1e3 * t_draft, "verify_ms": {}, "speedup": {},
               "roofline": {}}
        for g in gammas:
            t_verify = time_forward(target, B, g + 1, args.context, compile=compile)
            row["verify_ms"][str(g)] = 1e3 * t_verify
            row["speedup"][str(g)] = expected_tokens(alpha[g], g) * t_target / (g * t_draft + t_verify)
            row["roofline"][str(g)] = predicted_speedup(roof, target.args, draft.args, B, g, alpha[g], args.context)
        rows.append(row)
        print(row)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": profile.name,
              "torch": torch.__version__, "context": args.context,
              "forwards": "torch.compile'd, CUDA-graph replays" if compile else "eager kernels, CUDA-graph replays", "gammas": gammas,
              "alpha": {str(g): alpha[g] for g in gammas}, "alpha_source": Path(args.alpha_from).name,
              "bandwidth": asdict(profile.bandwidth), "peak_flops": asdict(profile.peak_flops),
              "ridge_flop_per_byte": roof.ridge, "rows": rows}
    write_outputs(Path(args.out) / "batch_costs_cuda", result, markdown, plot)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
