"""Tree drafters against a chain on code prompts: tokens per target forward and speedup over autoregressive.

    python scripts/bench_heads.py            # -> data/bench/heads.json, data/bench/heads.md

Greedy, the embedded bf16 target, the same code prompts for every method: the three `coding`
questions of data/questions/labkit_bench.jsonl and the three code prompts of
data/prompts/core_bench.jsonl. Each prompt runs every method back to back in one process
(autoregressive first), so every speedup is a ratio of times measured side by side.
Tokens per forward count every committed token, the bonus/correction token included.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm

from labkit import DraftModelDrafter, autoregressive_generate, load_model, speculative_generate
from labkit.cli import encode_prompt
from labkit.heads.checkpoint import REPO_HEADS, load_medusa
from labkit.heads.eagle import EagleDrafter, load_eagle
from labkit.heads.medusa import MedusaDrafter, typical_accept_rule
from labkit.tree_decoding import tree_generate

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
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    ap.add_argument("--out", default=str(ROOT / "data/bench/heads"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model("qwen2.5-coder-1.5b-instruct", "bf16", progress=False)
    draft = load_model("qwen2.5-coder-0.5b-instruct", "bf16", progress=False)
    model, eos, n = target.model, target.eos_token_ids, args.max_new_tokens
    heads, medusa_cfg = load_medusa(REPO_HEADS / "medusa-qwen2.5-coder-1.5b", model)
    eagle, vocab, eagle_cfg = load_eagle(REPO_HEADS / "eagle-qwen2.5-coder-1.5b", model)
    choices = [tuple(c) for c in medusa_cfg["choices"]]

    methods = {   # name -> (node budget, run(ids))
        "draft model chain, γ=4": (4, lambda ids: speculative_generate(model, DraftModelDrafter(draft.model, eos_token_ids=eos),
                                                                      ids, n, 4, eos_token_ids=eos)),
        "Medusa tree": (32, lambda ids: tree_generate(model, MedusaDrafter(heads, choices), ids, n, 32, eos_token_ids=eos)),
        "Medusa tree, typical acceptance ε=0.09": (32, lambda ids: tree_generate(
            model, MedusaDrafter(heads, choices), ids, n, 32, eos_token_ids=eos,
            accept_rule=typical_accept_rule(epsilon=0.09, delta=0.3))),
        "EAGLE chain (depth 6)": (6, lambda ids: tree_generate(model, EagleDrafter(eagle, model, vocab, 1, 6), ids, n, 6,
                                                                eos_token_ids=eos)),
        "EAGLE-2 tree (top-8, depth 6)": (32, lambda ids: tree_generate(model, EagleDrafter(eagle, model, vocab, 8, 6),
                                                                         ids, n, 32, eos_token_ids=eos)),
    }
    prompts = code_prompts()[: args.limit]
    autoregressive_generate(model, encode_prompt(target.tokenizer, "hi", True), 4)       # warm-up
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
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.processor() or platform.machine(),
              "threads": args.threads, "dtype": "bf16", "max_new_tokens": n, "prompts": [p for p, _ in prompts],
              "load_average_after": list(__import__("os").getloadavg()),
              "note": "tokens per forward includes the bonus/correction token; speedup = (tokens/s) / (autoregressive "
                      "tokens/s), measured side by side per prompt; 'same text' compares with bf16 greedy decoding",
              "rows": rows, "per_prompt": per_prompt,
              "medusa": {"topk_accuracy_top1": [a[0] for a in medusa_cfg["topk_accuracy"]]},
              "eagle": {"heldout_top1": eagle_cfg["heldout"]["top1"]}}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["| method | node budget | tokens / forward | speedup | same text as greedy |", "|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['node budget']} | {r['tokens per forward']:.2f} | {r['speedup']:.2f}x | "
              f"{r['same text as greedy']} |" for r in rows]
    out.with_suffix(".md").write_text(f"Greedy, bf16 target, {len(prompts)} code prompts x {n} new tokens, "
                                      f"{args.threads} threads, {result['date']}.\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
