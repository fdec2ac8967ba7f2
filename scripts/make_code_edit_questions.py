"""The multi-turn code-edit question set: a coding request, the target's own answer, and an edit of it.

    .venv/bin/python scripts/make_code_edit_questions.py           # writes data/questions/code_edit.jsonl

Each question's first turn asks for a piece of code; its answer is the embedded target's own
(greedy, labkit autoregressive, bf16, up to 320 tokens or its end of turn); the second turn asks
for an edit and the whole code back. The benchmark times the answer to the second turn, which
repeats much of the first answer: what suffix decoding and prompt lookup draft from.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from labkit import autoregressive_generate, load_model
from labkit.models.hub import DEFAULT_TARGET
from labkit.models.loading import encode_prompt

ROOT = Path(__file__).resolve().parents[1]
MAX_ANSWER = 320

TURNS = [
    ("Write a Python function `word_counts(text)` that returns a dict mapping each lowercase word to how often "
     "it occurs.",
     "Change it to ignore punctuation and to return the counts sorted by frequency, most common first. "
     "Return the whole function."),
    ("Write a Python class `Stack` with push, pop, peek and is_empty methods, each with a docstring.",
     "Add a `size` method, and make pop and peek raise IndexError with a clear message on an empty stack. "
     "Return the whole class."),
    ("Write a Python function `fizzbuzz(n)` that returns the list of FizzBuzz strings from 1 to n.",
     "Rename the function to `fizzbuzz_lines`, add type hints and a docstring, and let the caller choose the "
     "two words. Return the whole function."),
    ("Write a Python function that reads a CSV file and returns the average of a named numeric column.",
     "Make it skip rows whose value is empty or not a number, and log how many it skipped. "
     "Return the whole function."),
    ("Write a JavaScript function `debounce(fn, ms)`.",
     "Add a `cancel()` method to the returned function, and JSDoc comments. Return the whole code."),
    ("Write a Python function `binary_search(items, target)` that returns the index of target in the sorted "
     "list items, or -1.",
     "Make it return the insertion point instead of -1, as bisect_left does, and add two doctests. "
     "Return the whole function."),
    ("Write a bash script that backs up a directory into a timestamped .tar.gz file.",
     "Add a check that the directory exists, keep only the 5 newest backups, and print what it did. "
     "Return the whole script."),
    ("Write a Python dataclass `Invoice` with a customer name, a list of (item, price) lines and a method "
     "that returns the total.",
     "Add a tax rate field with a default of 0.2, a method that returns the total with tax, and a __str__ that "
     "lists the lines. Return the whole class."),
]


def main() -> None:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    target = load_model(DEFAULT_TARGET, "bf16", progress=False)
    out = ROOT / "data" / "questions" / "code_edit.jsonl"
    lines = []
    for i, (first, edit) in enumerate(tqdm(TURNS, desc="first answers"), start=1):
        ids = encode_prompt(target.tokenizer, first, chat_template=True)
        gen = autoregressive_generate(target.model, ids, MAX_ANSWER, eos_token_ids=target.eos_token_ids)
        answer = target.tokenizer.decode(gen.tokens, skip_special_tokens=True).strip()
        lines.append(json.dumps({"question_id": f"code-edit-{i}", "category": "code-edit", "turns": [first, edit],
                                 "answers": [answer],
                                 "answer_source": f"{DEFAULT_TARGET}, greedy, labkit autoregressive, bf16, "
                                                  f"up to {MAX_ANSWER} tokens"}, ensure_ascii=False))
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} questions to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
