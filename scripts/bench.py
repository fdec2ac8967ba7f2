"""Side-by-side benchmark: labkit's decoders against transformers' generate, same weights, one run.

For every prompt, every method decodes greedily with the same max_new_tokens, in the same
process, interleaved (noise hits all methods alike). Speedups are ratios within a prompt:
over labkit's autoregressive baseline and over transformers' plain generate. Next to each
measured labkit speedup stands Leviathan et al.'s ideal one, from this run's measured
acceptance and measured costs of a draft step and of a verify pass.

    python scripts/bench.py                      # the embedded pair, bf16, 128 new tokens
    python scripts/bench.py --max-new-tokens 32 --limit 1 --out /tmp/quick
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from labkit import (CostAwareGamma, DraftModelDrafter, HeuristicGamma, PromptLookupDrafter, autoregressive_generate,
                    expected_speedup, speculative_generate)
from labkit.cli import encode_prompt
from labkit.hub import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_model
from labkit.loading import DTYPES, check_same_tokenizer, load_model

ROOT = Path(__file__).resolve().parents[1]


def labkit_methods(target, draft, eos, n, gamma):
    """name -> fn(prompt_ids) -> (new tokens, trace)."""
    def spec(drafter, policy):
        def run(ids):
            out = speculative_generate(target.model, drafter(), ids, n, policy(), eos_token_ids=eos)
            return out.tokens, out.trace
        return run

    def ar(ids):
        out = autoregressive_generate(target.model, ids, n, eos_token_ids=eos)
        return out.tokens, out.trace

    draft_model = lambda: DraftModelDrafter(draft.model, eos_token_ids=eos)  # noqa: E731
    return {
        "labkit autoregressive": ar,
        f"labkit draft γ={gamma}": spec(draft_model, lambda: gamma),
        "labkit draft heuristic γ": spec(draft_model, lambda: HeuristicGamma(gamma)),
        "labkit draft cost-aware γ": spec(draft_model, lambda: CostAwareGamma(gamma)),
        f"labkit lookup γ={gamma}": spec(PromptLookupDrafter, lambda: gamma),
        "labkit lookup cost-aware γ": spec(PromptLookupDrafter, lambda: CostAwareGamma(gamma)),
    }


def hf_methods(hf_target, hf_draft, eos, n, lookup_tokens):
    def gen(**kw):
        def run(ids):
            with torch.no_grad():
                out = hf_target.generate(ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=n,
                                         do_sample=False, eos_token_id=list(eos), pad_token_id=eos[0], **kw)
            return out[0, ids.numel():].tolist(), None
        return run
    return {"transformers generate": gen(),
            "transformers assisted": gen(assistant_model=hf_draft),
            f"transformers prompt_lookup={lookup_tokens}": gen(prompt_lookup_num_tokens=lookup_tokens)}


def first_difference(tokens: list[int], reference: list[int]) -> int | None:
    """Index of the first token where two outputs part (None when equal)."""
    if tokens == reference:
        return None
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def ideal_speedup(trace, ar_step: float) -> float | None:
    """Leviathan's speedup for this run's measured acceptance rate and costs (γ = mean draft length)."""
    steps = [s for s in trace.steps if s.gamma > 0]
    if not steps:
        return None
    accepted = sum(s.n_accepted for s in steps)
    rejections = sum(0 if s.bonus else 1 for s in steps)
    alpha = accepted / max(1, accepted + rejections)
    gamma = round(statistics.mean(s.gamma for s in steps))
    draft_cost = sum(s.draft_time for s in steps) / sum(s.gamma for s in steps) / ar_step
    verify_cost = statistics.mean(s.verify_time for s in steps) / ar_step
    return expected_speedup(alpha, gamma, draft_cost, verify_cost)


def run_benchmark(a) -> dict:
    torch.set_num_threads(a.threads)
    target = load_model(a.target, a.dtype)
    draft = load_model(a.draft, a.dtype)
    check_same_tokenizer(target, draft)
    from transformers import AutoModelForCausalLM
    hf_target = AutoModelForCausalLM.from_pretrained(resolve_model(a.target), dtype=DTYPES[a.dtype]).eval()
    hf_draft = AutoModelForCausalLM.from_pretrained(resolve_model(a.draft), dtype=DTYPES[a.dtype]).eval()
    eos = target.eos_token_ids
    methods = {**labkit_methods(target, draft, eos, a.max_new_tokens, a.gamma),
               **hf_methods(hf_target, hf_draft, eos, a.max_new_tokens, a.lookup_tokens)}
    prompts = [json.loads(line) for line in Path(a.prompts).read_text().splitlines() if line.strip()][: a.limit]
    warm_up = {**labkit_methods(target, draft, eos, 8, a.gamma), **hf_methods(hf_target, hf_draft, eos, 8, 4)}
    for fn in tqdm(warm_up.values(), desc="warm-up"):                  # first calls allocate; not timed
        fn(encode_prompt(target.tokenizer, "Say hi.", True))
    rows = []
    for p in tqdm(prompts, desc="prompts"):
        ids = encode_prompt(target.tokenizer, p["prompt"], True)
        results = {}
        for name, fn in tqdm(methods.items(), desc=p["id"], leave=False):
            t0 = time.perf_counter()
            tokens, trace = fn(ids)
            results[name] = (tokens, trace, time.perf_counter() - t0)
        base_tokens, base_trace, base_time = results["labkit autoregressive"]
        hf_time = results["transformers generate"][2]
        ar_step = statistics.median(s.verify_time for s in base_trace.steps[:-1])
        for name, (tokens, trace, seconds) in results.items():
            rows.append({
                "prompt": p["id"], "category": p["category"], "method": name, "new_tokens": len(tokens),
                "seconds": seconds, "tokens_per_second": len(tokens) / seconds,
                "speedup_vs_labkit_ar": base_time / seconds * len(tokens) / len(base_tokens),
                "speedup_vs_transformers": hf_time / seconds * len(tokens) / len(results["transformers generate"][0]),
                "tokens_per_forward": trace.tokens_per_forward if trace else None,
                "acceptance_rate": trace.acceptance_rate if trace and trace.steps[0].gamma else None,
                "ideal_speedup": ideal_speedup(trace, ar_step) if trace else None,
                "draft_share": trace.draft_time / seconds if trace else None,
                "verify_share": trace.verify_time / seconds if trace else None,
                "equals_baseline": tokens == base_tokens,
                "first_difference": first_difference(tokens, base_tokens),
            })
    return {"meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "target": a.target,
                     "draft": a.draft, "dtype": a.dtype, "max_new_tokens": a.max_new_tokens, "gamma": a.gamma,
                     "threads": a.threads, "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
                     f"torch {torch.__version__}", "prompts": a.prompts}, "rows": rows}


def summarise(result: dict) -> str:
    """Markdown: per category and method, total tokens over total time, and the mean ratios."""
    rows, meta = result["rows"], result["meta"]
    lines = [f"Measured {meta['date']} on {meta['machine']}; target {meta['target']}, draft {meta['draft']}, "
             f"{meta['dtype']}, greedy, max_new_tokens={meta['max_new_tokens']}. Speedups are per-prompt time "
             "ratios, averaged; tokens/forward includes the bonus/correction token. 'same tokens as AR' compares "
             "with labkit's autoregressive output; where a run parts from it, the token index is given: in bf16 a "
             "k-token verify forward rounds differently from a 1-token forward, so near-ties can flip (in fp32 the "
             "integration tests show token-for-token equality).", "",
             "| category | method | tok/s | × labkit AR | × transformers | tokens/forward | acceptance | ideal × | "
             "same tokens as AR |", "|---|---|---|---|---|---|---|---|---|"]

    def fmt(x, spec="{:.2f}"):
        return "–" if x is None else spec.format(x)

    for cat in sorted({r["category"] for r in rows}):
        for method in dict.fromkeys(r["method"] for r in rows):
            rs = [r for r in rows if r["category"] == cat and r["method"] == method]
            mean = lambda k: statistics.mean(r[k] for r in rs) if rs[0][k] is not None else None  # noqa: E731
            tps = sum(r["new_tokens"] for r in rs) / sum(r["seconds"] for r in rs)
            diffs = [str(r["first_difference"]) for r in rs if r["first_difference"] is not None]
            same = f"{sum(r['equals_baseline'] for r in rs)}/{len(rs)}" + (f" (parts at {', '.join(diffs)})" if diffs else "")
            lines.append(f"| {cat} | {method} | {tps:.2f} | {fmt(mean('speedup_vs_labkit_ar'))} | "
                         f"{fmt(mean('speedup_vs_transformers'))} | {fmt(mean('tokens_per_forward'))} | "
                         f"{fmt(mean('acceptance_rate'))} | {fmt(mean('ideal_speedup'))} | {same} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--prompts", default=str(ROOT / "data/prompts/core_bench.jsonl"))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--lookup-tokens", type=int, default=10, help="transformers' prompt_lookup_num_tokens (its docs' value)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--limit", type=int, default=None, help="first N prompts only")
    ap.add_argument("--out", default=str(ROOT / "data/bench"))
    a = ap.parse_args(argv)
    result = run_benchmark(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "core.json").write_text(json.dumps(result, indent=1))
    (out / "core.md").write_text(summarise(result))
    print(summarise(result))


if __name__ == "__main__":
    main()
