"""The notebooks run whatever forward path this machine's calibration chose.

Notebook 01 compares the target's chosen path against the reference path. Its cells run here, as
stored, on a tiny checkpoint loaded on each path the calibration could choose (the reference path
included, where both rows of the comparison run the same kernels).
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import pytest
import torch
from conftest import save_tiny_checkpoint

from labkit.models import calibrate
from labkit.models.loading import load_model

matplotlib.use("Agg")
NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "01_autoregressive_kv_cache.ipynb"


def code_cells(first: str, last: str) -> list[str]:
    """The notebook's code cells from the one starting with `first` to the last one containing `last`."""
    cells = ["".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    start = next(i for i, c in enumerate(cells) if c.startswith(first))
    end = max(i for i, c in enumerate(cells) if last in c)
    return [cells[0]] + cells[start:end + 1]               # the imports, then the cells of the comparison


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A target and a draft (two checkpoints: the notebook's tables are keyed by model name)."""
    folder = tmp_path_factory.mktemp("nb01")
    for name, seed in (("target", 0), ("draft", 1)):
        save_tiny_checkpoint(folder / name, "qwen2", seed=seed)
    return folder


@pytest.mark.parametrize("path", calibrate.candidates("bf16"))
def test_path_comparison_cells_run_on_every_path(checkpoints, path, capsys):
    import matplotlib.pyplot as plt
    target = load_model(str(checkpoints / "target"), dtype="bf16", backend=path, progress=False)
    draft = load_model(str(checkpoints / "draft"), dtype="bf16", backend="reference", progress=False)
    assert target.path.name == path
    names, shown = {"target": target, "draft": draft, "prompt_ids": torch.arange(2, 30)}, []
    imports, *cells = code_cells("ks = ", "by_role")

    def run(source: str) -> None:
        exec(compile(source.replace("plt.show()", "plt.close('all')"), f"{NOTEBOOK.name}, a code cell", "exec"), names)
    run(imports)
    names["display"] = shown.append                 # what the cells display, kept to read
    for source in cells:
        run(source)
    plt.close("all")
    by_role = names["by_role"]
    assert list(by_role.columns) == ["chosen", "reference"] and list(by_role.index) == names["ks"]
    sentence = "".join(m.data for m in shown if hasattr(m, "data"))
    said = "same kernels" if path == "reference" else f"the {path} path is the"
    assert said in sentence and "t(1): chosen" in capsys.readouterr().out
