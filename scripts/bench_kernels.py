"""GPU benchmark of the Triton kernels against their torch references (CUDA only).

Tree attention: Triton vs the torch reference vs scaled_dot_product_attention with a boolean
tree mask, Qwen2.5-1.5B's heads (12 query, 2 key/value, head_dim 128), bf16, tree sizes
16..256 and cached prefixes 512..8k. Acceptance: the fused kernels vs the torch references
for B rows, K=8, Qwen's 151,936-token vocabulary. Median times from triton.testing.do_bench.

    python scripts/bench_kernels.py --out data/bench      # writes gpu_kernels.{json,md,png}
"""
from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path

import torch

from kernels import acceptance, tree_attention

ROOT = Path(__file__).resolve().parents[1]


def markdown(result: dict) -> str:
    lines = [f"# Triton kernels on {result['device']} ({result['date']})", "",
             "Tree attention, bf16, B=1, 12 query heads / 2 key-value heads, head_dim 128 (median ms):", "",
             "| prefix | nodes | triton | torch ref | SDPA + bool mask | SDPA + bool mask, enable_gqa | max abs err "
             "| triton KV GB/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["tree_attention"]:
        gqa = f"{r['sdpa_gqa_mask_ms']:.3f}" if "sdpa_gqa_mask_ms" in r else "-"     # runs before it was measured
        lines.append(f"| {r['prefix']} | {r['nodes']} | {r['triton_ms']:.3f} | {r['torch_ref_ms']:.3f} | "
                     f"{r['sdpa_mask_ms']:.3f} | {gqa} | {r['max_abs_err']:.1e} | {r['triton_kv_GBps']:.0f} |")
    lines += ["", "Acceptance, K=8, V=151,936 (median ms):", "",
              "| B | greedy triton | greedy torch | sampled triton | sampled torch |", "|---|---|---|---|---|"]
    for r in result["acceptance"]:
        lines.append(f"| {r['batch']} | {r['greedy_triton_ms']:.3f} | {r['greedy_torch_ms']:.3f} | "
                     f"{r['sampled_triton_ms']:.3f} | {r['sampled_torch_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["tree_attention"]
    prefixes = sorted({r["prefix"] for r in rows})
    fig, axes = plt.subplots(1, len(prefixes), figsize=(3.2 * len(prefixes), 3.4), sharey=True)
    for ax, P in zip(axes, prefixes):
        sub = [r for r in rows if r["prefix"] == P]
        for key, label in [("triton_ms", "Triton"), ("torch_ref_ms", "torch ref"), ("sdpa_mask_ms", "SDPA + mask"),
                           ("sdpa_gqa_mask_ms", "SDPA + mask, enable_gqa")]:
            if key not in sub[0]:
                continue
            ax.plot([r["nodes"] for r in sub], [r[key] for r in sub], "o-", label=label)
        ax.set(xscale="log", yscale="log", xlabel="tree nodes N", title=f"prefix {P}")
    axes[0].set_ylabel("ms")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"tree attention on {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "data" / "bench"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or tree_attention.triton is None:
        raise SystemExit("bench_kernels.py needs a CUDA device and Triton; on CPU run the tests "
                         "(tests/test_kernels.py, under the interpreter) instead")
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        tree_attention.check(dtype=dt, device="cuda")
        acceptance.check(dtype=dt, device="cuda")
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": tree_attention.triton.__version__,
              "tree_attention": tree_attention.benchmark(), "acceptance": acceptance.benchmark()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_kernels.json").write_text(json.dumps(result, indent=1))
    (out / "gpu_kernels.md").write_text(markdown(result))
    plot(result, out / "gpu_kernels.png")
    print(markdown(result))


if __name__ == "__main__":
    main()
