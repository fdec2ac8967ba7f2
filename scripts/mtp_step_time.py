"""Seconds per MTP training step in each train.precision, measured side by side on this machine.

Runs `labkit.training.train_mtp.train` for a few steps of one config (default: gloeckle4_600) with bf16
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

from labkit.bench.writer import markdown_table, write_outputs
from labkit.training.train_mtp import AUTOCAST, train

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
    result = {"config": config["name"], "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
              "threads": config["train"].get("threads", 1), "torch": torch.__version__,
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "rows": rows}
    write_outputs(DATA / "step_time", result, markdown)
    print(markdown(result), end="")


def markdown(result: dict) -> str:
    rows = result["rows"]
    fp32 = next(r["seconds_per_step"] for r in rows if r["precision"] == "fp32")
    lines = [f"# Seconds per training step of `{result['config']}`, by precision", "",
             f"{rows[0]['steps']} steps each, {result['threads']} thread(s), torch {result['torch']}, CPU capability "
             f"{result['cpu_capability']} (`python scripts/mtp_step_time.py`).", ""]
    lines += markdown_table(rows, {"precision": "{precision}", "s/step": "{seconds_per_step:.2f}",
                                   "vs fp32": lambda r: f"{r['seconds_per_step'] / fp32:.1f}x"}, align="-rr")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
