"""The packed path's blocks fused into one C++ call against the same modules called one by one from Python.

    python scripts/fused_blocks.py --precision int4 --out data/bench/fused_blocks_CPU

One process, the same weights both ways (the fused and the module-by-module model share them), timed side by
side: the forward-cost curve t(T) after 256 cached tokens of the target and the draft (best of --repeats, in
rounds), then plain and speculative decoding (the draft model, cost-aware γ) of --tokens new tokens on the first
question of each category of the question set, each way, best of two rounds. Writes fused_blocks.json and .md
with the CPU, its ISA, the path, the precision and the load average.
"""
from __future__ import annotations

import copy
import json
import os
import time

from pair_script import load_pair, pair_options

WIDTHS = (1, 2, 4, 8, 16)


def main() -> None:
    from labkit import DraftModelDrafter, autoregressive_generate, speculative_generate
    from labkit.models.calibrate import isa_label, machine, time_forward_rounds
    from labkit.models.fused import use_fused
    from labkit.models.loading import encode_prompt
    from labkit.tuning import CostAwareGamma, Shadowed
    p = pair_options(__doc__, repeats=7)
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args()
    target, draft, load_before = load_pair(a.precision)
    ways = {}
    for name, m in (("target", target.model), ("draft", draft.model)):
        modules = copy.copy(m)                                # the same modules and weights; only the flag differs
        if not use_fused(m, True) or use_fused(modules, False):
            raise SystemExit(f"the {name}'s blocks cannot run fused on the {m.path}")
        ways[name] = {"fused": m, "modules": modules}
    curves = {}
    for name, pair in ways.items():
        runs = time_forward_rounds(pair, 256, WIDTHS, a.repeats, progress=False)
        curves[name] = {way: {T: min(r) for T, r in runs[way].items()} for way in pair}
        print(name, {way: f"t(1) {c[1] * 1e3:.1f} ms" for way, c in curves[name].items()}, flush=True)

    questions, seen = [], set()
    for line in a.questions.read_text().splitlines():
        q = json.loads(line)
        if q["category"] not in seen:
            seen.add(q["category"])
            questions.append(q)
    tok, eos = target.tokenizer, target.eos_token_ids
    decodes = []
    for q in questions:
        ids = encode_prompt(tok, q["turns"][0], chat_template=True)
        row = {"question": q["question_id"], "category": q["category"], "prompt_tokens": ids.numel()}
        for rnd in range(2):
            for way in ("fused", "modules") if rnd == 0 else ("modules", "fused"):
                t_, d_ = ways["target"][way], ways["draft"][way]
                curve = {T: curves["target"][way][T] / curves["target"][way][1] for T in WIDTHS}
                t0 = time.perf_counter()
                plain = autoregressive_generate(t_, ids, a.tokens, eos_token_ids=eos)
                t_plain = time.perf_counter() - t0
                t0 = time.perf_counter()
                drafter = DraftModelDrafter(d_, eos_token_ids=eos)
                spec = speculative_generate(t_, drafter, ids, a.tokens,
                                            gamma=Shadowed(CostAwareGamma(verify_curve=curve), drafter),
                                            eos_token_ids=eos)
                t_spec = time.perf_counter() - t0
                if spec.tokens != plain.tokens:
                    raise SystemExit(f"{row['question']}: speculative output parts from plain decoding ({way})")
                n = len(plain.tokens)
                for key, s in ((f"plain {way}", t_plain), (f"draft {way}", t_spec)):
                    row[key] = min(row.get(key, float("inf")), s)
                row["new_tokens"] = n
        decodes.append(row)
        print(row["category"], {k: round(row["new_tokens"] / v, 2) for k, v in row.items()
                                if k.startswith(("plain", "draft"))}, flush=True)

    m = machine()
    out = {"cpu": m["cpu"], "isa": isa_label(m), "threads": 2, "torch": m["torch"], "precision": a.precision,
           "path": str(target.path), "draft_path": str(draft.path), "context": 256, "repeats": a.repeats,
           "load_average_before": load_before, "load_average_after": [round(x, 2) for x in os.getloadavg()],
           "date": time.strftime("%Y-%m-%d"), "curves": curves, "decodes": decodes}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "fused_blocks.json").write_text(json.dumps(out, indent=1) + "\n")
    (a.out / "fused_blocks.md").write_text(report(out))
    print(report(out))


def report(r: dict) -> str:
    c = {n: {w: {int(T): s for T, s in t.items()} for w, t in ways.items()}       # {model: {way: {T: seconds}}}
         for n, ways in r["curves"].items()}                                          # (JSON keeps T as a string)
    lines = ["# The packed path's blocks: one C++ call against the modules one by one\n",
             f"{r['cpu']} ({r['isa']}), {r['threads']} threads, torch {r['torch']}, {r['date']}; target and draft on "
             f"the {r['path']}; load average {r['load_average_before'][0]} before, {r['load_average_after'][0]} "
             f"after. Both ways in one process on the same weights, side by side.\n",
             f"## One forward of T tokens after {r['context']} cached (best of {r['repeats']}, ms)\n",
             "| model | blocks | " + " | ".join(f"t({T})" for T in WIDTHS) + " | t(8)/t(1) |",
             "|---|---|" + "---|" * (len(WIDTHS) + 1)]
    for name in ("target", "draft"):
        for way in ("modules", "fused"):
            t = c[name][way]
            lines.append(f"| {name} | {way} | " + " | ".join(f"{t[T] * 1e3:.1f}" for T in WIDTHS)
                         + f" | {t[8] / t[1]:.2f} |")
    t1 = {n: {w: c[n][w][1] for w in c[n]} for n in c}
    lines += ["", f"Fused, a target step costs {t1['target']['fused'] / t1['target']['modules']:.2f} of the modules' "
              f"one and a draft step {t1['draft']['fused'] / t1['draft']['modules']:.2f}; the draft's step is "
              f"c = {t1['draft']['fused'] / t1['target']['fused']:.2f} of the target's fused, "
              f"{t1['draft']['modules'] / t1['target']['modules']:.2f} module by module.", "",
              f"## Decoding (tok/s, {r['decodes'][0]['new_tokens'] if r['decodes'] else 0} new tokens at most, "
              "the faster of two rounds; the draft model with the cost-aware γ)\n",
              "| category | prompt tokens | plain, modules | plain, fused | draft, modules | draft, fused | "
              "fused plain × modules plain | fused draft × fused plain |", "|---|---|---|---|---|---|---|---|"]
    tot = {}
    for d in r["decodes"]:
        s = {k: d["new_tokens"] / d[k] for k in ("plain modules", "plain fused", "draft modules", "draft fused")}
        for k in s:
            tot[k] = tot.get(k, 0.0) + d[k]
        lines.append(f"| {d['category']} | {d['prompt_tokens']} | {s['plain modules']:.2f} | {s['plain fused']:.2f} | "
                     f"{s['draft modules']:.2f} | {s['draft fused']:.2f} | {s['plain fused'] / s['plain modules']:.2f} "
                     f"| {s['draft fused'] / s['plain fused']:.2f} |")
    if tot:
        n = sum(d["new_tokens"] for d in r["decodes"])
        s = {k: n / v for k, v in tot.items()}
        lines.append(f"| all | – | {s['plain modules']:.2f} | {s['plain fused']:.2f} | {s['draft modules']:.2f} | "
                     f"{s['draft fused']:.2f} | {s['plain fused'] / s['plain modules']:.2f} | "
                     f"{s['draft fused'] / s['plain fused']:.2f} |")
    lines.append("\nEvery speculative output equals plain decoding's token for token, both ways.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
