"""The data curve's plumbing: resumed runs on successive slices, the runs read back, the fitted trend."""
import json
import math

import pytest

from labkit.training.data_curve import fit_log, plot, read_curve, report, run_commands, tokens_for, tokens_seen


def test_each_point_after_the_first_resumes_on_the_next_slice(tmp_path):
    cmds = run_commands("eagle3-ttt", tmp_path / "f", [32, 64, 128], tmp_path / "h", [4, 2, 1], 5, 1e-3)
    assert [c[c.index("--rows") + 1] for c in cmds] == ["0:32", "32:64", "64:128"]
    assert ["--resume" in c for c in cmds] == [False, True, True]
    assert [c[c.index("--epochs") + 1] for c in cmds] == ["4", "2", "1"]        # small first slices: more passes
    assert all(c[c.index("--ttt-steps") + 1] == "5" and "labkit.training.train_eagle" in c for c in cmds)
    medusa = run_commands("medusa", tmp_path / "f", [10, 30], tmp_path / "m", 2, 5, 1e-3)
    assert [c[c.index("--steps") + 1] for c in medusa] == ["20", "40"]          # epochs x rows x 255 / 256
    with pytest.raises(ValueError, match="increasing"):
        run_commands("eagle", tmp_path, [64, 32], tmp_path, 1, 1, 1e-3)
    with pytest.raises(ValueError, match="one per point"):
        run_commands("eagle", tmp_path, [1, 2], tmp_path, [1, 2, 3], 1, 1e-3)
    with pytest.raises(ValueError, match="unknown head"):
        run_commands("hydra", tmp_path, [1], tmp_path, 1, 1, 1e-3)


def test_tokens_seen_counts_each_row_of_the_same_features_once():
    corpus = {"self_distilled": "a.jsonl", "train_sequences": 100}
    run = lambda rows, n: {"features": corpus, "rows": rows, "training_tokens": n * 255}
    runs = [run("0:40", 40), run("40:100", 60), run(None, 100), run("20:60", 40)]
    assert [tokens_seen(runs[:i]) for i in range(1, 5)] == [40 * 255, 100 * 255, 100 * 255, 100 * 255]
    other = {"features": {**corpus, "self_distilled": "b.jsonl"}, "rows": "0:10", "training_tokens": 2550}
    assert tokens_seen(runs + [other]) == 110 * 255                                   # other features: new tokens
    assert tokens_seen([{"training_tokens": 7}, {"training_tokens": 7}]) == 14        # no row record: counted whole


def test_the_curve_reads_every_run_and_the_trend_says_how_much_data_a_target_needs(tmp_path):
    runs = [{"training_tokens": n, "seconds": 1.0, "replay": {"stdlib": {"tokens_per_forward": tau,
                                                                         "step_acceptance": [0.5]}}}
            for n, tau in [(1000, 1.2), (1000, 1.4), (2000, 1.6)]]                     # 1k, 2k, 4k tokens seen
    (tmp_path / "config.json").write_text(json.dumps({"runs": runs}))
    rows = read_curve(tmp_path)
    assert [r["tokens_seen"] for r in rows] == [1000, 2000, 4000] and rows[-1]["stdlib"] == 1.6
    a, b = fit_log([r["tokens_seen"] for r in rows], [r["stdlib"] for r in rows])
    assert b == pytest.approx(0.2 / math.log10(2)) and a + b * 3 == pytest.approx(1.2)
    assert tokens_for(2.0, a, b) == pytest.approx(16000) and tokens_for(2.0, 1.0, -0.1) == math.inf
    data, md = report({"eagle3-ttt": rows}, ["stdlib"], (2.0,), {"machine": "m", "features": "f"})
    assert data["fits"]["eagle3-ttt"]["stdlib"]["tokens_for"]["2.0"] == pytest.approx(16000)
    assert "| EAGLE-3 + training-time test | 4,000 | 1.600 |" in md and "1.6e+04" in md
    fig = plot({"eagle3-ttt": rows}, ["stdlib"], goal=2.0)
    (points, fit), = [ax.get_lines()[:2] for ax in fig.axes]
    assert list(points.get_ydata()) == [1.2, 1.4, 1.6] and fit.get_ydata()[-1] == pytest.approx(1.6 + 3 * 0.2)


def test_an_update_replaces_the_re_run_heads_and_keeps_the_others_in_their_order():
    from labkit.training.data_curve import updated
    earlier = {"eagle3-ttt": [{"tokens_seen": 1}], "eagle": [{"tokens_seen": 2}], "medusa": [{"tokens_seen": 3}]}
    got = updated(earlier, {"eagle": [{"tokens_seen": 20}], "eagle3": [{"tokens_seen": 4}]})
    assert list(got) == ["eagle3-ttt", "eagle", "medusa", "eagle3"]
    assert got["eagle"] == [{"tokens_seen": 20}] and got["medusa"] == earlier["medusa"]
