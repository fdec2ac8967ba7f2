"""Spec-Bench-style benchmark: every method on every question, side by side, resumable.

    python -m labkit bench --questions data/questions/labkit_bench.jsonl --limit 1 --out /tmp/bench

questions.py reads the question file, methods.py names what runs (labkit's decoders and
transformers' peers), runner.py runs them and appends one JSON line per finished
(question, method) to results.jsonl (records.py checks each line), report.py turns those lines
into tables and plots.
"""
from .methods import METHODS, Method, MethodResult
from .questions import Question, read_questions
from .report import summarise, write_report
from .runner import BenchConfig, run_bench

__all__ = ["METHODS", "Method", "MethodResult", "Question", "read_questions", "summarise", "write_report",
           "BenchConfig", "run_bench"]
