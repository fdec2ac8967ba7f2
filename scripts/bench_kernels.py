"""GPU benchmark of the Triton kernels against their torch references (CUDA only).

Tree attention: Triton vs the torch reference vs scaled_dot_product_attention with a boolean
tree mask, Qwen2.5-1.5B's heads (12 query, 2 key/value, head_dim 128), bf16, tree sizes
16..256 and cached prefixes 512..8k. Acceptance: the fused kernels vs the torch references
for B rows, K=8, Qwen's 151,936-token vocabulary. Median times from triton.testing.do_bench.

    python scripts/bench_kernels.py --out data/bench      # writes gpu_kernels.{json,md,png}
"""
from __future__ import annotations

import argparse
from datetime import datetime, timezone
from pathlib import Path

import torch

from labkit.bench.writer import markdown_table, subplots, write_outputs
from labkit.kernels import acceptance, tree_attention

ROOT = Path(__file__).resolve().parents[1]


def markdown(result: dict) -> str:
    lines = [f"# Triton kernels on {result['device']} ({result['date']})", "",
             "Tree attention, bf16, B=1, 12 query heads / 2 key-value heads, head_dim 128 (median ms):", ""]
    lines += markdown_table(result["tree_attention"], {
        "prefix": "{prefix}", "nodes": "{nodes}", "triton": "{triton_ms:.3f}", "torch ref": "{torch_ref_ms:.3f}",
        "SDPA + bool mask": "{sdpa_mask_ms:.3f}",
        "SDPA + bool mask, enable_gqa": lambda r: (f"{r['sdpa_gqa_mask_ms']:.3f}" if "sdpa_gqa_mask_ms" in r
                                                   else "-"),     # runs before it was measured
        "max abs err": "{max_abs_err:.1e}", "triton KV GB/s": "{triton_kv_GBps:.0f}"})
    lines += ["", "Acceptance, K=8, V=151,936 (median ms):", ""]
    lines += markdown_table(result["acceptance"], {
        "B": "{batch}", "greedy triton": "{greedy_triton_ms:.3f}", "greedy torch": "{greedy_torch_ms:.3f}",
        "sampled triton": "{sampled_triton_ms:.3f}", "sampled torch": "{sampled_torch_ms:.3f}"})
    return "\n".join(lines) + "\n"


def plot(result: dict):
    rows = result["tree_attention"]
    prefixes = sorted({r["prefix"] for r in rows})
    fig, axes = subplots(1, len(prefixes), figsize=(3.2 * len(prefixes), 3.4), sharey=True)
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
    return fig


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
    write_outputs(Path(args.out) / "gpu_kernels", result, markdown, plot)
    print(markdown(result))


if __name__ == "__main__":
    main()
