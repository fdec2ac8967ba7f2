"""How much of the context a draft model must read: acceptance and speed against the draft's window.

    python scripts/draft_window.py          # -> data/bench/draft_window.{json,md,png}

A draft with `window=W` reads the context's first 4 tokens (attention sinks) and its last W
(labkit.drafters.DraftModelDrafter), so its prefill and steps cost the same whatever the prompt's
length; the target still verifies against everything, so every output equals plain decoding's.
On long-prompt questions (data/questions/long_prompts.jsonl, and the 21-question set's
summarization and rag questions) each question runs plain decoding, then the draft at γ = 4 with
every window, back to back in one process: acceptance, tokens per forward, the draft's share of
the time, the prefill share, and the speedups end to end and of the decode phase alone. The
window a draft falls back to (labkit.drafters.draft_model.DEFAULT_WINDOW) is read off it, and the
row 'auto' is what the command line and the bench draft with by default on a CPU: per question,
the whole context where this machine's draft reads it cheaply enough (labkit.drafters.window).
"""
from __future__ import annotations

import argparse
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm

from labkit import DraftModelDrafter, autoregressive_generate, speculative_generate
from labkit.bench.questions import read_questions
from labkit.bench.writer import markdown_table, subplots, write_outputs
from labkit.drafters.draft_model import DEFAULT_WINDOW
from labkit.drafters.window import AutoWindow, WindowCosts
from labkit.models.calibrate import OthersCPU, isa_label, load_average, machine, machine_slug, run_facts
from labkit.models.loading import encode_prompt, load_draft, load_model
from labkit.viz.plots import plot_window_curve

ROOT = Path(__file__).resolve().parents[1]
WINDOWS = (None, 128, 64, "auto")
# what the draft and prefill shares hold: runs before the draft read the prompt when decoding started (at its
# first step instead) counted that read as the draft's time
SHARES = {False: "*draft* = the draft model's share of the time, its first reading of the prompt (or window) "
                 "included; *prefill* = the target's prefill's share",
          True: "*draft* = the draft model's share of the time after the prefill; *prefill* = the share of the "
                "prefill of both models (the draft's of its window)"}


def question_set(limit: int | None) -> list:
    long = read_questions(ROOT / "data/questions/long_prompts.jsonl")
    short = read_questions(ROOT / "data/questions/labkit_bench.jsonl", categories=["summarization", "rag"])
    return (long + short)[:limit]


def run_one(target, draft, ids, window, gamma: int, n: int, costs: WindowCosts | None = None) -> dict:
    chosen = AutoWindow(costs, n, DEFAULT_WINDOW) if window == "auto" else window
    drafter = DraftModelDrafter(draft.model, eos_token_ids=target.eos_token_ids, window=chosen)
    out = speculative_generate(target.model, drafter, ids, n, gamma, eos_token_ids=target.eos_token_ids)
    t = out.trace
    proposed = sum(s.gamma for s in t.steps)
    return {"window": window, "read": "all" if drafter.window is None else drafter.window,
            "tokens": out.tokens, "seconds": t.total_time, "prefill": t.prefill_time,
            "draft": t.draft_time, "forwards": t.n_target_forwards,
            "accepted": sum(s.n_accepted for s in t.steps), "proposed": proposed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, default=None, help="the first N questions only")
    ap.add_argument("--out", default=None, help="default: data/bench/draft_window_<machine>")
    a = ap.parse_args()
    target = load_model("qwen2.5-coder-1.5b-instruct", "bf16", progress=False)
    draft = load_draft("qwen2.5-coder-0.5b-instruct", target, progress=False)
    questions = question_set(a.limit)
    warm = encode_prompt(target.tokenizer, "Say hi.", True)
    autoregressive_generate(target.model, warm, 4), run_one(target, draft, warm, None, a.gamma, 4)
    costs = WindowCosts.measure(target.model, draft.model)
    auto = AutoWindow(costs, a.max_new_tokens, DEFAULT_WINDOW)
    load_before, rows = load_average(), []
    with OthersCPU() as others:
        for q in tqdm(questions, desc="questions"):
            ids = encode_prompt(target.tokenizer, q.prompt, True)
            t0 = time.perf_counter()
            ar = autoregressive_generate(target.model, ids, a.max_new_tokens, eos_token_ids=target.eos_token_ids)
            base = {"seconds": time.perf_counter() - t0, "prefill": ar.trace.prefill_time}
            for w in WINDOWS:
                r = run_one(target, draft, ids, w, a.gamma, a.max_new_tokens, costs)
                rows.append({"question": q.question_id, "category": q.category, "prompt_tokens": ids.numel(),
                             "new_tokens": len(ar.tokens), "exact": r.pop("tokens") == ar.tokens,
                             "ar_seconds": base["seconds"], "ar_prefill": base["prefill"], **r})
    facts = run_facts(target, draft)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "isa": isa_label(), "ran_on": facts, "gamma": a.gamma, "max_new_tokens": a.max_new_tokens,
              "sinks": DraftModelDrafter(draft.model).sinks, "draft_prefill_counted": True, "load_average": {"before": load_before, "after": load_average()},
              "others_cpu": others.cores, "rows": rows, "summary": summary(rows),
              "auto": {"describe": auto.describe(), "longest_whole_prompt": auto.longest_whole_prompt(),
                       "draft_seconds_per_token": costs.draft_seconds_per_token,
                       "target_step_seconds": costs.target_step_seconds}}
    out = Path(a.out) if a.out else ROOT / f"data/bench/draft_window_{machine_slug(result['machine'])}"
    for path in write_outputs(out, result, markdown, plot):
        print(path)


