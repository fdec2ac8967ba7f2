"""`python -m labkit book` (what `make book` runs): the notebooks, with their stored outputs, as a static site.

Each notebook becomes one HTML page (nbconvert's JupyterLab template) in build/book/, with an
index and previous / next links, readable by opening build/book/index.html or serving the folder
(`python -m http.server -d build/book`). Nothing runs and nothing is fetched:
- the figures are embedded in the pages;
- the mathematics is typeset by MathJax from the `jupyter-server-mathjax` package, copied next to
  the pages;
- the recorded runs (labkit.viz.replay) are plain HTML and JavaScript inside the pages, so they
  play in the browser: step through a real speculative run, move γ;
- an ipywidgets control, which needs a kernel, becomes a note that says so and where the recorded
  run or the live notebook is.
A page that still asked the network for a script or a stylesheet would be a bug: `build_book` fails
on one.
"""
from __future__ import annotations

import html as _html
import os
import re
import shutil
from pathlib import Path

from .files.textfile import check_regular, writable_dir

NOTEBOOKS = "notebooks"
OUT = Path("build") / "book"
MATHJAX = "mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
NEEDS_KERNEL = ('<div class="lk-needs-kernel" style="border:1px dashed #bbb;padding:6px;color:#555;'
                'font-family:sans-serif;font-size:13px">An interactive control that needs a running kernel: open '
                'this notebook with <code>make lab</code> and run it. The recorded runs on this page play '
                'without one.</div>')
# the MathJax the package ships has the STIX-Web fonts only (not MathJax's TeX fonts): use them, never ask for others
MATHJAX_FONTS = ('<script type="text/x-mathjax-config">MathJax.Hub.Config({"HTML-CSS": {availableFonts: ["STIX-Web"], '
                 'preferredFont: "STIX-Web", webFont: "STIX-Web", imageFont: null}, '
                 'tex2jax: {inlineMath: [["$", "$"]], processEscapes: true}, messageStyle: "none"});</script>')
REMOTE = re.compile(r'<(?:script|link)\b[^>]*\b(?:src|href)="(?:https?:)?//[^"]*"[^>]*>'
                    r'|\bimport\s*\(\s*["\'](?:https?:)?//[^"\']*', re.I)
# nbconvert's loader of mermaid diagrams, which imports mermaid from a CDN: the book draws none (a diagram stays text)
MERMAID = re.compile(r'<script type="module">(?:(?!</script>).)*?mermaid\.esm(?:(?!</script>).)*</script>', re.S)


def chapters(root: Path) -> list[Path]:
    """The notebooks in reading order (their file names start with the chapter number)."""
    found = sorted((root / NOTEBOOKS).glob("[0-9][0-9]_*.ipynb"))
    if not found:
        raise FileNotFoundError(f"no notebooks in {root / NOTEBOOKS}: run `python -m labkit book` in a checkout")
    return found


def read_notebook(path: Path):
    """A notebook as nbformat reads it, checked against its schema; a file that is not one names itself."""
    import nbformat
    check_regular(path, "the notebook")
    try:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
    except (ValueError, TypeError, KeyError, AttributeError, OSError, nbformat.ValidationError) as e:
        reason = getattr(e, "message", None) or str(e)
        raise ValueError(f"{path} is not a notebook the book can read ({reason.splitlines()[0][:160]}): restore "
                         f"it (git checkout -- {path.parent.name}/{path.name}) or fix it in JupyterLab") from None
    return nb


def title_of(nb) -> str:
    """The first Markdown heading of the notebook ('02 · Greedy speculative decoding')."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return "untitled"


def offline(nb):
    """The notebook as the book shows it: widget views (which need a kernel or a CDN) become a note."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if WIDGET_VIEW in out.get("data", {}):
                out["data"] = {"text/html": NEEDS_KERNEL}
    return nb


