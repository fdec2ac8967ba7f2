"""The code gives reasons, not measurements: no docstring or comment in labkit quotes a measured time or speedup
(a number goes stale with every kernel and every CPU; the docs pages and data/bench/ keep them, with their machine)."""
import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MEASURED = re.compile(r"\d(\.\d+)? ?(ms|µs|us)\b|\d\.\d+ ?s\b|\d+(\.\d+)? seconds\b|\d(\.\d+)?x (plain|faster|slower|AR)"
                      r"|\d\.\d+x\b|\d+(\.\d+)? ?tok(ens)?/s\b|\d+(\.\d+)?% (faster|slower|slow)")


def prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring and comment of a module."""
    src = path.read_text()
    found = [(getattr(node, "lineno", 1), ast.get_docstring(node, clean=False))
             for node in ast.walk(ast.parse(src))
             if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    found += [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
              if t.type == tokenize.COMMENT]
    return [(line, text) for line, text in found if text]


def test_no_docstring_or_comment_quotes_a_measured_time():
    hits = [f"{path.relative_to(REPO)}:{line}: {m.group(0)!r} in ...{text[max(0, m.start() - 50):m.end() + 10]!r}"
            for path in sorted((REPO / "labkit").rglob("*.py"))
            for line, text in prose(path) for m in MEASURED.finditer(text)]
    assert not hits, "cite the docs page that measures it instead:\n" + "\n".join(hits)
