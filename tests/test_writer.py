"""The benchmark scripts' shared ending: <stem>.json, .md and .png, and the Markdown tables in them."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.bench import writer
from labkit.bench.writer import markdown_table, subplots, write_outputs

ROOT = Path(__file__).resolve().parents[1]
RESULT = {"date": "2026-01-01T00:00:00+00:00", "device": "cpu γ", "gammas": [2, 4],
          "rows": [{"batch": 1, "speedup": 1.23456, "ok": True}, {"batch": 16, "speedup": 0.5, "ok": None}]}


def test_json_md_and_png_written_and_returned_in_order(tmp_path):
    fig, ax = subplots(figsize=(2, 2))
    ax.plot([1, 2], [3, 4])
    paths = write_outputs(tmp_path / "run", RESULT, "# table\n", fig)
    assert paths == [tmp_path / "run.json", tmp_path / "run.md", tmp_path / "run.png"]
    assert json.loads(paths[0].read_text()) == RESULT                       # round trip
    assert paths[1].read_bytes() == "# table\n".encode()
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_format_is_the_scripts_own(tmp_path):
    """indent=1, ASCII escapes, no newline at the end unless asked (bench_heads.py writes one)."""
    (plain,) = write_outputs(tmp_path / "a", RESULT)
    assert plain.read_text() == json.dumps(RESULT, indent=1)
    assert "\\u03b3" in plain.read_text() and not plain.read_text().endswith("\n")
    (newline,) = write_outputs(tmp_path / "b", RESULT, json_newline=True)
    assert newline.read_text() == json.dumps(RESULT, indent=1) + "\n"


@pytest.mark.parametrize("stem", ["data/mtp/step_time", "data/mtp/memory", "data/bench/batch_cpu"])
def test_committed_results_are_rewritten_byte_for_byte(tmp_path, stem):
    committed = (ROOT / stem).with_suffix(".json").read_bytes()
    (path,) = write_outputs(tmp_path / Path(stem).name, json.loads(committed))
    assert path.read_bytes() == committed


def test_nothing_but_the_json_without_markdown_or_figure(tmp_path):
    assert write_outputs(tmp_path / "only", RESULT) == [tmp_path / "only.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["only.json"]


def test_markdown_written_unchanged_from_text_or_function(tmp_path):
    text = "# Results γ=4\n\n| a |\n|---|\n| α |\n"
    write_outputs(tmp_path / "text", RESULT, text)
    write_outputs(tmp_path / "func", RESULT, lambda result: text if result is RESULT else "wrong")
    assert (tmp_path / "text.md").read_bytes() == (tmp_path / "func.md").read_bytes() == text.encode("utf-8")


def test_figure_function_gets_the_result_and_runs_after_the_json_is_saved(tmp_path):
    seen = []

    def plot(result):
        seen.append((result, (tmp_path / "r.json").exists(), (tmp_path / "r.md").exists()))
        fig, _ = subplots()
        return fig

    paths = write_outputs(tmp_path / "r", RESULT, "md\n", plot)
    assert seen == [(RESULT, True, True)] and paths[-1] == tmp_path / "r.png" and paths[-1].stat().st_size > 0


def test_a_failing_plot_does_not_lose_the_numbers(tmp_path):
    def plot(result):
        raise RuntimeError("plot broke")

    with pytest.raises(RuntimeError, match="plot broke"):
        write_outputs(tmp_path / "r", RESULT, "md\n", plot)
    assert json.loads((tmp_path / "r.json").read_text()) == RESULT and (tmp_path / "r.md").read_text() == "md\n"


def test_figure_saved_at_the_scripts_dpi_and_closed(tmp_path):
    import matplotlib.pyplot as plt
    from PIL import Image

    fig, _ = subplots(figsize=(2, 1))
    (_, png) = write_outputs(tmp_path / "f", RESULT, fig=fig)
    assert Image.open(png).size == (240, 120)                                 # 120 dpi, as every script saved
    assert not plt.fignum_exists(fig.number)
    write_outputs(tmp_path / "g", RESULT, fig=fig, dpi=50)
    assert Image.open(tmp_path / "g.png").size == (100, 50)


def test_suffixes_appended_and_folders_made(tmp_path):
    paths = write_outputs(tmp_path / "new" / "deeper" / "run.v2", RESULT, "x\n")
    assert [p.name for p in paths] == ["run.v2.json", "run.v2.md"] and paths[0].parent == tmp_path / "new" / "deeper"
    assert write_outputs(str(tmp_path / "s"), RESULT)[0] == tmp_path / "s.json"


def test_markdown_table_from_format_strings_and_functions():
    lines = markdown_table(RESULT["rows"], {"B": "{batch}", "speedup": "{speedup:.2f}x",
                                            "ok": lambda r: "n/a" if r["ok"] is None else str(r["ok"])})
    assert lines == ["| B | speedup | ok |", "|---|---|---|", "| 1 | 1.23x | True |", "| 16 | 0.50x | n/a |"]


def test_markdown_table_keys_with_spaces_list_columns_and_alignment():
    rows = [{"way": "naive", "peak MiB": 1340.1, "loss": 41.75}]
    assert markdown_table(rows, ["way", "loss"]) == ["| way | loss |", "|---|---|", "| naive | 41.75 |"]
    assert markdown_table(rows, {"way": "{way}", "peak": "{peak MiB:.0f}", "loss": "{loss:.1f}"}, align="lrc") == [
        "| way | peak | loss |", "|:---|---:|:---:|", "| naive | 1340 | 41.8 |"]
    assert markdown_table([], ["a", "b"], align="-r") == ["| a | b |", "|---|---:|"]
    with pytest.raises(ValueError, match="2 letters for 3 columns"):
        markdown_table(rows, ["way", "loss", "peak MiB"], align="rr")


def test_markdown_table_reproduces_a_committed_table():
    """data/mtp/memory.md's table, from data/mtp/memory.json, as scripts/mtp_memory.py writes it."""
    result = json.loads((ROOT / "data/mtp/memory.json").read_text())
    table = markdown_table(result["rows"], {"way": "{way}", "peak above start (MiB)": "{peak_above_start_mib:.0f}",
                                            "loss": "{loss:.4f}", "grad norm": "{grad_norm:.4f}"}, align="-rrr")
    assert "\n".join(table) in (ROOT / "data/mtp/memory.md").read_text()


def test_module_imports_only_the_standard_library():
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('w', sys.argv[1]); "
            "spec.loader.exec_module(importlib.util.module_from_spec(spec)); "
            "heavy = sorted({'matplotlib', 'numpy', 'torch', 'labkit'} & {m.split('.')[0] for m in sys.modules}); "
            "print(heavy); sys.exit(bool(heavy))")
    out = subprocess.run([sys.executable, "-c", code, writer.__file__], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
