"""Seconds per MTP training step in each train.precision, measured side by side on this machine.

Runs `labkit.mtp.train.train` for a few steps of one config (default: gloeckle4_600) with bf16
autocast and in plain fp32, alternately, and writes data/mtp/step_time.json and .md. On a CPU
without native bf16 matmuls (AVX2 only) autocast is much slower than fp32: check before a long run.
Run: `python scripts/mtp_step_time.py [--config data/mtp/configs/X.json] [--steps 6]` (a few minutes).
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

import torch

from labkit.mtp.train import AUTOCAST, train

DATA = Path(__file__).resolve().parents[1] / "data" / "mtp"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DATA / "configs" / "gloeckle4_600.json"))
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    config = json.loads(Path(args.config).read_text())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for precision in AUTOCAST:
            config["train"]["precision"] = precision
            meta = train(config, Path(tmp), args.steps)
            rows.append({"precision": precision, "steps": args.steps, "seconds_per_step": meta["seconds_per_step"]})
    fp32 = next(r["seconds_per_step"] for r in rows if r["precision"] == "fp32")
    result = {"config": config["name"], "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
              "threads": config["train"].get("threads", 1), "torch": torch.__version__,
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "rows": rows}
    (DATA / "step_time.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Seconds per training step of `{config['name']}`, by precision", "",
             f"{args.steps} steps each, {result['threads']} thread(s), torch {result['torch']}, CPU capability "
             f"{result['cpu_capability']} (`python scripts/mtp_step_time.py`).", "",
             "| precision | s/step | vs fp32 |", "|---|---:|---:|"]
    lines += [f"| {r['precision']} | {r['seconds_per_step']:.2f} | {r['seconds_per_step'] / fp32:.1f}x |" for r in rows]
    (DATA / "step_time.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
