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

    python scripts/draft_window.py --drafter eagle3   # -> data/bench/head_window_<machine>.{json,md,png}

The same for the EAGLE-3 head (labkit.drafters.eagle, `window=`) with its dynamic tree of up to 64 nodes and the
cost-aware budget, as the bench runs it: the head reads the first 4 committed pairs and the last W of a long
prompt, or all of them.
"""
from __future__ import annotations

import argparse
import inspect
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm

from labkit import DraftModelDrafter, autoregressive_generate, speculative_generate
from labkit.bench.methods import EAGLE_DEPTH, EAGLE_TOP_K, verify_curve
from labkit.bench.questions import read_questions
from labkit.bench.writer import markdown_table, subplots, write_outputs
from labkit.decoding.tree import tree_generate
from labkit.drafters.draft_model import DEFAULT_WINDOW, draft_reading
from labkit.drafters.eagle import EagleDrafter
from labkit.drafters.window import AutoWindow, WindowCosts
from labkit.files.shipped import shipped
from labkit.models.calibrate import (
    OthersCPU,
    isa_label,
    load_average,
    machine,
    machine_slug,
    run_facts,
)
from labkit.models.eagle_heads import load_eagle3
from labkit.models.loading import encode_prompt, load_draft, load_model
from labkit.tuning import CostAwareBudget, Shadowed
from labkit.viz.plots import plot_window_curve

ROOT = Path(__file__).resolve().parents[1]
WINDOWS = (None, 128, 64, "auto")
HEAD_WINDOWS = (None, 256, 64)
# what the draft and prefill shares hold: runs before the draft read the prompt when decoding started (at its
# first step instead) counted that read as the draft's time
SHARES = {False: "*draft* = the draft model's share of the time, its first reading of the prompt (or window) "
                 "included; *prefill* = the target's prefill's share",
          True: "*draft* = the draft model's share of the time after the prefill; *prefill* = the share of the "
                "prefill of both models (the draft's of its window)",
          "heads": "*draft* = the head's share of the time, its first reading of the prompt (or window) included; "
                   "*prefill* = the target's prefill's share"}


def question_set(limit: int | None) -> list:
    long = read_questions(ROOT / "data/questions/long_prompts.jsonl")
    short = read_questions(ROOT / "data/questions/labkit_bench.jsonl", categories=["summarization", "rag"])
    return (long + short)[:limit]


def run_head(target, head, vocab, ids, window, n: int, curve: dict[int, float]) -> dict:
    """The EAGLE-3 head's dynamic tree with the cost-aware budget, the head reading `window` pairs of the prompt."""
    drafter = EagleDrafter(head, target.model, vocab, top_k=EAGLE_TOP_K, depth=EAGLE_DEPTH, window=window)
    budget = Shadowed(CostAwareBudget(max_budget=64, verify_curve=curve), drafter)
    out = tree_generate(target.model, drafter, ids, n, budget, eos_token_ids=target.eos_token_ids)
    t = out.trace
    return {"window": window, "read": "all" if window is None else window, "tokens": out.tokens,
            "seconds": t.total_time, "prefill": t.prefill_time, "draft": t.draft_time,
            "forwards": t.n_target_forwards, "accepted": sum(s.n_accepted for s in t.steps),
            "proposed": sum(len(s.proposed) for s in t.steps)}


def run_one(target, draft, ids, window, gamma: int, n: int, costs: WindowCosts | None = None) -> dict:
    chosen = AutoWindow(costs, n, DEFAULT_WINDOW) if window == "auto" else window
    drafter = DraftModelDrafter(draft_reading(draft.model, chosen), eos_token_ids=target.eos_token_ids)
    out = speculative_generate(target.model, drafter, ids, n, gamma, eos_token_ids=target.eos_token_ids)
    t = out.trace
    proposed = sum(s.gamma for s in t.steps)
    read = getattr(drafter.reading, "window", None)                  # None: the whole context
    return {"window": window, "read": "all" if read is None else read,
            "tokens": out.tokens, "seconds": t.total_time, "prefill": t.prefill_time,
            "draft": t.draft_time, "forwards": t.n_target_forwards,
            "accepted": sum(s.n_accepted for s in t.steps), "proposed": proposed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, default=None, help="the first N questions only")
    ap.add_argument("--out", default=None,
                    help="default: data/bench/draft_window_<machine> (head_window_<machine> for --drafter eagle3)")
    ap.add_argument("--windows", default=None,
                    help="comma-separated: token counts, 'all' (the whole context), 'auto' (the draft only; default: "
                         f"{','.join('all' if w is None else str(w) for w in WINDOWS)}, for the head "
                         f"{','.join('all' if w is None else str(w) for w in HEAD_WINDOWS)})")
    ap.add_argument("--drafter", choices=("draft", "eagle3"), default="draft",
                    help="the draft model at a fixed γ, or the EAGLE-3 head's cost-aware tree")
    a = ap.parse_args()
    heads = a.drafter == "eagle3"
    windows = [parse_window(w) for w in a.windows.split(",")] if a.windows else list(HEAD_WINDOWS if heads else WINDOWS)
    if heads and "auto" in windows:
        raise SystemExit("--windows auto is the draft model's rule: give the head token counts or 'all'")
    target = load_model("qwen2.5-coder-1.5b-instruct", "bf16", progress=False)
    questions = question_set(a.limit)
    warm = encode_prompt(target.tokenizer, "Say hi.", True)
    if heads:
        head, vocab, _ = load_eagle3(shipped("heads", "eagle3-qwen2.5-coder-1.5b"), target.model)
        curve = verify_curve(target.model)
        run = lambda ids, w, n: run_head(target, head, vocab, ids, w, n, curve)       # noqa: E731
        draft = costs = auto = None
    else:
        draft = load_draft("qwen2.5-coder-0.5b-instruct", target, progress=False)
        costs = WindowCosts.measure(target.model, draft.model)
        auto = AutoWindow(costs, a.max_new_tokens, DEFAULT_WINDOW)
        run = lambda ids, w, n: run_one(target, draft, ids, w, a.gamma, n, costs)      # noqa: E731
    autoregressive_generate(target.model, warm, 4), run(warm, None, 4)
    load_before, rows = load_average(), []
    with OthersCPU() as others:
        for q in tqdm(questions, desc="questions"):
            ids = encode_prompt(target.tokenizer, q.prompt, True)
            t0 = time.perf_counter()
            ar = autoregressive_generate(target.model, ids, a.max_new_tokens, eos_token_ids=target.eos_token_ids)
            base = {"seconds": time.perf_counter() - t0, "prefill": ar.trace.prefill_time}
            for w in windows:
                r = run(ids, w, a.max_new_tokens)
                rows.append({"question": q.question_id, "category": q.category, "prompt_tokens": ids.numel(),
                             "new_tokens": len(ar.tokens), "exact": r.pop("tokens") == ar.tokens,
                             "ar_seconds": base["seconds"], "ar_prefill": base["prefill"], **r})
    facts = run_facts(target, draft)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "isa": isa_label(), "ran_on": facts, "gamma": a.gamma, "max_new_tokens": a.max_new_tokens,
              "sinks": inspect.signature(EagleDrafter if heads else DraftModelDrafter).parameters["sinks"].default,
              "draft_prefill_counted": True,
              "load_average": {"before": load_before, "after": load_average()},
              "others_cpu": others.cores, "rows": rows, "summary": summary(rows)}
    if heads:
        result["drafter"] = "eagle3"
    else:
        result["auto"] = {"describe": auto.describe(), "longest_whole_prompt": auto.longest_whole_prompt(),
                          "draft_seconds_per_token": costs.draft_seconds_per_token,
                          "target_step_seconds": costs.target_step_seconds}
    name = "head_window" if heads else "draft_window"
    out = Path(a.out) if a.out else ROOT / f"data/bench/{name}_{machine_slug(result['machine'])}"
    for path in write_outputs(out, result, markdown, plot):
        print(path)


