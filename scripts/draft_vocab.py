"""The draft model with a vocabulary of its own: its step time and acceptance against the vocabulary's size.

    python scripts/draft_vocab.py --precision int4 --out data/bench/draft_vocab_CPU

One process, one pair of models. For the whole vocabulary and each --sizes k (the k most frequent ids of
data/vocab/, plus each prompt's own ids; drafters/vocab.py): the draft's one-token step after 256 cached
tokens (best of --repeats, in rounds), then plain decoding and speculative decoding with the draft model and
the cost-aware γ on every question of the set, the settings in turn per question, best of --rounds rounds.
Writes draft_vocab.json, .md and .png with the CPU, its ISA, the path, the precision and the load average;
every speculative output is checked against plain decoding's.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from pair_script import load_pair, pair_options
from tqdm import tqdm

SIZES = (65536, 32768, 16384)


def main() -> None:
    from labkit import DraftModelDrafter, autoregressive_generate, speculative_generate
    from labkit.drafters.vocab import with_vocab
    from labkit.models.calibrate import isa_label, machine
    from labkit.models.loading import encode_prompt
    from labkit.tuning import CostAwareGamma, Shadowed
    p = pair_options(__doc__, repeats=9)
    p.add_argument("--sizes", type=lambda s: tuple(int(x) for x in s.split(",")), default=SIZES)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args()
    target, draft, load_before = load_pair(a.precision)
    eos = target.eos_token_ids
    settings = {"all": None, **{str(k): k for k in a.sizes}}
    drafters = {name: DraftModelDrafter(with_vocab(draft.model, k, eos), eos_token_ids=eos)
                for name, k in settings.items()}

    # one-token steps after 256 cached tokens: the target's, and each drafter's (hidden states + its head)
    context = torch.randint(0, 20000, (256,))
    steps = {name: [] for name in ["target", *drafters]}
    cache = target.model.new_cache(max_len=300)
    with torch.no_grad():
        target.model(context[None], cache, num_logits=1)
        for d in drafters.values():
            d.start(torch.cat([context, context[-1:]]))              # the draft reads the 256 (and the prompt's ids)
        for _ in tqdm(range(a.repeats), desc="one-token steps", mininterval=2):
            for name in steps:
                for timed in (False, True):
                    t0 = time.perf_counter()
                    if name == "target":
                        target.model(context[-1:][None], cache)
                        cache.truncate(256)
                    else:
                        drafters[name].next_logits(context[-1:])
                        drafters[name].cache.truncate(256)
                    if timed:
                        steps[name].append(time.perf_counter() - t0)
    step = {name: min(s) for name, s in steps.items()}
    print({k: f"{v * 1e3:.2f} ms" for k, v in step.items()}, flush=True)

    # the target's verify curve t(T)/t(1), which the cost-aware γ weighs drafts with (as the bench's runs do)
    widths = (1, 2, 3, 4, 5, 6, 8)
    verify = {T: [] for T in widths}
    with torch.no_grad():
        for _ in range(3):
            for T in widths:
                for timed in (False, True):
                    t0 = time.perf_counter()
                    target.model(context[-T:][None], cache)
                    cache.truncate(256)
                    if timed:
                        verify[T].append(time.perf_counter() - t0)
    curve = {T: min(verify[T]) / min(verify[1]) for T in widths}
    print("verify curve", {T: round(v, 2) for T, v in curve.items()}, flush=True)
    rows = []
    questions = [json.loads(line) for line in a.questions.read_text().splitlines()]
    for q in tqdm(questions, desc="questions", mininterval=2):
        ids = encode_prompt(target.tokenizer, q["turns"][0], chat_template=True)
        row = {"question": q["question_id"], "category": q["category"], "prompt_tokens": ids.numel(), "seconds": {},
               "tokens_per_forward": {}}
        order = ["plain", *drafters]
        for rnd in range(a.rounds):
            for name in order[rnd % len(order):] + order[:rnd % len(order)]:
                t0 = time.perf_counter()
                if name == "plain":
                    out = plain = autoregressive_generate(target.model, ids, a.tokens, eos_token_ids=eos)
                else:
                    out = speculative_generate(target.model, drafters[name], ids, a.tokens,
                                               gamma=Shadowed(CostAwareGamma(verify_curve=curve), drafters[name]),
                                               eos_token_ids=eos)
                seconds = time.perf_counter() - t0
                row["seconds"][name] = min(row["seconds"].get(name, float("inf")), seconds)
                if name != "plain":
                    row["tokens_per_forward"][name] = round(out.trace.tokens_per_forward, 3)
                    outs = row.setdefault("outputs", {})
                    outs[name] = out.tokens
        row["new_tokens"] = len(plain.tokens)
        row["exact"] = all(t == plain.tokens for t in row.pop("outputs").values())
        if not row["exact"]:
            raise SystemExit(f"{q['question_id']}: a speculative output parts from plain decoding")
        rows.append(row)

    m = machine()
    out = {"cpu": m["cpu"], "isa": isa_label(m), "threads": 2, "torch": m["torch"], "precision": a.precision,
           "path": str(target.path), "draft_path": str(draft.path), "sizes": list(settings),
           "vocab_size": draft.model.vocab_size, "repeats": a.repeats, "rounds": a.rounds,
           "load_average_before": load_before, "load_average_after": [round(x, 2) for x in os.getloadavg()],
           "date": time.strftime("%Y-%m-%d"), "step_seconds": step, "verify_curve": curve, "questions": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "draft_vocab.json").write_text(json.dumps(out, indent=1) + "\n")
    (a.out / "draft_vocab.md").write_text(report(out))
    plot(out, a.out / "draft_vocab.png")
    print(report(out))


def by_category(r: dict) -> dict:
    """{category: {setting: (tok/s, × plain, tokens per target forward)}} and "all"."""
    cats = {}
    for row in r["questions"]:
        for c in (row["category"], "all"):
            agg = cats.setdefault(c, {"n": 0, "s": {}, "tpf": {}})
            agg["n"] += row["new_tokens"]
            for name, s in row["seconds"].items():
                agg["s"][name] = agg["s"].get(name, 0.0) + s
            for name, t in row["tokens_per_forward"].items():
                agg["tpf"].setdefault(name, []).append(t)
    return {c: {name: (agg["n"] / s, agg["s"]["plain"] / s,
                       sum(agg["tpf"][name]) / len(agg["tpf"][name]) if name in agg["tpf"] else None)
                for name, s in agg["s"].items()} for c, agg in cats.items()}


def label(name: str, vocab_size: int) -> str:
    return f"all {vocab_size:,} ids" if name == "all" else f"{int(name):,} most frequent + the prompt's"


def report(r: dict) -> str:
    step, sizes = r["step_seconds"], r["sizes"]
    lines = ["# The draft model's vocabulary: step time and acceptance against its size\n",
             f"{r['cpu']} ({r['isa']}), {r['threads']} threads, torch {r['torch']}, {r['date']}; target on the "
             f"{r['path']}, draft on the {r['draft_path']}; load average {r['load_average_before'][0]} before, "
             f"{r['load_average_after'][0]} after. Every setting in one process, in turn per question.\n",
             f"## One-token step after 256 cached tokens (best of {r['repeats']})\n",
             "| draft vocabulary | draft step ms | × the whole head's | c = draft step / target step |",
             "|---|---|---|---|"]
    for name in sizes:
        lines.append(f"| {label(name, r['vocab_size'])} | {step[name] * 1e3:.2f} | {step[name] / step['all']:.2f} | "
                     f"{step[name] / step['target']:.2f} |")
    lines += ["", f"The target's step: {step['target'] * 1e3:.2f} ms.", "",
              f"## Decoding the {len(r['questions'])} questions ({r['questions'][0]['new_tokens']} new tokens at most, "
              f"greedy; the draft model with the cost-aware γ; best of {r['rounds']} round(s))\n",
              "× plain decoding (tokens per target forward):\n",
              "| category | plain tok/s | " + " | ".join(label(n, r["vocab_size"]) for n in sizes) + " |",
              "|---|---|" + "---|" * len(sizes)]
    cats = by_category(r)
    for c in sorted(cats, key=lambda c: (c == "all", c)):
        v = cats[c]
        lines.append(f"| {c} | {v['plain'][0]:.2f} | " + " | ".join(f"{v[n][1]:.2f} ({v[n][2]:.2f})" for n in sizes)
                     + " |")
    lines.append(f"\nEvery speculative output equals plain decoding's token for token "
                 f"({sum(q['exact'] for q in r['questions'])}/{len(r['questions'])} questions).")
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sizes, cats = r["sizes"], by_category(r)
    xs = [r["vocab_size"] if n == "all" else int(n) for n in sizes]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(xs, [r["step_seconds"][n] * 1e3 for n in sizes], "o-")
    ax1.set(xscale="log", xlabel="ids the draft scores", ylabel="draft one-token step (ms)",
            title=f"draft step, {r['precision']}, {r['isa']}")
    for c in sorted(cats):
        ax2.plot(xs, [cats[c][n][1] for n in sizes], "o-", lw=2.5 if c == "all" else 1, label=c)
    ax2.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax2.set(xscale="log", xlabel="ids the draft scores", ylabel="× plain decoding", title="speculative speedup")
    ax2.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{r['cpu']}, {r['threads']} threads, load {r['load_average_before'][0]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
