"""A benchmark's results file, `results.jsonl`: one JSON record a line, checked as it is read and as it is written.

Two kinds of line: a run's meta (`{"run": key, "meta": {...}}`, the settings and the machine, written when a
run starts) and one result per (question, method, repeat). A record is data someone may have edited, damaged
or copied from elsewhere, so every line is checked on read: JSON, the keys of its kind, each value's type
and range (seconds finite and positive, token counts whole and not negative). A damaged line is an error
naming the file and line; only the last line, cut short by a kill while it was written, is skipped, and
the next append replaces it, so a cut-short line never stays in the middle of the file.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..files.textfile import read_text

RESULTS = "results.jsonl"
MAX_RESULTS_BYTES = 1 << 30
RESULT_KEYS = ("question_id", "question_sha", "category", "method", "reference", "exact", "new_tokens", "seconds",
               "tokens", "target_forwards", "draft_time", "verify_time", "steps")


class DamagedResults(ValueError):
    """A results file with a line that is not a benchmark record; the message names the file and line."""


def _number(x, low: float = 0.0, strict: bool = False) -> bool:
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    return ok and (x > low if strict else x >= low)


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def problem_of(record: object) -> str | None:
    """What is wrong with one decoded line as a benchmark record (None: nothing)."""
    if not isinstance(record, dict) or "run" not in record:
        return "is JSON but not a benchmark record (a run's meta, or a result with " + ", ".join(RESULT_KEYS) + ")"
    if not isinstance(record["run"], str) or not record["run"]:
        return f"has a run key {record['run']!r}, not a non-empty string"
    if "meta" in record:
        return None if isinstance(record["meta"], dict) else "is a run's meta line whose meta is not a JSON object"
    if missing := [k for k in RESULT_KEYS if k not in record]:
        return ("is JSON but not a benchmark record (a run's meta, or a result with " + ", ".join(RESULT_KEYS)
                + f"): it lacks {', '.join(missing)}")
    checks = {
        "question_id": isinstance(record["question_id"], (str, int)) and not isinstance(record["question_id"], bool),
        "method": isinstance(record["method"], str) and bool(record["method"]),
        "category": isinstance(record["category"], str),
        "new_tokens": _count(record["new_tokens"]),
        "seconds": _number(record["seconds"], strict=True),
        "tokens": isinstance(record["tokens"], list) and all(_count(t) for t in record["tokens"]),
        "target_forwards": _count(record["target_forwards"]),
        "draft_time": record["draft_time"] is None or _number(record["draft_time"]),
        "verify_time": _number(record["verify_time"]),
        "repeat": _count(record.get("repeat", 0)),
        "steps": record["steps"] is None or (isinstance(record["steps"], list) and all(
            isinstance(s, list) and len(s) >= 5 and all(_number(x) for x in s) for s in record["steps"])),
    }
    if bad := [k for k, ok in checks.items() if not ok]:
        k = bad[0]
        return f"has {k} = {json.dumps(record.get(k))[:60]}, which is not a valid {k}"
    if len(record["tokens"]) != record["new_tokens"]:
        return f"has new_tokens = {record['new_tokens']} but {len(record['tokens'])} tokens"
    return None


def read_results(path: str | Path, skip_damaged: bool = False) -> list[dict]:
    """Every record of a results file, checked (`problem_of`). A damaged line is a DamagedResults naming
    file:line, unless `skip_damaged`; the last line, cut short by a kill (no newline at its end), is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    text = read_text(path, "the results file", max_bytes=MAX_RESULTS_BYTES)
    lines = text.split("\n")
    records = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        cut_short = n == len(lines)                      # no newline after it: a write a kill interrupted
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if cut_short or skip_damaged:
                continue
            raise DamagedResults(f"{path}:{n} is damaged (not JSON: {e.msg} at column {e.colno}): repair or remove "
                                 "that line, or pass --skip-damaged to leave it out") from None
        if (problem := problem_of(record)) is not None:
            if skip_damaged:
                continue
            raise DamagedResults(f"{path}:{n} {problem}: repair or remove that line, give --out a directory of its "
                                 "own, or pass --skip-damaged to leave it out")
        records.append(record)
    return records


def append(path: Path, record: dict) -> None:
    """Add one record as a line, flushed at once; a line cut short by an earlier kill is dropped first."""
    if (problem := problem_of(record)) is not None:
        raise ValueError(f"not a benchmark record, not written to {path}: it {problem}")
    if path.is_file() and path.stat().st_size:
        data = path.read_bytes()
        if not data.endswith(b"\n"):                      # a kill cut the last line short: drop it
            with path.open("r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
