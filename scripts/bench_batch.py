"""Where the benefit fades: batched speculative decoding vs batched autoregressive, over B and γ.

For each batch size B, one batched autoregressive run and one batched speculative run per γ,
same prompts, same process, one after the other (noise hits all alike); the speedup is the
ratio of their decode times (prefill excluded). Next to it, the roofline's prediction from
this run's measured acceptance rate and this device's measured bandwidth and FLOP/s.

    nice -n 10 python scripts/bench_batch.py                          # embedded pair, bf16, CPU
    nice -n 10 python scripts/bench_batch.py --threads 1 --cpu-time   # one core, CPU time: a shared machine
    python scripts/bench_batch.py --device cuda --random-init         # cost side only (see below)

--random-init: target and draft of the embedded pair's shapes with random weights (a GPU box
that cannot download them). A random draft agrees with nothing, so the speedups then say
nothing; what such a run does measure is the verify cost vs B x (γ+1) tokens, the cost side
of the crossover. Writes data/bench/batch_<device>.{json,md,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from labkit.bench.writer import markdown_table, subplots, write_outputs
from labkit.decoding.batched import (
    batch_summary,
    batched_autoregressive_generate,
    batched_speculative_generate,
)
from labkit.drafters import DraftModelDrafter
from labkit.hw import SHAPES, Roofline, describe, predicted_speedup
from labkit.hw.device import add_timing_args, timing_clock
from labkit.models.hub import DEFAULT_DRAFT, DEFAULT_TARGET
from labkit.models.transformer import Transformer

ROOT = Path(__file__).resolve().parents[1]


def load_pair(args):
    """(target, draft, prompts as token tensors, eos ids)."""
    rows = [json.loads(ln) for ln in (ROOT / "data" / "prompts" / "core_bench.jsonl").read_text().splitlines()]
    if args.random_init:
        g = torch.Generator().manual_seed(0)
        target, draft = (Transformer(SHAPES[s]).to(torch.bfloat16).init_random(seed=i).to(args.device).eval()
                         for i, s in enumerate(("qwen2.5-1.5b", "qwen2.5-0.5b")))
        prompts = [torch.randint(0, 151936, (40 + 10 * i,), generator=g) for i in range(len(rows))]
        return target, draft, prompts, ()
    from labkit.models.loading import encode_prompt, load_model
    target = load_model(args.target, dtype="bf16", device=args.device, progress=False)
    draft = load_model(args.draft, dtype="bf16", device=args.device, progress=False)
    prompts = [encode_prompt(target.tokenizer, r["prompt"], chat_template=True) for r in rows]
    return target.model, draft.model, prompts, target.eos_token_ids


def plot(result: dict):
    fig, (ax1, ax2) = subplots(1, 2, figsize=(12, 4.5))
    for i, gamma in enumerate(result["gammas"]):
        rows = [r for r in result["rows"] if r["gamma"] == gamma]
        B = [r["batch"] for r in rows]
        ax1.plot(B, [r["speedup"] for r in rows], "o-", color=f"C{i}", label=f"measured γ={gamma}")
        ax1.plot(B, [r["predicted_speedup"] for r in rows], "--", color=f"C{i}", label=f"roofline γ={gamma}")
        ax2.plot([b * (gamma + 1) for b in B], [r["verify_ms"] for r in rows], "o-", color=f"C{i}",
                 label=f"verify, γ={gamma}")
    ar = [r for r in result["rows"] if r["gamma"] == result["gammas"][0]]
    ax2.plot([r["batch"] for r in ar], [r["ar_step_ms"] for r in ar], "s-", color="gray", label="autoregressive step")
    ax1.axhline(1, color="k", lw=0.8)
    ax1.set(xscale="log", xlabel="batch size B", ylabel="speedup over batched autoregressive",
            title=f"{result['target']} + {result['draft']}")
    ax1.set_xticks(result["batch_sizes"], [str(b) for b in result["batch_sizes"]])
    ax2.set(xscale="log", xlabel="tokens in one target forward (B x (γ+1), or B)", ylabel="ms per target forward",
            title=f"{result['device']['name']}")
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
    fig.text(0.01, 0.01, f"roofline: {result['roofline_label']}", fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return fig


def markdown(result: dict) -> str:
    lines = [f"# Batched speculative decoding vs batched autoregressive ({result['device']['name']})", "",
             f"{result['target']} + {result['draft']}, bf16, greedy, {result['max_new_tokens']} new tokens a row, "
             f"{result['date']}, {result['threads']} torch thread(s), {result['clock']} clock. "
             "Speedup = decode time of batched AR / batched speculative (prefill excluded).",
             f"Roofline: {result['roofline_label']}.", ""]
    lines += markdown_table(result["rows"], {
        "B": "{batch}", "γ": "{gamma}", "speedup": "{speedup:.2f}", "roofline": "{predicted_speedup:.2f}",
        "acceptance": "{acceptance:.2f}", "verify ms": "{verify_ms:.0f}", "AR step ms": "{ar_step_ms:.0f}",
        "rows equal to AR": "{rows_equal}/{batch}"})
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--random-init", action="store_true", help="random weights of the pair's shapes (cost side only)")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--gammas", default="2,4")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    add_timing_args(ap)
    ap.add_argument("--out", default=str(ROOT / "data" / "bench"))
    args = ap.parse_args(argv)
    clock = timing_clock(args.device, args.threads, args.cpu_time)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    gammas = [int(g) for g in args.gammas.split(",")]
    load_before = os.getloadavg()[0]
    profile = describe(args.device, clock=clock)
    roof = Roofline.of(profile)
    target, draft, prompts, eos = load_pair(args)
    rows = []
    with tqdm(total=len(batch_sizes) * (1 + len(gammas)), desc="runs") as bar:
        for B in batch_sizes:
            batch = [prompts[b % len(prompts)] for b in range(B)]
            context = max(p.numel() for p in batch) + args.max_new_tokens // 2
            ar_gens = batched_autoregressive_generate(target, batch, args.max_new_tokens, eos_token_ids=eos,
                                                      clock=clock)
            ar = batch_summary(ar_gens)
            bar.update()
            for gamma in gammas:
                spec_gens = batched_speculative_generate(target, DraftModelDrafter(draft), batch, args.max_new_tokens,
                                                         gamma, eos_token_ids=eos, clock=clock)
                spec = batch_summary(spec_gens)
                bar.update()
                alpha = spec["acceptance_rate"]
                rows.append({"batch": B, "gamma": gamma, "speedup": ar["decode_time"] / spec["decode_time"],
                             "predicted_speedup": predicted_speedup(roof, target.args, draft.args, B, gamma,
                                                                    min(alpha, 0.999), context),
                             "acceptance": alpha, "spec_steps": spec["target_forwards"],
                             "ar_steps": ar["target_forwards"],
                             "verify_ms": 1e3 * spec["verify_time"] / spec["target_forwards"],
                             "draft_ms_per_step": 1e3 * spec["draft_time"] / spec["target_forwards"],
                             "ar_step_ms": 1e3 * ar["verify_time"] / max(1, ar["target_forwards"] - 1),
                             "spec_decode_s": spec["decode_time"], "ar_decode_s": ar["decode_time"],
                             "rows_equal": sum(a.tokens == s.tokens for a, s in zip(ar_gens, spec_gens))})
                print(rows[-1])
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
              "load_average_1min_before_after": [load_before, os.getloadavg()[0]],
              "target": args.target + (" (random weights)" if args.random_init else ""),
              "draft": args.draft + (" (random weights)" if args.random_init else ""),
              "max_new_tokens": args.max_new_tokens, "batch_sizes": batch_sizes, "gammas": gammas,
              "threads": torch.get_num_threads(), "clock": "thread CPU time" if args.cpu_time else "wall",
              "device": {"name": profile.name, "kind": profile.kind, "bandwidth": str(profile.bandwidth),
                         "peak_flops": str(profile.peak_flops)},
              "roofline_label": f"{profile.bandwidth}; {profile.peak_flops}", "rows": rows}
    write_outputs(Path(args.out) / f"batch_{profile.kind}", result, markdown, plot)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