def summary(rows: list[dict]) -> list[dict]:
    """Per window, over every question: acceptance, tokens per forward, draft share, speedups (ratios of sums)."""
    out = []
    for w in WINDOWS:
        rs = [r for r in rows if r["window"] == w]
        ar = sum(r["ar_seconds"] for r in rs)
        out.append({"window": "all" if w is None else w, "acceptance": sum(r["accepted"] for r in rs) / max(1, sum(r["proposed"] for r in rs)),
                    "tokens_per_forward": sum(r["new_tokens"] for r in rs) / sum(r["forwards"] for r in rs),
                    "draft_share": sum(r["draft"] for r in rs) / sum(r["seconds"] for r in rs),
                    "prefill_share": sum(r["prefill"] for r in rs) / sum(r["seconds"] for r in rs),
                    "speedup": ar / sum(r["seconds"] for r in rs),
                    "worst_question": min(r["ar_seconds"] / r["seconds"] for r in rs),
                    "exact": sum(r["exact"] for r in rs), "questions": len(rs)})
    return out


def markdown(result: dict) -> str:
    m, facts = result["machine"], result["ran_on"]
    prompts = [r["prompt_tokens"] for r in result["rows"] if r["window"] is None]
    lines = ["# How much context a draft model reads: acceptance and speed against its window", "",
             f"Measured {result['date']} on {m['cpu']} ({result['isa']}), {m['threads']} threads; target: "
             f"{facts['target']}; draft: {facts['draft']}. Load average {result['load_average']['before'][0]} "
             f"before, {result['load_average']['after'][0]} after; other processes used "
             f"{result['others_cpu']:.2f} cores on average while it ran. Greedy, γ = {result['gamma']}, up to "
             f"{result['max_new_tokens']} new tokens; {len(prompts)} questions with prompts of {min(prompts)} to "
             f"{max(prompts)} tokens (median {statistics.median(prompts):.0f}). A window W: the draft reads the "
             f"first {result['sinks']} tokens and the last W; 'all': the whole context"
             + (f"; 'auto': per question, {result['auto']['describe']} (here: "
                f"{sum(r['read'] == 'all' for r in result['rows'] if r['window'] == 'auto')} of {len(prompts)} "
                "questions read whole)" if "auto" in result else "") + ".", "",
             "*accept* = accepted / proposed draft tokens; *× AR* = plain decoding's seconds over the draft's, "
             "summed over the questions (prefill included); " + SHARES[result.get("draft_prefill_counted", False)] + "; *worst* = "
             "the lowest single-question × AR; *exact* = outputs equal to plain decoding's.", ""]
    lines += markdown_table(result["summary"], {
        "window": "{window}", "accept": "{acceptance:.2f}", "tok/fwd": "{tokens_per_forward:.2f}",
        "draft": "{draft_share:.0%}", "prefill": "{prefill_share:.0%}", "× AR": "{speedup:.2f}",
        "worst": "{worst_question:.2f}", "exact": "{exact}/{questions}"}, "lrrrrrrr")
    return "\n".join(lines) + "\n"


def plot(result: dict):
    fig, (ax1, ax2) = subplots(1, 2, figsize=(10, 3.8))
    plot_window_curve(result["summary"], ax1, ax2)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
