"""Text at the edges: turn a trace back into coloured pieces (terminal or HTML).

Decoding happens here, after the run, never inside the decode loop. Each piece is decoded
in context (the text of prefix + token minus the text of prefix), so multi-byte characters
split across tokens come out whole.
"""
from __future__ import annotations

import html as _html
from dataclasses import dataclass

from ..core.trace import Trace

KINDS = ("accepted", "rejected", "correction", "bonus", "target")
ANSI = {"accepted": "\033[32m", "rejected": "\033[9;31m", "correction": "\033[33m", "bonus": "\033[1;34m",
        "target": ""}
CSS = {"accepted": "background:#c8f7c5", "rejected": "background:#f9c0c0;text-decoration:line-through",
       "correction": "background:#ffd59e", "bonus": "background:#9fc2f5;font-weight:bold", "target": ""}


@dataclass
class Piece:
    text: str
    kind: str      # one of KINDS
    step: int      # index of the target forward that decided it


def pieces(trace: Trace, prompt_ids: list[int], tokenizer, max_rejected: int | None = None,
           hide_control: bool = False) -> list[Piece]:
    """Every proposed and committed token of a run, in order, labelled by what the target did with it.

    A wide draft (a tree, a lookahead window) rejects many guesses a step; to keep the answer
    readable, `max_rejected` shows at most that many of each step's rejected guesses (the first:
    what the target turned down at the first mismatch), and `hide_control` stops a step's rejected
    guesses at the first control token (<|im_end|> and the like), which is never text.
    """
    if max_rejected is not None and max_rejected < 0:
        raise ValueError(f"max_rejected must be >= 0 (or None: every rejected guess), got {max_rejected}")
    control = set(tokenizer.all_special_ids) if hide_control else set()
    out, context = [], list(prompt_ids)
    base = tokenizer.decode(context)

    def text_of(extra: list[int]) -> str:
        return tokenizer.decode(context + extra)[len(base):]

    for i, s in enumerate(trace.steps):
        kept = s.accepted_tokens
        for j in range(len(kept)):
            out.append(Piece(text_of(kept[: j + 1])[len(text_of(kept[:j])):], "accepted", i))
        rejected = s.rejected_tokens
        if control:
            rejected = rejected[:next((j for j, t in enumerate(rejected) if t in control), len(rejected))]
        rejected = rejected[:max_rejected]
        for j in range(len(rejected)):
            prev = text_of(kept + rejected[:j])
            out.append(Piece(text_of(kept + rejected[: j + 1])[len(prev):], "rejected", i))
        kind = "target" if not s.proposed else ("bonus" if s.bonus else "correction")
        out.append(Piece(text_of(kept + [s.next_token])[len(text_of(kept)):], kind, i))
        context += kept + [s.next_token]
        base = tokenizer.decode(context)
    n_cut = sum(s.n_committed for s in trace.steps) - trace.n_generated   # tokens past EOS / the limit
    if n_cut > 0:
        cut = set([k for k, p in enumerate(out) if p.kind != "rejected"][-n_cut:])
        out = [p for k, p in enumerate(out) if k not in cut]
    return out


def committed_text(ps: list[Piece], trace: Trace) -> list[Piece]:
    """The pieces without the end-of-sequence token a run stopped on: it ends the text, it is not part of it."""
    if trace.stop_reason != "eos":
        return ps
    last = max(k for k, p in enumerate(ps) if p.kind != "rejected")
    return ps[:last] + ps[last + 1:]


def to_ansi(ps: list[Piece], colour: bool = True) -> str:
    if not colour:
        return "".join(p.text for p in ps if p.kind != "rejected")
    return "".join(f"{ANSI[p.kind]}{p.text}\033[0m" if ANSI[p.kind] else p.text for p in ps)


def to_html(ps: list[Piece]) -> str:
    spans = "".join(f'<span class="lk-{p.kind}" title="step {p.step}: {p.kind}" style="{CSS[p.kind]}">'
                    f"{_html.escape(p.text)}</span>" for p in ps)
    legend = " ".join(f'<span style="{CSS[k]};padding:0 4px">{k}</span>' for k in KINDS[:4])
    return f'<div style="font-family:monospace;white-space:pre-wrap;line-height:1.6">{spans}</div>' \
           f'<div style="font-size:small;margin-top:4px">{legend}</div>'
