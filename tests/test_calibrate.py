"""Choosing the forward path on this machine: the rule, the cache, and a cache that is never trusted blindly."""
from __future__ import annotations

import json

import pytest
import torch

from labkit.models import calibrate
from labkit.models.calibrate import choose_path, pick
from labkit.models.transformer import ModelArgs

SMALL = ModelArgs(vocab_size=512, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=512, max_seq_len=512)


def test_pick_prefers_the_fastest_flat_path():
    times = {"reference": {"1": 10.0, "8": 30.0, "32": 60.0},      # fast at 1 token, 3x at 8: not flat
             "onednn": {"1": 12.5, "8": 16.0, "32": 18.0},
             "packed": {"1": 11.0, "8": 13.0, "32": 30.0}}
    assert pick(times) == "packed"
    times["packed-amx"] = {"1": 11.2, "8": 13.1, "32": 17.0}     # a tie at 1 token: the wider verify decides
    assert pick(times) == "packed-amx"
    times["packed-amx"]["1"] = 12.5        # 14% slower at one token, but the same kernels there: noise
    assert pick(times) == "packed-amx"
    times["packed-amx"]["32"] = 31.0
    assert pick(times) == "packed"
    times["packed"]["8"] = 40.0
    del times["packed-amx"]
    assert pick(times) == "onednn"
    # none flat: the fastest 8-token forward (a verify is what speculation runs most)
    assert pick({"reference": {"1": 10.0, "8": 30.0, "32": 60.0}, "onednn": {"1": 12.0, "8": 20.0, "32": 50.0}}) == "onednn"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path))
    return tmp_path


def fake_measure(calls):
    def measure(args, precision, paths, **kw):
        calls.append((precision, tuple(paths)))
        return {p: {"1": 0.01 * (i + 1), "8": 0.012 * (i + 1), "32": 0.02 * (i + 1)} for i, p in enumerate(paths)}
    return measure


def test_choice_is_measured_once_then_read_from_the_cache(cache_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(calibrate, "measure", fake_measure(calls))
    first = choose_path(SMALL, "fp32")
    assert first.source == "measured" and first.path == "reference" and len(calls) == 1
    second = choose_path(SMALL, "fp32")
    assert second.source == "cache" and second.path == first.path and len(calls) == 1
    choose_path(SMALL, "bf16")                                   # another precision is another entry
    choose_path(ModelArgs(**{**SMALL.__dict__, "dim": 512}), "fp32")   # and another shape
    assert len(calls) == 3
    assert len(json.loads((cache_dir / "calibration.json").read_text())["entries"]) == 3


@pytest.mark.parametrize("spoil", ["other torch", "other cpu", "garbage", "wrong version", "half an entry"])
def test_a_cache_from_elsewhere_or_damaged_is_measured_again(cache_dir, monkeypatch, spoil):
    calls = []
    monkeypatch.setattr(calibrate, "measure", fake_measure(calls))
    choose_path(SMALL, "fp32")
    path = cache_dir / "calibration.json"
    data = json.loads(path.read_text())
    (key, entry), = data["entries"].items()
    if spoil == "other torch":      # the same key but an entry recorded under another torch: not trusted
        entry["machine"]["torch"] = "1.13.0"
    elif spoil == "other cpu":
        entry["machine"]["cpu"] = "Some Other CPU"
    elif spoil == "half an entry":
        del entry["times"]
    elif spoil == "wrong version":
        data["version"] = 0
    if spoil == "garbage":
        path.write_text("{ not json")
    else:
        path.write_text(json.dumps(data))
    again = choose_path(SMALL, "fp32")
    assert again.source == "measured" and len(calls) == 2


def test_key_names_torch_and_the_cpu():
    m = calibrate.machine()
    key = calibrate._key(SMALL, "bf16", m)
    assert torch.__version__ in key and m["cpu"] in key and "bf16" in key


def test_real_measurement_on_random_layers(cache_dir):
    """The real timing code: every candidate path timed at 1 and 8 tokens, the choice among them."""
    choice = choose_path(SMALL, "fp32", use_cache=False)
    assert set(choice.times) == set(calibrate.candidates("fp32")) and "reference" in choice.times
    assert all(t["1"] > 0 and t["8"] > 0 and t["32"] > 0 for t in choice.times.values())
    assert choice.path == pick(choice.times)
    assert "t(8)/t(1)" in calibrate.describe(choice) and choice.machine["cpu"] in calibrate.describe(choice)


def test_draft_precision_is_the_fastest_one_token_forward(cache_dir, monkeypatch):
    def measure(args, precision, paths, **kw):
        return {p: {"1": {"bf16": 3.0, "int8": 2.0, "int4": 1.0}[precision], "8": 4.0, "32": 5.0} for p in paths}
    monkeypatch.setattr(calibrate, "measure", measure)
    assert calibrate.choose_precision(SMALL).precision == "int4"
    assert calibrate.choose_precision(SMALL, ("bf16",)).precision == "bf16"
    with pytest.raises(ValueError, match="none of the precisions"):
        calibrate.choose_precision(SMALL, ("int3",))
