"""scripts/gpu_check.py's code path on a CPU (--smoke: tiny shapes, steps traced a block at a time, chain and tree
replays, no graphs, no tests), so the script a GPU machine runs once, offline, has run before it gets there."""
import importlib.util
import json
from pathlib import Path

import pytest

from labkit.kernels import HAVE_TRITON

ROOT = Path(__file__).resolve().parents[1]


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check


def test_smoke_run_writes_every_output_and_replays_the_recorded_acceptance(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "device_out"))
    (tmp_path / "device_out").mkdir()
    gpu_check = load_gpu_check()
    result = gpu_check.main(["--smoke", "--chat", "--out", str(tmp_path), "--prompt-len", "12", "--new-tokens", "32"])
    assert [run["mode"] for run in result["runs"]] == ["static, traced a block at a time (smoke)", "eager loop"]
    rows = result["runs"][0]["rows"] + result["runs"][1]["rows"]
    assert [r["method"].split(" (")[0] for r in rows] == ["compiled AR"] + ["compiled speculation"] * 5 \
        + ["compiled tree speculation"] * 5 + ["eager loop"] * 2
    assert [r.get("replay") for r in rows] == [None, "lookup", "suffix", "draft", "lookup-chat", "draft-chat", "medusa",
                                               "eagle3", "suffix-chat", "medusa-chat", "eagle3-chat", "lookup", "draft"]
    chat = result["recorded"]["eagle3-chat"]          # the cost-aware trees' choices on chat: mostly plain steps
    assert chat["method"] == "eagle3-cost-aware" and sum(g == 0 for g, _ in chat["steps"]) > len(chat["steps"]) / 2
    assert "chat acceptance (writing, qa, translation" in rows[-3]["method"]
    suffix = result["recorded"]["suffix"]                    # suffix decoding's long drafts: up to 16 tokens
    assert suffix["longest"] == 16 and max(g for g, _ in suffix["steps"]) > 8 and suffix["tokens_per_step"] > 2.3
    assert all(r["replay_equals_recorded"] and r["tokens_equal_continuation"] for r in rows[1:])
    drafting = [r for r in rows[1:] if r["draft_ms_per_token"] > 0]         # (a chat replay's first steps: all plain)
    assert len(drafting) >= 10 and all(r["predicted_speedup"] and r["measured_over_predicted"] for r in drafting)
    for name in ("gpu_spec.json", "gpu_spec.md", "gpu_spec.png"):
        assert (tmp_path / name).is_file() and (tmp_path / "device_out" / name).is_file()
    assert json.loads((tmp_path / "gpu_spec.json").read_text())["label"] == "replayed acceptance"
    assert "Replayed acceptance" in (tmp_path / "gpu_spec.md").read_text()


def test_tree_step_profile_accounts_for_each_part_of_a_step(tmp_path, monkeypatch):
    """scripts/profile_tree_step.py --smoke: the host time of every part of the compiled tree step, and the profiler's
    view of them, for a replayed tree that reproduces the target's own tokens."""
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("profile_tree_step", ROOT / "scripts" / "profile_tree_step.py")
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    from labkit.decoding import compiled_tree
    from labkit.drafters.base import Proposal
    originals = (Proposal.limit, Proposal.as_tree, compiled_tree.greedy_tree_accept_on_device, compiled_tree.Step)
    result = profile.main(["--smoke", "--replays", "medusa-unpaced,medusa", "--prompt-len", "12", "--new-tokens", "32",
                           "--out", str(tmp_path)])
    assert (Proposal.limit, Proposal.as_tree, compiled_tree.greedy_tree_accept_on_device, compiled_tree.Step) \
        == originals                                                  # the timing wrappers are taken off again
    for key, row in result["replays"].items():
        assert not row["diverged"] and row["tokens_per_s"] > 0 and row["steps"] > 3, key
        host = row["host_ms_per_step"]
        assert {"verify (graph replay)", "accept on the device", "commit_path"} <= set(host)
        assert all(v > 0 for k, v in host.items() if not k.startswith("the rest")), host
        assert all(r["cpu_ms_per_step"] > 0 for r in row["profiler"]["ranges"].values())
        assert {"verify (graph replay)", "send the ids"} <= set(row["profiler"]["ranges"])
    assert result["replays"]["medusa"]["alone_ms"]["medusa4.propose"] > 0
    assert "## medusa replay" in (tmp_path / "tree_step_profile.md").read_text()


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton is not installed")
@pytest.mark.usefixtures("triton_interpreter")
def test_each_mode_runs_with_each_attention_and_the_triton_one_stays_exact(tmp_path, monkeypatch):
    """--attention sdpa,triton: every compiled mode twice, the second with labkit's Triton attention over the cache
    (interpreted here); every replay still equals its recording and every output compiled plain decoding's."""
    monkeypatch.delenv("OUT", raising=False)
    result = load_gpu_check().main(["--smoke", "--attention", "sdpa,triton", "--out", str(tmp_path), "--prompt-len",
                                    "12", "--new-tokens", "16", "--name", "both"])
    assert [run["mode"] for run in result["runs"]] == ["static, traced a block at a time (smoke)",
                                                       "static, traced a block at a time (smoke), Triton attention",
                                                       "eager loop"]
    sdpa, triton = result["runs"][0]["rows"], result["runs"][1]["rows"]
    assert [r.get("replay") for r in triton] == [r.get("replay") for r in sdpa] and len(triton) == 6
    assert all(r["replay_equals_recorded"] and r["tokens_equal_continuation"] for r in triton[1:])
    with pytest.raises(SystemExit, match="--attention 'flash': choose from sdpa, triton"):
        load_gpu_check().main(["--smoke", "--attention", "flash", "--out", str(tmp_path)])
