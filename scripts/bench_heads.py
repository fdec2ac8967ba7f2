"""Tree drafters against a chain on code prompts: tokens per target forward and speedup over autoregressive.

    python scripts/bench_heads.py            # -> data/bench/heads.json, data/bench/heads.md

Greedy, the embedded target (bf16 by default, on the forward path this machine measured fastest;
the draft in its own cheapest precision), the same code prompts for every method: the three
`coding` questions of data/questions/labkit_bench.jsonl and the three code prompts of
data/prompts/core_bench.jsonl. Each prompt runs every method back to back in one process
(autoregressive first), so every speedup is a ratio of times measured side by side.
Tokens per forward count every committed token, the bonus/correction token included.
The script also measures the verify cost curve (one forward of T tokens after a 100-token
prefix) on the same path, since it decides what a tree can gain.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm

from labkit import (
    DraftModelDrafter,
    autoregressive_generate,
    load_model,
    speculative_generate,
)
from labkit.bench.writer import markdown_table, write_outputs
from labkit.core.typical import typical_accept_rule
from labkit.decoding.tree import tree_generate
from labkit.drafters.eagle import EagleDrafter
from labkit.drafters.medusa import MedusaDrafter
from labkit.models.calibrate import run_facts, time_forwards
from labkit.models.eagle_heads import load_eagle
from labkit.models.loading import encode_prompt, load_draft
from labkit.models.medusa_heads import REPO_HEADS, load_medusa

ROOT = Path(__file__).resolve().parents[1]


def code_prompts() -> list[tuple[str, str]]:
    out = []
    for line in (ROOT / "data/questions/labkit_bench.jsonl").read_text().splitlines():
        q = json.loads(line)
        if q["category"] == "coding":
            out.append((q["question_id"], q["turns"][0]))
    for line in (ROOT / "data/prompts/core_bench.jsonl").read_text().splitlines():
        p = json.loads(line)
        if p["category"] == "code":
            out.append((p["id"], p["prompt"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    ap.add_argument("--out", default=str(ROOT / "data/bench/heads"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = list(os.getloadavg())
    target = load_model("qwen2.5-coder-1.5b-instruct", args.dtype, progress=False)
    draft = load_draft("qwen2.5-coder-0.5b-instruct", target, progress=False)
    facts = run_facts(target, draft)
    model, eos, n = target.model, target.eos_token_ids, args.max_new_tokens
    heads, medusa_cfg = load_medusa(REPO_HEADS / "medusa-qwen2.5-coder-1.5b", model)
    eagle_head, vocab, eagle_cfg = load_eagle(REPO_HEADS / "eagle-qwen2.5-coder-1.5b", model)
    choices = [tuple(c) for c in medusa_cfg["choices"]]

    def medusa(budget, rule=None):
        return lambda ids: tree_generate(model, MedusaDrafter(heads, choices), ids, n, budget, eos_token_ids=eos,
                                         accept_rule=rule)

    def eagle(top_k, depth, budget):
        return lambda ids: tree_generate(model, EagleDrafter(eagle_head, model, vocab, top_k, depth), ids, n, budget,
                                         eos_token_ids=eos)

    methods = {   # name -> (node budget, run(ids))
        "draft model chain, γ=4": (4, lambda ids: speculative_generate(
            model, DraftModelDrafter(draft.model, eos_token_ids=eos), ids, n, 4, eos_token_ids=eos)),
        "Medusa tree": (16, medusa(16)),
        "Medusa tree, typical acceptance ε=0.09": (16, medusa(16, typical_accept_rule(epsilon=0.09, delta=0.3))),
        "EAGLE chain (depth 6)": (6, eagle(1, 6, 6)),
        "EAGLE-2 tree (top-4, depth 6)": (16, eagle(4, 6, 16)),
        "EAGLE-2 tree (top-8, depth 6)": (32, eagle(8, 6, 32)),
    }
    prompts = code_prompts()[: args.limit]
    autoregressive_generate(model, encode_prompt(target.tokenizer, "hi", True), 4)       # warm-up
    verify_cost = {T: round(t, 4) for T, t in time_forwards(model, 100, (1, 5, 7, 17, 33), repeats=3).items()}
    print("seconds per target forward of T tokens:", verify_cost)
    per_prompt = []
    for pid, text in tqdm(prompts, desc="prompts"):
        ids = encode_prompt(target.tokenizer, text, True)
        t0 = time.perf_counter()
        ar = autoregressive_generate(model, ids, n, eos_token_ids=eos)
        record = {"prompt": pid, "ar": {"tokens": len(ar.tokens), "seconds": time.perf_counter() - t0}}
        for name, (budget, run) in methods.items():
            t0 = time.perf_counter()
            out = run(ids)
            seconds = time.perf_counter() - t0
            same = next((i for i, (a, b) in enumerate(zip(out.tokens, ar.tokens)) if a != b),
                        min(len(out.tokens), len(ar.tokens)))
            record[name] = {"tokens": len(out.tokens), "forwards": out.trace.n_target_forwards, "seconds": seconds,
                            "exact": out.tokens == ar.tokens, "equal_prefix": same}
        per_prompt.append(record)

    rows = [{"method": "autoregressive", "node budget": 0, "tokens per forward": 1.0, "speedup": 1.0,
             "same text as greedy": f"{len(per_prompt)}/{len(per_prompt)}"}]
    ar_seconds = sum(r["ar"]["seconds"] for r in per_prompt)
    ar_tokens = sum(r["ar"]["tokens"] for r in per_prompt)
    for name, (budget, _) in methods.items():
        tokens = sum(r[name]["tokens"] for r in per_prompt)
        rows.append({"method": name, "node budget": budget,
                     "tokens per forward": round(tokens / sum(r[name]["forwards"] for r in per_prompt), 2),
                     "speedup": round((tokens / sum(r[name]["seconds"] for r in per_prompt)) / (ar_tokens / ar_seconds), 2),
                     "same text as greedy": f"{sum(r[name]['exact'] for r in per_prompt)}/{len(per_prompt)}"})
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "ran_on": facts,
              "threads": args.threads, "dtype": args.dtype, "load_average_before": load_before,
              "verify_seconds_by_tokens": verify_cost, "max_new_tokens": n, "prompts": [p for p, _ in prompts],
              "load_average_after": list(os.getloadavg()),
              "note": "tokens per forward includes the bonus/correction token; speedup = (tokens/s) / (autoregressive "
                      "tokens/s), measured side by side per prompt; 'same text' compares with greedy decoding in the same dtype",
              "rows": rows, "per_prompt": per_prompt,
              "medusa": {"topk_accuracy_top1": [a[0] for a in medusa_cfg["topk_accuracy"]]},
              "eagle": {"heldout_top1": eagle_cfg["heldout"]["top1"]}}
    # --out names the files without their suffix; a suffix given (heads.json) is replaced
    write_outputs(Path(args.out).with_suffix(""), result, markdown, json_newline=True)
    print("\n".join(table(rows)))


def table(rows: list[dict]) -> list[str]:
    return markdown_table(rows, {"method": "{method}", "node budget": "{node budget}",
                                 "tokens / forward": "{tokens per forward:.2f}", "speedup": "{speedup:.2f}x",
                                 "same text as greedy": "{same text as greedy}"})


def markdown(result: dict) -> str:
    """heads.md, from the result (or from heads.json, whose verify-cost keys are strings)."""
    facts = result["ran_on"]
    verify_cost = {str(T): s for T, s in result["verify_seconds_by_tokens"].items()}
    cost = ", ".join(f"{T}: {s / verify_cost['1']:.2f}x" for T, s in verify_cost.items())
    return (f"Greedy, {len(result['prompts'])} code prompts x {result['max_new_tokens']} new tokens, {facts['cpu']} "
            f"({facts['isa']}), {result['threads']} threads, target: {facts['target']}, draft: {facts['draft']}; "
            f"load average {result['load_average_before'][0]:.2f} before, {result['load_average_after'][0]:.2f} after; "
            f"{result['date']}. Tokens per forward include the bonus/correction token.\n\n"
            f"Cost of one target forward over T tokens, relative to T = 1: {cost}.\n\n"
            + "\n".join(table(result["rows"])) + "\n")


if __name__ == "__main__":
    main()
