"""Which layers of the target to skip when it drafts for itself, found on this machine.

    .venv/bin/python scripts/layer_skip_search.py                       # the embedded 1.5B target, bf16
    .venv/bin/python scripts/layer_skip_search.py --max-skip 8 --tokens 128

Greedy search (labkit.models.layer_skip.search_skip_layers): each round skips the one more
layer that keeps teacher-forced top-1 agreement with the full target highest on a calibration
text (Python's own textwrap.py); then every depth's one-token forward is timed against the
target's, and Leviathan's formula with the measured verify costs picks depth and γ. Writes
data/bench/layer_skip_<cpu>_<isa>.{json,md,png}.
"""
from __future__ import annotations

import argparse
import os
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch

from labkit.bench.verify_cost import machine_slug
from labkit.bench.writer import markdown_table, subplots, write_outputs
from labkit.models.calibrate import isa_label, machine
from labkit.models.hub import DEFAULT_TARGET
from labkit.models.layer_skip import calibration_ids, search_skip_layers
from labkit.models.loading import load_model

ROOT = Path(__file__).resolve().parents[1]


def markdown(result: dict) -> str:
    s, c = result["search"], result["search"]["chosen"]
    lines = [f"# Layer-skip search: {result['target']} on {result['machine']['cpu']} ({result['isa']})", "",
             f"{result['dtype']}, forward path {result['path']}, {result['machine']['threads']} threads, "
             f"{result['date']}; load average before/after {result['load_average_before_after']}. "
             f"Calibration: {s['calibration_tokens']} tokens of Python's textwrap.py, teacher forced. "
             f"Search: {result['search_seconds']:.0f} s.", "",
             f"**Chosen:** skip layers {c['skip']} ({c['n_skipped']} of {result['n_layers']}), γ = {c['gamma']}: "
             f"agreement {c['agreement']:.2f}, draft cost c = {c['cost']:.2f}, predicted speedup "
             f"{c['predicted_speedup']:.2f}x (Leviathan's formula with the measured verify cost).", ""]
    rows = [{"n": i + 1, "layer": s["order"][i], "agreement": s["agreement"][i], "cost": s["cost"][i],
             "gamma": max(s["predicted"][i], key=lambda g: s["predicted"][i][g]),
             "speedup": max(s["predicted"][i].values())} for i in range(len(s["order"]))]
    lines += markdown_table(rows, {"layers skipped": "{n}", "skipped next": "{layer}",
                                   "agreement (≈ α)": "{agreement:.3f}", "draft cost c": "{cost:.2f}",
                                   "best γ": "{gamma}", "predicted speedup": "{speedup:.2f}"})
    lines += ["", "Verify cost t(γ+1)/t(1): " + ", ".join(f"γ={g}: {v:.2f}" for g, v in s["verify_cost"].items()),
              "", "Agreement stands in for the acceptance rate α: under greedy decoding a draft token is kept "
              "exactly when it is the target's argmax. The benchmark's `layer-skip` method runs the same search "
              "and measures the real speedup."]
    return "\n".join(lines) + "\n"


def plot(result: dict):
    s = result["search"]
    n = list(range(1, len(s["order"]) + 1))
    fig, (ax1, ax2) = subplots(1, 2, figsize=(12, 4))
    ax1.plot(n, s["agreement"], "o-", label="agreement with the target (≈ α)")
    ax1.plot(n, s["cost"], "s-", label="draft cost c (one-token forward / target's)")
    ax1.set(xlabel="layers skipped", ylim=(0, 1.05), title="what skipping costs and saves")
    ax1.set_xticks(n)
    ax1.legend(fontsize=8)
    for g in s["verify_cost"]:
        ax2.plot(n, [row[g] for row in s["predicted"]], "o-", label=f"γ={g}")
    ax2.axhline(1.0, color="k", lw=0.6)
    ax2.set(xlabel="layers skipped", ylabel="predicted speedup", title="Leviathan's formula, measured α, c, verify")
    ax2.set_xticks(n)
    ax2.legend(fontsize=8)
    fig.suptitle(f"{result['target']} on {result['machine']['cpu']} ({result['isa']})", fontsize=10)
    fig.tight_layout()
    return fig


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--max-skip", type=int, default=None, help="deepest skip tried (default: half the layers)")
    ap.add_argument("--tokens", type=int, default=256, help="calibration tokens")
    ap.add_argument("--out", default=str(ROOT / "data" / "bench"))
    args = ap.parse_args(argv)
    load_before = os.getloadavg()[0]
    target = load_model(args.target, dtype=args.dtype, progress=False)
    t0 = datetime.now(timezone.utc)
    search = search_skip_layers(target.model, calibration_ids(target.tokenizer, args.tokens), args.max_skip)
    seconds = (datetime.now(timezone.utc) - t0).total_seconds()
    m = {**machine(), "threads": torch.get_num_threads()}
    result = {"date": t0.isoformat(timespec="seconds"), "host_arch": platform.machine(), "machine": m,
              "isa": isa_label(m), "target": args.target, "dtype": args.dtype, "path": str(target.model.path),
              "n_layers": target.model.args.n_layers, "search_seconds": seconds,
              "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
              "search": search.to_dict()}
    write_outputs(Path(args.out) / f"layer_skip_{machine_slug(m)}", result, markdown, plot, json_newline=True)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
