"""`python -m labkit bench` on a real pretrained model, from a fresh process, as a user would run it.

SmolLM2-135M (the fallback preset) in fp32, as both target and draft: every method, labkit's
and transformers', on one real question in a few minutes, and fp32 makes token-for-token
equality with the baseline a fair demand. (The embedded pair's full run is data/bench/labkit_bench/.)
"""
import json
import subprocess
import sys

import pytest

from labkit.bench import llama_cpp
from labkit.bench.methods import default_methods

pytestmark = pytest.mark.integration
MODEL = "smollm2-135m-instruct"


def test_bench_cli_on_a_real_model(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_LLAMA_CPP", str(tmp_path / "no-llama-cpp"))   # labkit's and transformers' only
    cmd = [sys.executable, "-m", "labkit", "bench", "--questions", "data/questions/labkit_bench.jsonl",
           "--categories", "rag", "--limit", "1", "--target", MODEL, "--draft", MODEL, "--dtype", "fp32",
           "--max-new-tokens", "24", "--draft-window", "all", "--threads", "2", "--layer-skip-tokens", "64",
           "--out", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)   # ~2 min on an idle 2-core CPU, most of it
    # the layer-skip search (every layer tried for each of 15 rounds, on 64 calibration tokens)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = {(r["category"], r["method"]): r for r in report["rows"]}
    assert {m for c, m in rows if c == "all"} == set(default_methods(MODEL)) | {"oracle"}
    labkit_speeds = [r["speedup"] for (c, m), r in rows.items() if c == "all" and not m.startswith("hf-")
                     and m != "oracle"]
    assert rows["all", "oracle"]["speedup"] == pytest.approx(max(labkit_speeds))   # one question: its fastest
    assert report["mismatches"] == [], report["mismatches"]       # fp32: every method equals its reference
    assert rows["all", "ar"]["tokens_per_forward"] == 1 and rows["all", "hf-generate"]["tokens_per_forward"] == 1
    assert rows["all", "draft"]["tokens_per_forward"] > 2          # the draft is the target itself, reading it all
    assert rows["all", "hf-assisted"]["tokens_per_forward"] > 2
    assert rows["all", "lookup"]["acceptance_rate"] is not None
    assert "| rag | labkit draft model, γ=4 | 1 |" in (tmp_path / "bench.md").read_text()


@pytest.mark.skipif(not llama_cpp.available(), reason="llama.cpp is not built (make llama-cpp)")
def test_llama_cpp_peer_runs_the_gguf(tmp_path):
    """llama.cpp's plain and speculative programs on the draft preset's GGUF (as its own draft), as the bench runs them."""
    from transformers import AutoTokenizer

    from labkit.models.hub import DEFAULT_DRAFT, resolve_model
    tok = AutoTokenizer.from_pretrained(resolve_model(DEFAULT_DRAFT))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Count from 1 to 20, comma-separated."}],
                                     add_generation_prompt=True, tokenize=False)
    gguf = llama_cpp.gguf_file(DEFAULT_DRAFT)
    plain = llama_cpp.completion(gguf, prompt, 24, 2)
    spec = llama_cpp.speculative(gguf, gguf, prompt, 24, 4, 2)
    assert plain.n_new == 24 and "1, 2, 3" in plain.text and plain.seconds > 0
    assert spec.text.startswith(plain.text[:10]) and spec.n_new >= 24
    assert 0 < spec.accepted <= spec.drafted and spec.target_forwards < spec.n_new, "the draft is the target: most accepted"


@pytest.mark.skipif(not llama_cpp.available(), reason="llama.cpp is not built (make llama-cpp)")
def test_llama_cpp_runs_the_exported_eagle3_head(tmp_path):
    """The shipped EAGLE-3 head, converted by llama.cpp's own convert_hf_to_gguf.py, holds labkit's tensors and
    drafts for llama.cpp's draft-eagle3 on the 4-bit target: its greedy text is llama.cpp's plain decoding's."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    from labkit.export.llama_cpp import export_llama_cpp
    from labkit.files.shipped import shipped
    from labkit.models.eagle_heads import read_eagle
    from labkit.models.hub import DEFAULT_TARGET, resolve_model
    head = shipped("heads", "eagle3-qwen2.5-coder-1.5b")
    target_dir = resolve_model(DEFAULT_TARGET)
    out = export_llama_cpp(head, target_dir, tmp_path)
    config, state = read_eagle(head)
    reader = GGUFReader(str(out))
    fields = {f.name: f for f in reader.fields.values()}
    layers = next(f for name, f in fields.items() if name.endswith("target_layers"))
    assert [int(layers.parts[i][0]) for i in layers.data] == [b + 1 for b in config["layers"]]   # inputs of layers
    tensors = {t.name: t for t in reader.tensors}
    d2t = tensors["d2t"].data.reshape(-1)
    assert d2t.tolist() == state["draft_vocab"].tolist(), "draft id i -> the target id labkit maps it to"
    fc = next(t for name, t in tensors.items() if name.startswith("fc"))
    assert tuple(reversed(fc.shape.tolist())) == tuple(state["fc.weight"].shape)

    tok = AutoTokenizer.from_pretrained(target_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that reverses a list."}],
                                     add_generation_prompt=True, tokenize=False)
    target = llama_cpp.gguf_file(DEFAULT_TARGET)
    plain = llama_cpp.completion(target, prompt, 48, 2)
    spec = llama_cpp.speculative(target, out, prompt, 48, 6, 2, "draft-eagle3")
    drafted, own = spec.text.rstrip(), plain.text.rstrip()   # the two programs print a last blank token differently
    assert drafted.startswith(own) or own.startswith(drafted), (plain.text, spec.text)
    assert 0 < spec.accepted <= spec.drafted and spec.target_forwards < spec.n_new, "the head's drafts are accepted"
