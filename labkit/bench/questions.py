"""Spec-Bench's question format: one JSON object a line, `question_id`, `category`, `turns`.

Xia et al. 2024, "Unlocking Efficiency in Large Language Model Inference: A Comprehensive
Survey of Speculative Decoding" (Spec-Bench). Only the first turn is used: it goes through
the model's chat template as one user message.

A question may carry `answers`, the assistant's answers to every turn but the last (labkit's
multi-turn extension): then the whole conversation goes through the chat template and the
benchmark times the answer to the last turn (a second turn that edits the first answer, say).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..files.textfile import read_text


class QuestionFileError(ValueError):
    """A question file that cannot be read; the message names the file, the line and the fix."""


@dataclass(frozen=True)
class Question:
    question_id: str
    category: str
    prompt: str                            # the turn to answer: the first, or the last of a conversation
    earlier: tuple[tuple[str, str], ...] = ()   # (user turn, assistant answer) before it, oldest first

    @property
    def messages(self) -> list[dict]:
        """The conversation up to the turn to answer, as chat-template messages."""
        chat = [{"role": role, "content": text} for pair in self.earlier for role, text in zip(("user", "assistant"), pair)]
        return chat + [{"role": "user", "content": self.prompt}]

    @property
    def sha(self) -> str:
        """Short hash of what the model sees: a record for an edited question is not reused."""
        seen = "\n".join(text for pair in self.earlier for text in pair)
        return hashlib.sha256(f"{self.category}\n{seen}{self.prompt}".encode()).hexdigest()[:12]


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
    qid = obj["question_id"]
    if isinstance(qid, bool) or not isinstance(qid, (str, int)) or not str(qid).strip():
        raise QuestionFileError(f"{where}: question_id must be a non-empty string or an integer, got {qid!r:.80}")
    if "answers" not in obj:
        return Question(str(obj["question_id"]), obj["category"], turns[0])
    answers = obj["answers"]
    if not isinstance(answers, list) or len(answers) != len(turns) - 1 or not all(
            isinstance(t, str) and t.strip() for t in turns + answers):
        raise QuestionFileError(f"{where}: answers must be the assistant's answers to every turn but the last "
                                f"({len(turns) - 1} non-empty strings for {len(turns)} turns), got {answers!r:.80}")
    return Question(str(obj["question_id"]), obj["category"], turns[-1], tuple(zip(turns[:-1], answers)))


def read_questions(path: str | Path, categories: list[str] | None = None, limit: int | None = None) -> list[Question]:
    """The questions of a Spec-Bench jsonl file, filtered by category, the first `limit` of them."""
    path = Path(path)
    if not path.is_file():
        state = "is a directory" if path.is_dir() else "is not a regular file" if path.exists() else "does not exist"
        raise QuestionFileError(f"question file {path} {state}: "
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
