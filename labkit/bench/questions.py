"""Spec-Bench's question format: one JSON object a line, `question_id`, `category`, `turns`.

Xia et al. 2024, "Unlocking Efficiency in Large Language Model Inference: A Comprehensive
Survey of Speculative Decoding" (Spec-Bench). Only the first turn is used: it goes through
the model's chat template as one user message.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..core.textfile import read_text


class QuestionFileError(ValueError):
    """A question file that cannot be read; the message names the file, the line and the fix."""


@dataclass(frozen=True)
class Question:
    question_id: str
    category: str
    prompt: str              # the first turn

    @property
    def sha(self) -> str:
        """Short hash of what the model sees: a record for an edited question is not reused."""
        return hashlib.sha256(f"{self.category}\n{self.prompt}".encode()).hexdigest()[:12]


def parse_question(obj: object, where: str) -> Question:
    """One decoded JSON line -> Question, or an error saying what is wrong with it."""
    if not isinstance(obj, dict):
        raise QuestionFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("question_id", "category", "turns") if k not in obj]
    if missing:
        raise QuestionFileError(f"{where}: missing {', '.join(missing)}; each line needs question_id, category "
                                "and turns (a list of user messages), as in Spec-Bench's question.jsonl")
    turns = obj["turns"]
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
        raise QuestionFileError(f"{where}: turns must be a non-empty list whose first item is a non-empty string, "
                                f"got {turns!r:.80}")
    if not isinstance(obj["category"], str) or not obj["category"].strip():
        raise QuestionFileError(f"{where}: category must be a non-empty string, got {obj['category']!r}")
    return Question(str(obj["question_id"]), obj["category"], turns[0])


def read_questions(path: str | Path, categories: list[str] | None = None, limit: int | None = None) -> list[Question]:
    """The questions of a Spec-Bench jsonl file, filtered by category, the first `limit` of them."""
    path = Path(path)
    if not path.is_file():
        raise QuestionFileError(f"question file {path} {'is a directory' if path.is_dir() else 'does not exist'}: "
                                "pass --questions FILE.jsonl (data/questions/labkit_bench.jsonl ships with labkit)")
    if limit is not None and limit < 1:
        raise QuestionFileError(f"--limit must be >= 1, got {limit}")
    questions, seen = [], set()
    for n, line in enumerate(read_text(path, "--questions").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise QuestionFileError(f"{path}:{n}: not valid JSON ({e.msg}); the file must hold one JSON object "
                                    "a line") from e
        q = parse_question(obj, f"{path}:{n}")
        if q.question_id in seen:
            raise QuestionFileError(f"{path}:{n}: question_id {q.question_id!r} appears twice; ids must be unique "
                                    "(results are keyed by them)")
        seen.add(q.question_id)
        questions.append(q)
    if not questions:
        raise QuestionFileError(f"{path} holds no questions")
    if categories is not None:
        known = sorted({q.category for q in questions})
        if not categories:
            raise QuestionFileError(f"--categories names no category: choose from {known}, or leave it out")
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise QuestionFileError(f"no questions of categories {unknown} in {path}; its categories are {known}")
        questions = [q for q in questions if q.category in categories]
    return questions[:limit]
