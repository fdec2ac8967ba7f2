"""The one ending every benchmark script shares: a result written as <stem>.json, .md and .png.

    from labkit.bench.writer import markdown_table, subplots, write_outputs

    def markdown(result: dict) -> str:                    # the table, regenerable from the .json
        lines = ["# Title", ""] + markdown_table(result["rows"], {"B": "{batch}", "speedup": "{speedup:.2f}x"})
        return "\\n".join(lines) + "\\n"

    def plot(result: dict):                               # -> a matplotlib Figure, not saved
        fig, ax = subplots(figsize=(6, 4))
        ...
        return fig

    write_outputs(out / "batch_cpu", result, markdown, plot)   # batch_cpu.json, batch_cpu.md, batch_cpu.png

Standard library only at import: matplotlib is imported when a figure is made (`subplots`).
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ALIGN = {"-": "---", "l": ":---", "r": "---:", "c": ":---:"}


def write_outputs(stem: str | Path, result: dict, markdown: str | Callable[[dict], str] | None = None,
                  fig: Any = None, *, json_newline: bool = False, dpi: int = 120) -> list[Path]:
    """Write `result` to <stem>.json, `markdown` to <stem>.md and `fig` to <stem>.png; the paths written.

    The suffixes are appended to `stem` (`out/run.v2` -> `out/run.v2.json`); its folder is created.
    The JSON is `json.dumps(result, indent=1)`, ending in a newline only with `json_newline`.
    `markdown` is the Markdown text or a function of `result` returning it; `fig` a matplotlib
    Figure or a function of `result` returning one (saved at `dpi`, then closed). Given as
    functions, they run after the JSON is on disk: an error in a table or a plot cannot lose
    the numbers of a long run. Either may be None (no .md, no .png).
    """
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_name(stem.name + ".json")]
    paths[0].write_text(json.dumps(result, indent=1) + ("\n" if json_newline else ""), encoding="utf-8")
    if markdown is not None:
        paths.append(stem.with_name(stem.name + ".md"))
        paths[-1].write_text(markdown(result) if callable(markdown) else markdown, encoding="utf-8")
    if fig is not None:
        figure = fig(result) if callable(fig) else fig
        paths.append(stem.with_name(stem.name + ".png"))
        figure.savefig(paths[-1], dpi=dpi)
        if "matplotlib.pyplot" in sys.modules:       # free it; a Figure made without pyplot has nothing to close
            sys.modules["matplotlib.pyplot"].close(figure)
    return paths


def markdown_table(rows: Sequence[Mapping], columns: Sequence[str] | Mapping[str, str | Callable[[Mapping], str]],
                   align: str | None = None) -> list[str]:
    """A Markdown table's lines (header, separator, one line per row), to add to a list of lines.

    `columns` maps each header to its cell: a format string filled from the row
    (`"{speedup:.2f}x"`, `"{rows_equal}/{batch}"`) or a function of the row returning the
    text; a list of keys is short for `{key: "{key}"}`. `align` has one letter per column:
    `-` (none, `---`), `l` (`:---`), `r` (`---:`) or `c` (`:---:`); default none for all.
    """
    if not isinstance(columns, Mapping):
        columns = {key: "{" + key + "}" for key in columns}
    align = align or "-" * len(columns)
    if len(align) != len(columns):
        raise ValueError(f"align {align!r} has {len(align)} letters for {len(columns)} columns")

    def cell(spec, row) -> str:
        return spec(row) if callable(spec) else spec.format_map(row)

    lines = ["| " + " | ".join(columns) + " |", "|" + "".join(ALIGN[a] + "|" for a in align)]
    lines += ["| " + " | ".join(cell(spec, row) for spec in columns.values()) + " |" for row in rows]
    return lines


def subplots(*args, **kwargs):
    """`matplotlib.pyplot.subplots` on the non-interactive Agg backend (matplotlib imported only here)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(*args, **kwargs)
