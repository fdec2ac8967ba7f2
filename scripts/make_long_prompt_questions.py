"""Write data/questions/long_prompts.jsonl: questions whose prompt is long and whose answer is short.

Extraction, summarization and retrieval-augmented questions over texts every Python install
carries: sections of the Python language reference (`pydoc_data/topics.py`) and a whole
standard-library module (`bisect.py`), all under the PSF License. A 300 to 900-token prompt
with a short answer is where a draft model that must read the whole prompt loses to plain
decoding: no drafter shortens the target's prefill, and the draft's own prefill is overhead.

    python scripts/make_long_prompt_questions.py      # rewrites the file from this Python's library
"""
from __future__ import annotations

import inspect
import json
import platform
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "data" / "questions" / "long_prompts.jsonl"


def topic(name: str) -> tuple[str, str]:
    from pydoc_data.topics import topics
    return topics[name].strip(), f"the Python {platform.python_version()} language reference, section '{name}' " \
                                 "(pydoc_data/topics.py, PSF License)"


def module(name: str) -> tuple[str, str]:
    return inspect.getsource(__import__(name)).strip(), f"Python {platform.python_version()}'s standard library, " \
                                                        f"{name}.py (PSF License)"


QUESTIONS = [
    ("extraction-1", "extraction", module("bisect"),
     "From the Python module below, extract every function it defines and the names of its parameters, as a JSON "
     "list of objects with the keys \"name\" and \"parameters\". Return only the JSON.\n\n```python\n{text}\n```"),
    ("summarization-1", "summarization", topic("with"),
     "Summarize the following section of the Python language reference in three sentences.\n\n{text}"),
    ("rag-1", "rag", topic("for"),
     "Using only the document below, answer: when does the else clause of a for loop run, and when does it not? "
     "Quote the sentence that says so.\n\nDocument:\n{text}"),
    ("extraction-2", "extraction", topic("context-managers"),
     "From the text below, extract the names of the methods a context manager defines and, for each, what it "
     "returns or what its return value means. Answer as a JSON object mapping each method name to a short "
     "description.\n\n{text}"),
    ("summarization-2", "summarization", topic("class"),
     "Summarize the following section of the Python language reference in three sentences.\n\n{text}"),
    ("rag-2", "rag", topic("raise"),
     "Using only the document below, answer: what does `raise ... from None` do? Quote the sentence that says "
     "so.\n\nDocument:\n{text}"),
    ("extraction-3", "extraction", topic("exceptions"),
     "List every exception class and every Python statement named in the text below, one per line, in the order "
     "they first appear. Give only the list.\n\n{text}"),
    ("summarization-3", "summarization", topic("binary"),
     "Summarize the following section of the Python language reference in three sentences.\n\n{text}"),
    ("rag-3", "rag", topic("integers"),
     "Using only the document below, answer: may a non-zero decimal integer literal start with a zero, and what "
     "may the underscores in a literal do? Quote the document.\n\nDocument:\n{text}"),
]


def main() -> None:
    lines = [json.dumps({"question_id": qid, "category": cat, "turns": [template.format(text=text)],
                         "source": source}, ensure_ascii=False)
             for qid, cat, (text, source), template in QUESTIONS]
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"{len(lines)} questions -> {OUT}")


if __name__ == "__main__":
    main()
