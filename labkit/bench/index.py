"""The index of stored results: every entry of data/bench/, what it is, where and when it was measured, the commit
that recorded it, and the pages, notebooks and tests that cite it.

    python -m labkit.bench.index              # rewrites data/bench/README.md

An entry is a folder (a bench run, a script's output) or the files of one name (name.json, name.md, name.png).
What it is comes from its first Markdown heading; the machine and the date from its JSON (a bench run's meta
line, a script's "machine" or "ran_on"); the commit from git. tests/test_bench_index.py checks that the index
lists every entry and that something outside data/bench/ cites each one.
"""
from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..files.shipped import CHECKOUT

ROOT = CHECKOUT                      # the checkout: its data/bench/ and every file that may cite an entry
BENCH = ROOT / "data" / "bench"
# where a citation counts: the pages, the notebooks, the tests, the code and its scripts, the other data READMEs
CITING = ("README.md", "docs", "notebooks", "tests", "labkit", "scripts", "data/heads", "data/mtp", "data/distill")
TEXT = {".md", ".py", ".ipynb", ".txt", ".json", ".cfg"}


@dataclass
class Entry:
    name: str
    files: list[Path]
    what: str = ""
    machine: str = ""
    date: str = ""
    commit: str = ""
    cited_by: tuple[str, ...] = ()


def entries(bench: Path = BENCH) -> dict[str, list[Path]]:
    """{name: its files}: each folder, and each group of loose files sharing a name before the extension."""
    found: dict[str, list[Path]] = {}
    for path in sorted(bench.iterdir()):
        if path.name == "README.md" or path.name.startswith("."):
            continue
        name = path.name if path.is_dir() else path.name.split(".")[0]
        found.setdefault(name, []).append(path)
    return found


def _heading(files: list[Path]) -> str:
    for path in [f for p in files for f in ([p / "README.md", p / "bench.md"] + sorted(p.glob("*.md"))
                                            if p.is_dir() else [p]) if f.suffix == ".md" and f.is_file()]:
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("#"):
                return line.lstrip("# ").strip()
    return ""


def _json_facts(files: list[Path]) -> tuple[str, str]:
    """(machine, date) from the entry's first JSON that says them."""
    paths = [f for p in files for f in (sorted(p.glob("*.json*")) if p.is_dir() else [p]) if ".json" in f.name]
    for path in paths:
        try:
            text = path.read_text(errors="replace")
            data = json.loads(text.splitlines()[0]) if path.suffix == ".jsonl" else json.loads(text)
        except (ValueError, IndexError, OSError):
            continue
        if not isinstance(data, dict):
            continue
        meta = data.get("meta") if isinstance(data.get("meta"), dict) else data.get("facts", data)
        meta = meta if isinstance(meta, dict) else data
        machine = meta.get("machine") or meta.get("ran_on") or data.get("machine") or ""
        if isinstance(machine, dict):
            machine = " ".join(str(machine[k]) for k in ("cpu", "isa") if machine.get(k)) or \
                str(machine.get("device") or machine.get("gpu") or "")
        date = str(meta.get("date") or data.get("date") or "")[:10]
        if machine or date:
            return str(machine).split(";")[0][:80], date
    return "", ""


def _commit(files: list[Path]) -> str:
    try:
        done = subprocess.run(["git", "log", "-1", "--format=%h %cs", "--", *map(str, files)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def citing_files(root: Path = ROOT) -> dict[str, str]:
    """{path relative to the repository: text} of every file where a citation counts."""
    texts = {}
    for top in CITING:
        base = root / top
        paths = [base] if base.is_file() else sorted(base.rglob("*")) if base.is_dir() else []
        for path in paths:
            if path.is_file() and path.suffix in TEXT and not {"__pycache__", ".ipynb_checkpoints"} & set(path.parts) \
                    and path.stat().st_size < 5_000_000:
                texts[str(path.relative_to(root))] = path.read_text(errors="replace")
    return texts


NAMED = re.compile(r"bench/([\w-]+)|(?<![\w/-])([\w-]+)\.(?:jsonl?|md|png|csv|txt)\b")


def names_in(texts: dict[str, str]) -> dict[str, set[str]]:
    """{path: the entry names it cites}: "bench/NAME" (the whole name: NAME_more is another entry), or one of an
    entry's files by name ("NAME.md")."""
    return {path: {a or b for a, b in NAMED.findall(text)} for path, text in texts.items()}


def cited_by(name: str, named: dict[str, set[str]]) -> tuple[str, ...]:
    """The files that cite the entry."""
    return tuple(sorted(path for path, names in named.items() if name in names))


def build(bench: Path = BENCH, root: Path = ROOT, with_git: bool = True) -> list[Entry]:
    named = names_in(citing_files(root))
    rows = []
    for name, files in entries(bench).items():
        machine, date = _json_facts(files)
        rows.append(Entry(name, files, _heading(files), machine, date, _commit(files) if with_git else "",
                          cited_by(name, named)))
    return rows


def render(rows: list[Entry]) -> str:
    lines = ["# Stored results", "",
             "Every entry of `data/bench/`: what it measured, on which machine and when (as its own files say), the "
             "commit that last wrote it, and where the lab cites it. Each entry's files say how to remake it (its "
             "README or the command in its report). Written by `python -m labkit.bench.index`.", "",
             "| entry | what | machine | date | commit | cited by |", "|---|---|---|---|---|---|"]
    for e in rows:
        shown = e.name + ("/" if len(e.files) == 1 and e.files[0].is_dir() else
                          " (" + ", ".join(sorted(f.suffix for f in e.files)) + ")")
        cites = ", ".join(f"`{c}`" for c in e.cited_by[:4]) + (f" and {len(e.cited_by) - 4} more"
                                                                  if len(e.cited_by) > 4 else "")
        what = e.what.replace("|", "/")
        lines.append(f"| `{shown}` | {what} | {e.machine.replace('|', '/')} | {e.date} | {e.commit} | {cites} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(BENCH / "README.md"))
    ap.add_argument("--uncited", action="store_true", help="only list the entries nothing cites")
    args = ap.parse_args(argv)
    rows = build()
    if args.uncited:
        print("\n".join(e.name for e in rows if not e.cited_by))
        return
    Path(args.out).write_text(render(rows))
    print(f"{len(rows)} entries in {args.out}")


if __name__ == "__main__":
    main()
