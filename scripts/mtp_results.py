"""The MTP comparison table: validation loss, tokens per forward and measured self-speculative speedup.

Loads every shipped checkpoint in data/mtp/, decodes held-out prompts (from the validation plays,
never trained on) with the model's own next-token head autoregressively and self-speculatively,
interleaved prompt by prompt in this one process (one thread); Gloeckle models also draft a tree
from their heads' top-k (labkit/drafters/mtp_tree.py) at several node budgets. Writes
data/mtp/results.json and data/mtp/heldout.txt (the validation windows the tests re-evaluate) and
prints the tables; data/mtp/results.md explains them for the lab's users. Run: `python scripts/mtp_results.py` (about 25 minutes);
`python scripts/mtp_results.py --models NAME ...` re-measures those models alone and keeps the
other rows of results.json (each row's timings are its own side-by-side AR vs speculative runs).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from labkit import SamplingConfig, autoregressive_generate, speculative_generate
from labkit.bench.writer import write_outputs
from labkit.decoding.tree import tree_generate
from labkit.drafters.mtp import self_speculative
from labkit.drafters.mtp_tree import mtp_tree_drafter
from labkit.models.adapters import MTPTreeTarget
from labkit.models.mtp import head_topk_accuracy
from labkit.training.mtp_data import fixed_windows, load_corpus
from labkit.training.train_mtp import N_VAL_WINDOWS, WINDOW_EXTRA, load_checkpoint

DATA = Path(__file__).resolve().parents[1] / "data" / "mtp"
MODELS = ["next", "gloeckle4", "deepseek3", "gloeckle8", "gloeckle4_w01", "next_600", "gloeckle4_600", "gloeckle4_w01_600",
          "deepseek3_600", "next_988", "next_1041", "gloeckle4_w01_600_t10", "gloeckle4_w005_600_t10", "next_778_t10"]
N_PROMPTS, PROMPT_LEN, NEW_TOKENS, SAMPLE_TEMPERATURE = 12, 64, 128, 1.0
TREE_BUDGETS, TREE_BUDGET, TOP_K = (4, 8, 16, 32), 16, 8   # tree nodes per step; the goal's budget; ranks per head


def heldout_prompts(val: torch.Tensor, first: int) -> list[str]:
    """N_PROMPTS prompts of PROMPT_LEN bytes spread evenly over the validation plays after byte `first`."""
    stride = (val.numel() - first - PROMPT_LEN) // N_PROMPTS
    return [bytes(val[first + i * stride:first + i * stride + PROMPT_LEN].tolist()).decode("latin-1")
            for i in range(N_PROMPTS)]


def decode_side_by_side(model, prompts: list[str]) -> dict:
    """AR and self-speculative greedy decoding of every prompt, timed alternately; both outputs must agree."""
    ar_time = spec_time = verify_time = draft_time = 0.0
    n_tokens, n_forwards, accepted, ratios = 0, 0, Counter(), []
    sampled_tokens = sampled_forwards = 0
    for text in prompts:
        prompt = torch.tensor(list(text.encode("latin-1")))
        t0 = time.perf_counter()
        ar = autoregressive_generate(model, prompt, NEW_TOKENS)
        t1 = time.perf_counter()
        if model.cfg.kind == "next":
            ar_time += t1 - t0
            continue
        spec = speculative_generate(*self_speculative(model), prompt, NEW_TOKENS, gamma=model.cfg.n_future - 1)
        t2 = time.perf_counter()
        if spec.tokens != ar.tokens:
            raise AssertionError(f"self-speculative greedy output differs from AR greedy output on prompt {text!r}")
        ar_time, spec_time = ar_time + t1 - t0, spec_time + t2 - t1
        ratios.append((t1 - t0) / (t2 - t1))
        n_tokens, n_forwards = n_tokens + spec.trace.n_generated, n_forwards + spec.trace.n_target_forwards
        verify_time, draft_time = verify_time + spec.trace.verify_time, draft_time + spec.trace.draft_time
        accepted.update(s.n_accepted for s in spec.trace.steps)
        sampled = speculative_generate(*self_speculative(model), prompt, NEW_TOKENS, gamma=model.cfg.n_future - 1,
                                       sampling=SamplingConfig(temperature=SAMPLE_TEMPERATURE), seed=len(ratios))
        sampled_tokens += sampled.trace.n_generated
        sampled_forwards += sampled.trace.n_target_forwards
    n_ar = len(prompts) * NEW_TOKENS
    if model.cfg.kind == "next":
        return {"ar_ms_per_token": 1e3 * ar_time / n_ar, "example": bytes(ar.tokens).decode("latin-1")}
    ratios.sort()
    return {"tokens_per_forward": n_tokens / n_forwards, "accepted_histogram": dict(sorted(accepted.items())),
            "ar_ms_per_token": 1e3 * ar_time / n_ar, "spec_ms_per_token": 1e3 * spec_time / n_tokens,
            "speedup": ar_time / spec_time, "speedup_median_per_prompt": ratios[len(ratios) // 2],
            "verify_ms_per_forward": 1e3 * verify_time / n_forwards, "draft_ms_per_step": 1e3 * draft_time / n_forwards,
            "sampled_tokens_per_forward": sampled_tokens / sampled_forwards,
            "example": bytes(ar.tokens).decode("latin-1")}


def decode_tree(model, prompts: list[str], topk_accuracy: torch.Tensor, budget: int) -> dict:
    """AR and tree self-speculative decoding (a static tree of `budget` nodes), timed alternately; outputs must agree."""
    target = MTPTreeTarget(model)
    ar_time = tree_time = verify_time = 0.0
    n_tokens = n_forwards = sampled_tokens = sampled_forwards = 0
    for i, text in enumerate(prompts):
        prompt = torch.tensor(list(text.encode("latin-1")))
        t0 = time.perf_counter()
        ar = autoregressive_generate(model, prompt, NEW_TOKENS)
        t1 = time.perf_counter()
        out = tree_generate(target, mtp_tree_drafter(model, topk_accuracy, budget), prompt, NEW_TOKENS, budget)
        t2 = time.perf_counter()
        if out.tokens != ar.tokens:
            raise AssertionError(f"tree self-speculative greedy output differs from AR greedy output on {text!r}")
        ar_time, tree_time, verify_time = ar_time + t1 - t0, tree_time + t2 - t1, verify_time + out.trace.verify_time
        n_tokens, n_forwards = n_tokens + out.trace.n_generated, n_forwards + out.trace.n_target_forwards
        sampled = tree_generate(target, mtp_tree_drafter(model, topk_accuracy, budget), prompt, NEW_TOKENS, budget,
                                sampling=SamplingConfig(temperature=SAMPLE_TEMPERATURE), seed=i)
        sampled_tokens += sampled.trace.n_generated
        sampled_forwards += sampled.trace.n_target_forwards
    return {"tokens_per_forward": n_tokens / n_forwards, "sampled_tokens_per_forward": sampled_tokens / sampled_forwards,
            "ar_ms_per_token": 1e3 * ar_time / (len(prompts) * NEW_TOKENS), "tree_ms_per_token": 1e3 * tree_time / n_tokens,
            "verify_ms_per_forward": 1e3 * verify_time / n_forwards, "speedup": ar_time / tree_time}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=MODELS, metavar="NAME",
                    help="re-measure only these (of MODELS), keeping the other rows of data/mtp/results.json")
    args = ap.parse_args(argv)
    previous = {}
    if args.models:
        if not (DATA / "results.json").exists():
            raise SystemExit("--models updates data/mtp/results.json, which is missing: run without --models first")
        previous = json.loads((DATA / "results.json").read_text())["models"]
    torch.set_num_threads(1)
    corpus, _ = load_corpus()
    T = 256
    val_bytes = N_VAL_WINDOWS * (T + WINDOW_EXTRA)
    (DATA / "heldout.txt").write_bytes(bytes(corpus.val[:val_bytes].tolist()))
    windows = fixed_windows(corpus.val, N_VAL_WINDOWS, T + WINDOW_EXTRA)
    prompts = heldout_prompts(corpus.val, val_bytes)
    rows = {}
    for name in tqdm(MODELS, desc="models"):
        if args.models and name not in args.models:
            if name not in previous:
                raise SystemExit(f"results.json has no row for {name}: re-measure it too (--models ... {name})")
            rows[name] = previous[name]
            continue
        model, meta = load_checkpoint(DATA / name)
        topk_accuracy = head_topk_accuracy(model, windows[:32], T, TOP_K)                  # (n, k)
        rows[name] = {"kind": model.cfg.kind, "n_future": model.cfg.n_future, "params": meta["params"],
                      "val_next_bits_per_byte": meta["val_next_bits_per_byte"],
                      "val_loss_bits_per_offset": [x / math.log(2) for x in meta["val_loss_nats"]],
                      "head_topk_accuracy": topk_accuracy.tolist(),
                      "train_flops_per_token": meta["train_flops_per_token"], "tokens_seen": meta["tokens_seen"],
                      "train_flops": meta["train_flops"],
                      "train_seconds": meta["train_seconds"], "train_seconds_per_step": meta["seconds_per_step"],
                      "steps": meta["train"]["steps"], "precision": meta["train"]["precision"],
                      "trunk": trunk_shape(model.cfg),
                      **decode_side_by_side(model, prompts)}
        if model.cfg.kind == "gloeckle":
            rows[name]["tree"] = {str(b): decode_tree(model, prompts, topk_accuracy, b)
                                  for b in tqdm(TREE_BUDGETS, desc=f"{name} trees", leave=False)}
    for row in rows.values():
        for gap in ("val_loss_vs_next", "val_loss_vs_next_compute"):      # rows kept by --models: computed afresh
            row.pop(gap, None)
        row["baseline"] = next_token_baseline(rows, row)
        if row["baseline"] is not None:
            row["val_loss_vs_next"] = row["val_next_bits_per_byte"] / rows[row["baseline"]]["val_next_bits_per_byte"] - 1
        row["compute_baseline"] = equal_compute_baseline(rows, row)
        if row["kind"] != "next" and row["baseline"] is None and row["compute_baseline"] is None:
            raise ValueError(f"no next-token model with the trunk of {row['trunk']} trained for equal data or equal "
                             "compute: add one to MODELS (and train it) so the loss comparison is like for like")
        if row["compute_baseline"] is not None:
            row["val_loss_vs_next_compute"] = (row["val_next_bits_per_byte"]
                                               / rows[row["compute_baseline"]]["val_next_bits_per_byte"] - 1)
    result = {"prompts": prompts, "new_tokens": NEW_TOKENS, "prompt_len": PROMPT_LEN, "threads": 1,
              "tree_budget": TREE_BUDGET, "top_k": TOP_K,
              "torch": torch.__version__, "models": rows}
    write_outputs(DATA / "results", result)          # data/mtp/results.md explains these numbers: update it from the tables below
    print(markdown(result))


def trunk_shape(cfg) -> dict:
    """What two models must share for their next-token losses to be compared: the trunk and its tokenizer."""
    return {key: getattr(cfg, key) for key in ("dim", "n_trunk", "n_heads", "hidden_dim", "vocab_size")}


def next_token_baseline(rows: dict, row: dict) -> str | None:
    """The next-token-only model with the same trunk trained on the same data the same way (steps, precision), if any."""
    for name, other in rows.items():
        if (other["kind"] == "next" and other["trunk"] == row["trunk"]
                and (other["steps"], other["precision"]) == (row["steps"], row["precision"])):
            return name
    return None


def _vs_data(row: dict) -> str:
    return f"{100 * row['val_loss_vs_next']:+.1f}%" if row["baseline"] else "-"


def _vs_compute(row: dict) -> str:
    return f"{100 * row['val_loss_vs_next_compute']:+.1f}%" if row["compute_baseline"] else "-"


def equal_compute_baseline(rows: dict, row: dict) -> str | None:
    """The next-token-only model with the same trunk, trained in the same precision with the same training FLOPs
    (within 2%), if any."""
    for name, other in rows.items():
        if (other["kind"] == "next" and other["trunk"] == row["trunk"] and other["precision"] == row["precision"]
                and abs(other["train_flops"] / row["train_flops"] - 1) < 0.02):
            return name
    return None


def markdown(result: dict) -> str:
    rows = result["models"]
    lines = ["# Multi-token prediction on Shakespeare bytes: equal data and equal compute", "",
             f"{len(result['prompts'])} held-out prompts of {result['prompt_len']} bytes (validation plays), "
             f"{result['new_tokens']} new bytes each, greedy; AR and self-speculative decoding timed alternately "
             "in one process, one CPU thread (`python scripts/mtp_results.py`). Tokens per forward = accepted + 1 "
             "per verify forward. Every self-speculative output equalled the AR output token for token. These small "
             "models' greedy continuations soon repeat themselves (\"the the the\"), and repeats are easy to draft: "
             "the sampled column (speculative sampling at temperature 1, each draft byte from its head's softmax) "
             "is the less loop-driven view.", "",
             "Each model's loss is compared with two next-token-only models trained in the same precision: at *equal "
             "data*, the one trained on the same bytes for the same steps (`next` for the 300-step bf16-autocast "
             "models, `next_600` for the 600-step fp32 ones), and at *equal compute*, the one whose training FLOPs "
             "match (`next_988`: 988 steps cost what 600 steps of an n=4 Gloeckle model cost, its extra heads "
             "included; `next_1041` for the 600-step DeepSeek model; the 300-step models have none). Models named `_t10` have a "
             "10-layer trunk instead of 4: there an n=4 Gloeckle model's three extra head layers cost 30% more per token "
             "instead of 65%, so its equal-compute next-token model (`next_778_t10`) gets 778 steps to its 600 (no "
             "equal-data next-token model was trained for that trunk). Comparisons are always within one trunk. "
             "*train s/step* was measured on the machine each model was trained on.", "",
             "| model | trunk layers | steps | precision | params | train FLOPs/token | train s/step | val next-token bits/byte "
             "| vs next, equal data | vs next, equal compute | tokens/forward (greedy) | tokens/forward (T=1 sampled) "
             "| AR ms/token | self-spec ms/token | speedup |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        trained = (f"| {name} | {r['trunk']['n_trunk']} | {r['steps']} | {r['precision']} | {r['params'] / 1e6:.2f}M "
                   f"| {r['train_flops_per_token'] / 1e6:.1f}M | {r['train_seconds_per_step']:.2f} "
                   f"| {r['val_next_bits_per_byte']:.3f} ")
        if r["kind"] == "next":
            lines.append(trained + f"| - | - | 1 | 1 | {r['ar_ms_per_token']:.2f} | - | 1.00x |")
            continue
        lines.append(trained + f"| {_vs_data(r)} | {_vs_compute(r)} "
                     f"| {r['tokens_per_forward']:.2f} | {r['sampled_tokens_per_forward']:.2f} "
                     f"| {r['ar_ms_per_token']:.2f} | {r['spec_ms_per_token']:.2f} | {r['speedup']:.2f}x |")
    lines += ["", "Where the time goes: one AR step (a 1-byte forward through trunk + next-token head) against one "
              "self-speculative step (an n-byte verify forward, through every Gloeckle head too, plus the draft: free "
              "for Gloeckle, a chain of module forwards for DeepSeek).", "",
              "| model | AR ms/forward | verify ms/forward | draft ms/step | step cost / AR step | tokens/forward "
              "| speedup this predicts |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        if r["kind"] != "next":
            cost = (r["verify_ms_per_forward"] + r["draft_ms_per_step"]) / r["ar_ms_per_token"]
            lines.append(f"| {name} | {r['ar_ms_per_token']:.2f} | {r['verify_ms_per_forward']:.2f} "
                         f"| {r['draft_ms_per_step']:.2f} | {cost:.2f} | {r['tokens_per_forward']:.2f} "
                         f"| {r['tokens_per_forward'] / cost:.2f}x |")
    lines += ["", "## Tree drafting from the Gloeckle heads", "",
              "The chain above drafts each head's top-1 byte. Here the heads' top-k fill Medusa's static tree: the "
              "`nodes` paths most likely to be right by the heads' teacher-forced top-k accuracy on 32 validation "
              "windows (below), all verified in one forward through the trunk and every head "
              "(`labkit/drafters/mtp_tree.py`). AR and tree decoding timed alternately, as above; every greedy tree "
              "output equalled the AR output token for token.", "",
              "| model | vs next, equal compute | chain tokens/forward | tree nodes | tokens/forward (greedy) "
              "| tokens/forward (T=1 sampled) | verify ms/forward | AR ms/token | tree ms/token | speedup |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        for budget, t in r.get("tree", {}).items():
            lines.append(f"| {name} | {_vs_compute(r)} | {r['tokens_per_forward']:.2f} | {budget} "
                         f"| {t['tokens_per_forward']:.2f} | {t['sampled_tokens_per_forward']:.2f} "
                         f"| {t['verify_ms_per_forward']:.2f} | {t['ar_ms_per_token']:.2f} | {t['tree_ms_per_token']:.2f} "
                         f"| {t['speedup']:.2f}x |")
    budget = str(result["tree_budget"])
    lines += ["", "Goal: an n=4 model with >= 2.0 tokens per forward (greedy, the bonus token counted) and next-token "
              "loss within 5% of the next-token-only model's at equal training compute (where there is no "
              f"equal-compute model, at equal data); drafting a chain, or a {budget}-node tree.", ""]
    for name, r in rows.items():
        if r["n_future"] == 4:
            tree = r.get("tree", {}).get(budget)
            best = max(r["tokens_per_forward"], tree["tokens_per_forward"] if tree else 0.0)
            gap, versus = ((r["val_loss_vs_next_compute"], f"{r['compute_baseline']} (equal compute)")
                           if r["compute_baseline"] else (r["val_loss_vs_next"], f"{r['baseline']} (equal data)"))
            met = best >= 2.0 and gap <= 0.05
            drafted = f"chain {r['tokens_per_forward']:.2f}" + (f", tree {tree['tokens_per_forward']:.2f}" if tree else "")
            verdict = ("met" if r["compute_baseline"] else "met at equal data only") if met else "missed"
            lines.append(f"- {name}: {drafted} tokens/forward, {100 * gap:+.1f}% loss vs {versus}: {verdict}")
    lines += ["", "Teacher-forced top-1 (and top-4) accuracy of each offset's head on 32 validation windows (a "
              "DeepSeek module k is given the true bytes up to i+k, so its accuracy is not comparable with a "
              "Gloeckle head's, which sees only the trunk at i):", ""]
    for name, r in rows.items():
        lines.append(f"- {name}: " + ", ".join(f"{a[0]:.2f} ({a[3]:.2f})" for a in r["head_topk_accuracy"]))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
