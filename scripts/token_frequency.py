"""How often each token of a tokenizer occurs in chat and code: the ranking a draft's vocabulary is cut from.

    python scripts/token_frequency.py --model qwen2.5-coder-0.5b-instruct --out data/vocab/qwen2.5

Counts the tokens of --conversations ShareGPT V3 conversations (every language, every turn, laid out in the
model's chat template, as the lab prompts it) and of the Python standard library's source files, and writes
token_ranks.pt: {"ids": every id seen, most frequent first (ties: lower id first), "counts": their counts,
"vocab_size": the model's vocabulary, "tokens": tokens counted, "sources": what was read}. Then, for the
lab's question set, the share of the tokens of its prompts and of a bench's plain-decoding answers that the
first k ranked ids cover (coverage.json): the answers' share bounds how often a draft restricted to them can
be right there (drafters/vocab.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

SIZES = (4096, 8192, 16384, 32768, 65536)


def main() -> None:
    from transformers import AutoConfig, AutoTokenizer

    from labkit.models.hub import resolve_model
    from labkit.training.corpus import SHAREGPT_PACKAGE, sharegpt_records, sharegpt_wheel, stdlib_files
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--conversations", type=int, default=20000)
    p.add_argument("--stdlib-files", type=int, default=1000)
    p.add_argument("--questions", type=Path, default=Path("data/questions/labkit_bench.jsonl"))
    p.add_argument("--answers", type=Path,
                   default=Path("data/bench/fused_blocks_amd-epyc-avx2/bench/results.jsonl"),
                   help="a bench's results.jsonl: its plain decoding's answers are scored too")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    source = resolve_model(a.model, progress=False)
    tok = AutoTokenizer.from_pretrained(source)
    vocab_size = AutoConfig.from_pretrained(source).vocab_size
    counts: Counter = Counter()

    n_chats = 0
    bar = tqdm(total=a.conversations, desc="ShareGPT conversations", mininterval=2)
    for record in sharegpt_records(sharegpt_wheel()):
        turns = [t for t in record.get("conversations") or [] if t.get("from") in ("human", "gpt")]
        if not turns:
            continue
        messages = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]} for t in turns]
        text = tok.apply_chat_template(messages, tokenize=False)
        counts.update(tok(text, add_special_tokens=False)["input_ids"])
        n_chats += 1
        bar.update()
        if n_chats >= a.conversations:
            break
    bar.close()
    files = stdlib_files()[:a.stdlib_files]
    for path in tqdm(files, desc="standard-library files", mininterval=2):
        try:
            counts.update(tok(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"])
        except (UnicodeDecodeError, OSError):
            continue

    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    ids = torch.tensor([i for i, _ in ranked], dtype=torch.int32)                       # (seen,)
    n = torch.tensor([c for _, c in ranked], dtype=torch.int32)
    a.out.mkdir(parents=True, exist_ok=True)
    python = ".".join(map(str, sys.version_info[:2]))
    total = int(n.sum(dtype=torch.int64))
    sources = {"model": a.model, "sharegpt": f"{n_chats} conversations of {SHAREGPT_PACKAGE}, in file order",
               "stdlib": f"{len(files)} .py files of the standard library (Python {python})"}
    torch.save({"ids": ids, "counts": n, "vocab_size": vocab_size, "tokens": total, "sources": sources},
               a.out / "token_ranks.pt")

    # coverage of the question set's prompts (text the ranking never read)
    rank = torch.full((vocab_size,), vocab_size, dtype=torch.int64)
    rank[ids.long()] = torch.arange(len(ids))
    held, prompts = [], {}
    for line in a.questions.read_text().splitlines():
        q = json.loads(line)
        text = tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                       add_generation_prompt=True)
        prompts[q["question_id"]] = tok(text, add_special_tokens=False)["input_ids"]
        held += prompts[q["question_id"]]
    answers = {}
    for line in a.answers.read_text().splitlines():
        r = json.loads(line)
        if r.get("method") == "ar":
            answers.setdefault(r["question_id"], r["tokens"])
    covered = lambda toks: {k: round(float((rank[torch.tensor(toks)] < k).float().mean()), 4) for k in SIZES}
    # with each answer's own prompt ids as well, as a draft's vocabulary takes them in (VocabHead.extend)
    with_prompt = {k: round(sum(int(rank[t]) < k or t in prompts[q] for q, v in answers.items() for t in v)
                            / sum(map(len, answers.values())), 4) for k in SIZES}
    summary = {"tokens_counted": total, "distinct_ids": len(ids), "vocab_size": vocab_size, "sources": sources,
               "coverage_of_question_prompts": {"questions": str(a.questions), "tokens": len(held),
                                                "covered": covered(held)},
               "coverage_of_answers": {"answers": f"plain decoding's answers in {a.answers}",
                                       "tokens": sum(map(len, answers.values())),
                                       "covered": covered([t for v in answers.values() for t in v]),
                                       "covered_with_the_prompts_ids": with_prompt}}
    (a.out / "coverage.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