def page(body: str, names: list[str], titles: list[str], i: int, data_link: str) -> str:
    """nbconvert's page with the book's navigation, links between chapters made .html, and no remote scripts."""
    body = re.sub(r'<script[^>]*src="[^"]*require[^"]*"[^>]*>\s*</script>', "", body)    # only widgets use it
    body = MERMAID.sub("", body)
    body = re.sub(r'href="(?:\./)?(\d\d_[\w-]+)\.ipynb', r'href="\1.html', body)
    body = body.replace('href="../data/', f'href="{data_link}/')
    prev = f'<a href="{names[i - 1]}.html">← {_html.escape(titles[i - 1])}</a>' if i > 0 else ""
    nxt = f'<a href="{names[i + 1]}.html">{_html.escape(titles[i + 1])} →</a>' if i + 1 < len(names) else ""
    nav = (f'<nav class="lk-book-nav" style="display:flex;justify-content:space-between;gap:12px;padding:8px 16px;'
           f'font-family:sans-serif;font-size:14px;border-bottom:1px solid #ddd"><span>{prev}</span>'
           f'<a href="index.html">contents</a><span>{nxt}</span></nav>')
    body = re.sub(r"(</head>)", lambda m: MATHJAX_FONTS + m.group(1), body, count=1)
    body = re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + nav, body, count=1)
    return re.sub(r"(</body>)", lambda m: nav + m.group(1), body, count=1)


GLOSSARY = Path("docs") / "glossary.md"


def glossary(root: Path) -> str:
    """docs/glossary.md as a page of the book: the lab's words mapped to the papers' (MathJax from the folder)."""
    import mistune
    body = mistune.html((root / GLOSSARY).read_text(encoding="utf-8"))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Glossary</title>
{MATHJAX_FONTS}
<script src="{MATHJAX}"></script>
<style>table {{border-collapse: collapse}} td, th {{border: 1px solid #ccc; padding: 4px 8px; vertical-align: top;
text-align: left}}</style></head>
<body style="font-family:sans-serif;max-width:1100px;margin:30px auto;line-height:1.45">
<nav><a href="index.html">contents</a></nav>
{body}</body></html>
"""


def index(names: list[str], titles: list[str]) -> str:
    items = "\n".join(f'<li><a href="{n}.html">{_html.escape(t)}</a></li>' for n, t in zip(names, titles))
    items += '\n<li><a href="glossary.html">Glossary: the lab\'s words and the papers\'</a></li>'
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>labkit: speculative decoding, step by step</title></head>
<body style="font-family:sans-serif;max-width:760px;margin:40px auto;line-height:1.5">
<h1>labkit: speculative decoding, step by step</h1>
<p>The lab's notebooks with the outputs stored when they last ran: every number was measured on the
machine each notebook names at its top. Nothing here runs a model; the recorded runs play in the page.
To run them yourself: <code>make lab</code>.</p>
<ol style="list-style:none;padding-left:0">
{items}
</ol></body></html>
"""


def copy_mathjax(out: Path) -> None:
    try:
        import jupyter_server_mathjax
    except ImportError:
        raise FileNotFoundError("the book typesets its mathematics offline with the jupyter-server-mathjax package: "
                                "`make venv` installs it (or pip install jupyter-server-mathjax)") from None
    src = Path(jupyter_server_mathjax.__file__).parent / "static"
    if not (out / "mathjax" / "MathJax.js").exists():
        shutil.copytree(src, out / "mathjax", dirs_exist_ok=True)


def build_book(root: Path, out: Path | None = None) -> list[Path]:
    """Write the book under `out` (default: root/build/book); return its pages: the index, the chapters, the
    glossary."""
    from nbconvert import HTMLExporter
    from tqdm.auto import tqdm
    files = chapters(root)
    nbs = [read_notebook(f) for f in files]               # every notebook read and checked before anything is written
    out = (root / OUT) if out is None else writable_dir(out, "--out")
    out.mkdir(parents=True, exist_ok=True)
    copy_mathjax(out)
    names, titles = [f.stem for f in files], [title_of(nb) for nb in nbs]
    exporter = HTMLExporter(template_name="lab", mathjax_url=MATHJAX)
    data_link = Path(os.path.relpath(root / "data", out)).as_posix()
    pages = [out / "index.html"]
    pages[0].write_text(index(names, titles), encoding="utf-8")
    for i, nb in enumerate(tqdm(nbs, desc="book", unit="chapter")):
        body, _ = exporter.from_notebook_node(offline(nb))
        html = page(body, names, titles, i, data_link)
        if remote := REMOTE.findall(html):
            raise ValueError(f"{names[i]}: the page would fetch {remote[0]!r} from the network; the book must read "
                             "nothing but its own folder")
        pages.append(out / f"{names[i]}.html")
        pages[-1].write_text(html, encoding="utf-8")
    pages.append(out / "glossary.html")
    pages[-1].write_text(glossary(root), encoding="utf-8")
    return pages
