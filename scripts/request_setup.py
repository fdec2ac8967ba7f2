"""What a request costs before its first token: a fresh KV cache, and the draft model's reading of the prompt.

    python scripts/request_setup.py --precision int4 --out data/bench/draft_opening_CPU

One process, the embedded pair. For the target and the draft: a new cache for the whole context with its slots
zeroed (as labkit allocated it before) and left unset (as it does now), --repeats times each, alternating. Then
for each question of the set: the draft's `start` (its cache and its reading of the prompt but its last token)
reading the whole prompt, and copying in the chat template's opening first (drafters/opening.py), alternating,
best of --repeats. Writes request_setup.json and .md with the CPU, its ISA, the path, the precision and the load.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch
from pair_script import load_pair, pair_options
from tqdm import tqdm


def main() -> None:
    from labkit import DraftModelDrafter
    from labkit.drafters.draft_model import draft_reading
    from labkit.drafters.opening import chat_opening
    from labkit.models.calibrate import isa_label, machine
    from labkit.models.loading import encode_prompt
    a = pair_options(__doc__, repeats=7).parse_args()
    target, draft, load_before = load_pair(a.precision)

    caches = {}
    for name, model in (("target", target.model), ("draft", draft.model)):
        ms = {"zeroed": [], "unset": []}
        for _ in range(a.repeats):
            for how in ms:
                t0 = time.perf_counter()
                cache = model.new_cache()
                if how == "zeroed":
                    cache.k.zero_()
                    cache.v.zero_()
                ms[how].append((time.perf_counter() - t0) * 1e3)
                del cache
        caches[name] = {"mebibytes": round(2 * model.new_cache().k.nbytes / 2**20, 1),
                        **{how: {"median_ms": round(statistics.median(v), 2), "max_ms": round(max(v), 2)}
                           for how, v in ms.items()}}

    opening = chat_opening(target.tokenizer)
    questions = [json.loads(line) for line in a.questions.read_text().splitlines() if line.strip()]
    starts = []
    for q in tqdm(questions, desc="draft starts", mininterval=2):
        ids = encode_prompt(target.tokenizer, q["turns"][0], True)
        ms = {"whole": [], "opening": []}
        for _ in range(a.repeats):
            for how in ms:
                read = draft_reading(draft.model, vocab="auto", opening=opening if how == "opening" else None,
                                     always=target.eos_token_ids)
                drafter = DraftModelDrafter(read, eos_token_ids=target.eos_token_ids)
                t0 = time.perf_counter()
                drafter.start(ids)
                ms[how].append((time.perf_counter() - t0) * 1e3)
        starts.append({"question_id": q["question_id"], "category": q["category"], "prompt_tokens": ids.numel(),
                       **{how: round(min(v), 1) for how, v in ms.items()}})

    facts = machine()
    meta = {"cpu": facts["cpu"], "isa": isa_label(facts), "threads": 2, "torch": torch.__version__,
            "path": "packed", "precision": a.precision, "repeats": a.repeats, "opening_tokens": len(opening),
            "load_average_before": load_before, "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "request_setup.json").write_text(json.dumps({"meta": meta, "caches": caches, "starts": starts},
                                                         indent=1) + "\n")
    lines = [f"# What a request costs before its first token: {meta['cpu']} ({meta['isa']})", "",
             f"Measured {meta['date']}, 2 threads, torch {meta['torch']}, packed path, {a.precision} weights; load "
             f"average {load_before[0]} before, {meta['load_average_after'][0]} after. `scripts/request_setup.py`.", "",
             "A new KV cache for the whole context, its slots zeroed against left unset (median and slowest of "
             f"{a.repeats}):", "", "| model | cache MiB | zeroed ms (median / max) | unset ms (median / max) |",
             "|---|---:|---:|---:|"]
    for name, c in caches.items():
        lines.append(f"| {name} | {c['mebibytes']} | {c['zeroed']['median_ms']} / {c['zeroed']['max_ms']} | "
                     f"{c['unset']['median_ms']} / {c['unset']['max_ms']} |")
    lines += ["", f"The draft's start (a cache, its vocabulary's prompt ids, its reading of the prompt but its last "
              f"token), reading the whole prompt against copying in the chat template's first {len(opening)} "
              f"tokens (best of {a.repeats}, ms):", "", "| question | prompt tokens | whole | opening copied in |",
              "|---|---:|---:|---:|"]
    lines += [f"| {s['question_id']} | {s['prompt_tokens']} | {s['whole']} | {s['opening']} |" for s in starts]
    (a.out / "request_setup.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
