"""What a plain step of each speculative loop costs against plain decoding's own step, side by side.

    python scripts/plain_step_cost.py --questions qa-3,rag-2 --methods eagle3-cost-aware,medusa-cost-aware

A cost-aware method that judges drafting not worth it takes plain steps (γ = 0, budget 0): one target
token a forward, as plain decoding does. What it still pays on top is its loop's bookkeeping, its
drafter's shadows and, for a tree drafter, its target's features. This script runs plain decoding and each
method on the same questions in one process, in rounds (the order alternating), and reports per question
the fastest round's seconds per decode step (after the prefill) and per target forward, for the methods'
runs that took plain steps only. A method's excess over plain decoding is what its plain steps cost
beyond the forward: -> data/bench/plain_step_cost_<cpu>_<isa>.{json,md}.
"""
from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from labkit.bench.methods import method
from labkit.bench.questions import read_questions
from labkit.bench.runner import BenchConfig, encode, load_models
from labkit.bench.writer import markdown_table, write_outputs
from labkit.models.calibrate import isa_label, load_average, machine, machine_slug

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", default="qa-3,rag-2", help="question ids of the 21-question set (comma-separated)")
    ap.add_argument("--question-file", default=str(ROOT / "data/questions/labkit_bench.jsonl"))
    ap.add_argument("--methods", default="eagle3-cost-aware,medusa-cost-aware")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "data/bench"))
    a = ap.parse_args()
    if a.rounds < 2:
        raise SystemExit("--rounds must be >= 2 (the first round warms up and does not count)")
    names = ["ar"] + [n for n in a.methods.split(",") if n]
    wanted = [q for q in a.questions.split(",") if q]
    questions = [q for q in read_questions(a.question_file) if q.question_id in wanted]
    if len(questions) != len(wanted):
        raise SystemExit(f"--questions: not all of {wanted} are in {a.question_file}")
    torch.set_num_threads(a.threads)
    m, load0 = machine(), load_average()
    config = BenchConfig(questions=a.question_file, out=a.out, methods=names, dtype=a.dtype, backend="packed",
                         threads=a.threads)
    models = load_models(config, progress=False)
    runs = {n: method(n).build(models, config.max_new_tokens, config.gamma, config.lookup_tokens) for n in names}
    prompts = {q.question_id: encode(models, q, config.chat_template) for q in questions}
    best: dict[tuple[str, str], dict] = {}
    for r in range(a.rounds):
        for q in questions:
            for name in (names if r % 2 == 0 else names[::-1]):
                t0 = time.perf_counter()
                trace = runs[name](prompts[q.question_id]).generation.trace
                wall = time.perf_counter() - t0
                plain = all(not s.proposed for s in trace.steps)
                decode = (wall - trace.prefill_time) / len(trace.steps)
                forward = sum(s.verify_time for s in trace.steps) / len(trace.steps)
                shadows = sum(s.draft_time for s in trace.steps) / len(trace.steps)   # a plain step's: its shadow
                row = {"question": q.question_id, "method": name, "steps": len(trace.steps), "plain": plain,
                       "step_ms": decode * 1e3, "forward_ms": forward * 1e3, "shadow_ms": shadows * 1e3, "round": r}
                key = (q.question_id, name)
                if r > 0 and plain and (key not in best or row["step_ms"] < best[key]["step_ms"]):
                    best[key] = row
    rows = []
    for q in questions:
        base = best.get((q.question_id, "ar"))
        for name in names:
            row = best.get((q.question_id, name))
            if row is None or base is None:
                continue
            outside = row["step_ms"] - row["forward_ms"]
            rows.append({**row, "excess_ms": row["step_ms"] - base["step_ms"], "outside_forward_ms": outside,
                         "loop_ms": outside - row["shadow_ms"], "ratio": row["step_ms"] / base["step_ms"]})
    facts = {"cpu": m["cpu"], "isa": isa_label(m), "threads": a.threads, "torch": m["torch"], "dtype": a.dtype,
             "rounds": a.rounds, "load_average": {"before": load0, "after": load_average()},
             "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    table = "\n".join(markdown_table(rows, {
        "question": "{question}", "method": "{method}", "steps": "{steps}", "ms a decode step": "{step_ms:.2f}",
        "of it in the forward": "{forward_ms:.2f}", "outside it": "{outside_forward_ms:.2f}",
        "of that, shadows": "{shadow_ms:.2f}", "the loop": "{loop_ms:.2f}",
        "over plain decoding's step": "{excess_ms:+.2f} ({ratio:.3f}x)"}))
    md = (f"# A plain step of each loop against plain decoding's\n\n{m['cpu']} ({isa_label(m)}), {a.threads} threads, "
          f"torch {m['torch']}; the target in {a.dtype} on the packed path; load average {load0[0]} before, "
          f"{facts['load_average']['after'][0]} after; {facts['date']}. Plain decoding and each method on the same "
          f"questions in one process, {a.rounds} rounds in alternating order (the first warms up); per question "
          "and method the fastest round whose steps were all plain. *ms a decode step*: the wall time after the "
          "prefill over the steps; *of it in the forward*: the target's forward (the trace's verify time); *shadows*: "
          "the drafter's unverified proposals, spread over the steps (the first reads the prompt: an EAGLE head's "
          "catch-up); *the loop*: the rest, its bookkeeping.\n\n"
          + table + "\n")
    write_outputs(Path(a.out) / f"plain_step_cost_{machine_slug(m)}", {"facts": facts, "rows": rows}, md)
    print(md)


if __name__ == "__main__":
    main()