def parse_window(text: str) -> int | str | None:
    """'all' -> None (the whole context), 'auto', or a number of tokens >= 1."""
    if text in ("all", "auto"):
        return None if text == "all" else text
    if not text.isdigit() or int(text) < 1:
        raise SystemExit(f"--windows takes token counts >= 1, 'all' or 'auto', got {text!r}")
    return int(text)


def summary(rows: list[dict]) -> list[dict]:
    """Per window, over every question: acceptance, tokens per forward, draft share, speedups (ratios of sums)."""
    out = []
    for w in dict.fromkeys(r["window"] for r in rows):
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
    first = result["rows"][0]["window"]                                # every question ran every window
    prompts = [r["prompt_tokens"] for r in result["rows"] if r["window"] == first]
    heads = result.get("drafter") == "eagle3"
    who = "the EAGLE-3 head" if heads else "the draft"
    lines = [f"# How much context {'the EAGLE-3 head' if heads else 'a draft model'} reads: acceptance and speed "
             "against its window", "",
             f"Measured {result['date']} on {m['cpu']} ({result['isa']}), {m['threads']} threads; target: "
             f"{facts['target']}" + ("" if heads else f"; draft: {facts['draft']}") + ". Load average "
             f"{result['load_average']['before'][0]} before, {result['load_average']['after'][0]} after; other "
             f"processes used {result['others_cpu']:.2f} cores on average while it ran. Greedy, "
             + ("the head's dynamic tree of up to 64 nodes with the cost-aware budget" if heads
                else f"γ = {result['gamma']}") + f", up to "
             f"{result['max_new_tokens']} new tokens; {len(prompts)} questions with prompts of {min(prompts)} to "
             f"{max(prompts)} tokens (median {statistics.median(prompts):.0f}). A window W: {who} reads the "
             f"first {result['sinks']} " + ("committed pairs (feature, token)" if heads else "tokens")
             + " and the last W; 'all': the whole context"
             + (f"; 'auto': per question, {result['auto']['describe']} (here: "
                f"{sum(r['read'] == 'all' for r in result['rows'] if r['window'] == 'auto')} of {len(prompts)} "
                "questions read whole)" if "auto" in result else "") + ".", "",
             "*accept* = accepted / proposed draft tokens" + (" (tree nodes)" if heads else "") + "; *× AR* = "
             "plain decoding's seconds over the drafter's, "
             "summed over the questions (prefill included); "
             + SHARES["heads" if heads else result.get("draft_prefill_counted", False)] + "; *worst* = "
             "the lowest single-question × AR; *exact* = outputs equal to plain decoding's.", ""]
    lines += markdown_table(result["summary"], {
        "window": "{window}", "accept": "{acceptance:.2f}", "tok/fwd": "{tokens_per_forward:.2f}",
        "draft": "{draft_share:.0%}", "prefill": "{prefill_share:.0%}", "× AR": "{speedup:.2f}",
        "worst": "{worst_question:.2f}", "exact": "{exact}/{questions}"}, "lrrrrrrr")
    return "\n".join(lines) + "\n"


def plot(result: dict):
    fig, (ax1, ax2) = subplots(1, 2, figsize=(10, 3.8))
    plot_window_curve(result["summary"], ax1, ax2, "EAGLE-3 head" if result.get("drafter") == "eagle3" else "draft")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
