"""The stored notebooks as a learner opens them, before running anything: one true story.

nbval re-runs each notebook and sanitises timings, so it cannot catch a stale or contradictory
stored number. These checks read the stored outputs themselves:
- no traceback, no stored warning, no absolute path of the machine that ran them;
- the kernel name is the installed kernel's (otherwise JupyterLab opens the notebook as modified);
- every notebook opens with the machine it ran on (labkit.viz.machine: CPU, ISA, forward path and
  precision, t(8)/t(1), bandwidth, load), measured on a quiet machine;
- every speedup shown with labkit.viz.machine.speed_table is within its tokens per forward;
- saved widgets carry their state, so JupyterLab draws them before the kernel runs;
- no progress bar is stored (a frozen "0%" bar tells a reader nothing; long work shows one while it runs);
- every import in the notebooks' code resolves (a renamed library name breaks no notebook unseen:
  running them takes an hour, reading their imports a second).
"""
from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import pytest

from labkit.viz.machine import SLACK, MachineFacts, SpeedCheck

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MACHINE_KEYS = {"cpu", "isa", "threads", "load", "others_cpu", "path", "precision", "t1_ms", "t8_ms",
                "verify_ratio", "bandwidth_gbs", "quiet"}
# a path on the machine that stored the outputs (home, work and temporary folders, site-packages)
ABSOLUTE_PATH = re.compile(r"(?<![\w.~])(/(?:root|home|work|tmp|Users|usr/lib|opt)/[\w.\-/]+|[A-Z]:\\\\)")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
FIRST_CODE_CELLS = 4       # the facts come with the imports and the model loading, before any result


def outputs(nb: dict):
    """(cell index, output) for every stored output."""
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            yield i, out


def text_of(out: dict) -> str:
    if out["output_type"] == "stream":
        return "".join(out["text"])
    if out["output_type"] == "error":
        return "\n".join(out.get("traceback", []))
    data = out.get("data", {})
    return "\n".join("".join(v) if isinstance(v, list) else str(v) for k, v in data.items()
                     if k.startswith("text/") or k == "application/json")


def labkit_meta(out: dict) -> dict:
    return out.get("metadata", {}).get("labkit", {})


@pytest.fixture(scope="module")
def kernel_display_name() -> str:
    from jupyter_client.kernelspec import KernelSpecManager
    return KernelSpecManager().get_kernel_spec("python3").display_name


@pytest.fixture(params=NOTEBOOKS, ids=lambda p: p.stem)
def nb(request) -> dict:
    return json.loads(request.param.read_text())


def test_the_notebooks_are_there():
    assert len(NOTEBOOKS) >= 10, [p.name for p in NOTEBOOKS]


def test_no_traceback_or_warning(nb):
    for i, out in outputs(nb):
        assert out["output_type"] != "error", f"cell {i} stored an error: {out.get('ename')}: {out.get('evalue')}"
        text = text_of(out)
        assert "Traceback (most recent call last)" not in text, f"cell {i} stored a traceback"
        if out["output_type"] == "stream" and out["name"] == "stderr":
            assert not re.search(r"\w*Warning\b|warnings\.warn", text), f"cell {i} stored a warning: {text[:300]}"


def test_no_absolute_path(nb):
    for i, out in outputs(nb):
        found = ABSOLUTE_PATH.search(text_of(out))
        assert not found, f"cell {i} stored a path of the machine that ran it: {found.group(0)}"
    for i, cell in enumerate(nb["cells"]):
        found = ABSOLUTE_PATH.search("".join(cell["source"]))
        assert not found, f"cell {i}'s source names a path of one machine: {found.group(0)}"


def test_kernel_name_is_the_installed_one(nb, kernel_display_name):
    spec = nb["metadata"]["kernelspec"]
    assert spec["name"] == "python3"
    assert spec["display_name"] == kernel_display_name, (
        f"saved with kernel {spec['display_name']!r}, installed {kernel_display_name!r}: JupyterLab opens it as "
        "modified. Save it again from the lab, or set metadata.kernelspec.display_name")


