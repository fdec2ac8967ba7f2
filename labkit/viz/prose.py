"""Sentences rendered from the numbers they state, so their comparison words follow the numbers.

A notebook never types a measured number into its prose (tests/test_notebook_prose.py checks the
Markdown cells); it renders the sentence from the value. Comparing two timings also needs a rule
for noise: on a shared CPU two runs of the same thing differ by a few percent, so a difference
within `noise` is "level", never "faster".

    versus(1.54, {"γ = 1": 1.21, "γ = 4": 1.54, "γ = 8": 1.62})
    # 'faster than γ = 1, level with γ = 4 (within 5%, timing noise) and slower than γ = 8'
"""
from __future__ import annotations

NOISE = 0.05            # relative difference between two timings that a shared CPU can make or undo


def words(items: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    items = list(items)
    if len(items) <= 1:
        return "".join(items)
    return f"{', '.join(items[:-1])} and {items[-1]}"


def compare(value: float, other: float, noise: float = NOISE, more: str = "faster than", less: str = "slower than",
            same: str = "level with") -> str:
    """`more`, `less` or `same`: how `value` compares with `other`, a relative difference within `noise` being level."""
    if noise < 0:
        raise ValueError(f"noise is a relative difference >= 0 (0.05: 5%), got {noise}")
    if value > other * (1 + noise):
        return more
    if value * (1 + noise) < other:
        return less
    return same


def versus(value: float, others: dict[str, float], noise: float = NOISE, all_name: str | None = None,
           more: str = "faster than", less: str = "slower than", same: str = "level with") -> str:
    """How `value` compares with each of `others` ({name: value}), grouped: 'faster than a and b, level with c
    (within 5%, timing noise) and slower than d'. Every name lands in exactly one group; when all land in one,
    `all_name` names them together ('faster than every fixed γ')."""
    if not others:
        raise ValueError("versus needs at least one value to compare with")
    groups = {more: [], same: [], less: []}
    for name, other in others.items():
        groups[compare(value, other, noise, more, less, same)].append(name)
    parts = []
    for word, names in groups.items():
        if names:
            who = all_name if all_name and len(names) == len(others) > 1 else words(names)
            parts.append(f"{word} {who}" + (f" (within {noise:.0%}, timing noise)" if word == same else ""))
    return words(parts)
