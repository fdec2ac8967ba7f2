"""Peak memory of the multi-token loss, naive vs head by head, measured in one run.

Each way runs in its own fresh subprocess (so one's peak can't hide the other's) on the same
n=4 Gloeckle model with a large vocabulary (V = 32768, where the n logits dominate), and reports
the peak resident set size (getrusage ru_maxrss) above the RSS just before the loss step.
Writes data/mtp/memory.json and data/mtp/memory.md.
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

SETTING = dict(kind="gloeckle", n_future=4, vocab_size=32768, dim=192, n_trunk=2, n_heads=6, hidden_dim=512)
B, T = 4, 256


def child(way: str) -> None:
    import torch

    from labkit.models.mtp import MTPConfig, MTPModel
    from labkit.training.mtp_loss import headwise_backward, naive_backward
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = MTPModel(MTPConfig(**SETTING, max_seq_len=T))
    window = torch.randint(0, SETTING["vocab_size"], (B, T + SETTING["n_future"]))
    step = {"naive": naive_backward, "headwise": headwise_backward}[way]
    step(model, window, 16)                     # warm-up on a short window: allocator and grads in place
    model.zero_grad(set_to_none=False)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    loss = step(model, window, T)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    grad_norm = float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())
    print(json.dumps({"way": way, "peak_above_start_mib": (peak - before) / 1024, "peak_rss_mib": peak / 1024,
                      "loss": loss.total, "grad_norm": grad_norm}))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        return child(sys.argv[2])
    from labkit.bench.writer import (
        write_outputs,  # here, not at the top: the children import only what they measure
    )
    rows = []
    for way in ("naive", "headwise"):
        out = subprocess.run([sys.executable, __file__, "--child", way], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(rows[-1])
    logits_mib = B * T * SETTING["vocab_size"] * 4 / 2**20
    result = {"setting": {**SETTING, "batch_size": B, "seq_len": T}, "one_head_logits_fp32_mib": logits_mib,
              "rows": rows, "ratio_naive_over_headwise": rows[0]["peak_above_start_mib"] / rows[1]["peak_above_start_mib"]}
    write_outputs(Path(__file__).resolve().parents[1] / "data" / "mtp" / "memory", result, markdown)


def markdown(result: dict) -> str:
    from labkit.bench.writer import markdown_table
    s = result["setting"]
    lines = ["# Multi-token loss: peak memory, naive vs head by head", "",
             f"n=4 Gloeckle heads, V={s['vocab_size']}, d={s['dim']}, batch {s['batch_size']} x {s['seq_len']} tokens, "
             f"fp32, CPU; one head's logits are {result['one_head_logits_fp32_mib']:.0f} MiB. Peak RSS above the RSS "
             "before the step, each way in its own process (`python scripts/mtp_memory.py`).", ""]
    lines += markdown_table(result["rows"], {"way": "{way}", "peak above start (MiB)": "{peak_above_start_mib:.0f}",
                                             "loss": "{loss:.4f}", "grad norm": "{grad_norm:.4f}"}, align="-rrr")
    lines += ["", f"naive / head by head: {result['ratio_naive_over_headwise']:.2f}x"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