def test_opens_with_the_machine_it_ran_on(nb):
    code = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]
    facts = [(i, labkit_meta(out)["machine"]) for i, out in outputs(nb) if "machine" in labkit_meta(out)]
    assert facts, "no 'this machine' output: call labkit.viz.machine.this_machine(model) in the first cells"
    i, first = facts[0]
    assert i in code[:FIRST_CODE_CELLS], f"the machine facts come in cell {i}, after results: move them up"
    assert MACHINE_KEYS <= set(first), f"machine facts lack {MACHINE_KEYS - set(first)}"
    assert first["cpu"] and first["isa"] and first["path"] and first["precision"]
    assert 0 < first["t1_ms"] and 0 < first["t8_ms"]
    assert first["quiet"], (f"recorded while other processes used {first['others_cpu']} cores: re-run it on a "
                            "quiet machine")
    speed_cells = [j for j, out in outputs(nb) if "speed" in labkit_meta(out)]
    assert all(j > i for j in speed_cells), "a speed table comes before the machine it was measured on"


def test_every_stored_speedup_within_tokens_per_forward(nb):
    for i, out in outputs(nb):
        for row in labkit_meta(out).get("speed", []):
            check = SpeedCheck(**row)
            assert check.consistent, (f"cell {i}, {check.label}: {check.speedup:.2f}x at "
                                      f"{check.tokens_per_forward:.2f} tokens per forward (> x{SLACK})")


PROGRESS_BAR = re.compile(r"\d+%\|[^|]*\|\s*\d+/\d+|it/s\]|s/it\]")


def test_no_progress_bar_stored(nb):
    bars = [i for i, out in outputs(nb) if PROGRESS_BAR.search(text_of(out))]
    assert not bars, f"cells {bars} store a progress bar: pass progress=False (or tqdm(disable=True)) in the notebook"


def test_widgets_carry_their_state(nb):
    views = [out["data"][WIDGET_VIEW]["model_id"] for _, out in outputs(nb) if WIDGET_VIEW in out.get("data", {})]
    if not views:
        return
    state = nb["metadata"].get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    missing = [v for v in views if v not in state]
    assert not missing, f"widget views without saved state (drawn as text before the kernel runs): {missing}"


def test_speed_check():
    assert SpeedCheck("x", 2.0, 2.0).consistent
    assert SpeedCheck("x", 2.1, 2.0).consistent            # timer noise
    assert not SpeedCheck("x", 2.70, 2.35).consistent       # a verify pass cannot cost less than a plain step...
    assert SpeedCheck("x", 1.17, 1.05, verify_floor=0.9).consistent       # ...unless 8 tokens cost less than 1 here
    assert not SpeedCheck("x", 1.30, 1.05, verify_floor=0.9).consistent


def test_every_import_resolves(nb):
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        code = "\n".join(line for line in "".join(cell["source"]).splitlines()
                         if not line.lstrip().startswith(("%", "!")))          # IPython magics and shell lines
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)
            elif isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                missing = [a.name for a in node.names if not hasattr(module, a.name)
                           and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
                assert not missing, f"cell {i}: {node.module} has no {missing}"


def test_machine_story_follows_its_numbers():
    def story(t8_ms: float, noise: float) -> str:
        return MachineFacts(cpu="x", isa="avx2", threads=2, torch="2", load=[0.0] * 3, others_cpu=0.0, model="m",
                            path="reference", precision="bf16", t1_ms=10.0, t8_ms=t8_ms, weight_gb=1.0,
                            noise=noise).story()
    assert "less than one" in story(7.8, 0.05) and "slower for one row" in story(7.8, 0.05)
    assert "within the timing noise" in story(9.8, 0.05) and "nearly free" in story(9.8, 0.05)
    assert "noise" not in story(11.0, 0.02) and "nearly free" in story(11.0, 0.02)
    assert "not free" in story(30.0, 0.02) and "at most 2.7x" in story(30.0, 0.02)
