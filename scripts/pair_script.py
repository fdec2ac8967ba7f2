"""What the scripts that time the embedded pair share: their common options, and the pair on the packed path.

    from pair_script import load_pair, pair_options
    p = pair_options(__doc__, repeats=7)               # --precision, --repeats, --questions, --out
    a = p.parse_args()
    target, draft, load_before = load_pair(a.precision)
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch


def pair_options(doc: str, repeats: int) -> argparse.ArgumentParser:
    """A parser with the options every such script takes; a script adds its own."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precision", default="int4")
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--questions", type=Path, default=Path("data/questions/labkit_bench.jsonl"))
    p.add_argument("--out", type=Path, required=True)
    return p


def load_pair(precision: str):
    """2 threads, the load average before anything runs, then the target and the draft on the packed path."""
    from labkit import load_model
    from labkit.models.hub import DEFAULT_DRAFT, DEFAULT_TARGET
    torch.set_num_threads(2)
    load_before = [round(x, 2) for x in os.getloadavg()]
    target = load_model(DEFAULT_TARGET, dtype=precision, backend="packed", progress=False)
    draft = load_model(DEFAULT_DRAFT, dtype=precision, backend="packed", progress=False)
    return target, draft, load_before
