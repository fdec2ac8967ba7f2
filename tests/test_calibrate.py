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


class _WidthModel:
    """A stand-in for a model on a virtual clock: a forward of T tokens costs T units, plus 10 more when the
    forward before it had another width (a one-token forward after a 64-token one, as measured on a CPU)."""

    device, vocab_size = torch.device("cpu"), 32

    def __init__(self):
        self.now, self.last = 0.0, None

    def new_cache(self, max_len):
        return type("Cache", (), {"truncate": lambda self, n: None})()

    def __call__(self, ids, cache, num_logits=None):
        T = ids.shape[1]
        self.now += T + (10 if self.last not in (None, T) else 0)
        self.last = T


def test_each_width_is_timed_after_a_forward_of_its_own_width():
    """The curve the loop pays: a width-switching penalty never reaches the timed forwards."""
    model = _WidthModel()
    runs = calibrate.time_forward_runs(model, 16, (1, 8, 64), repeats=3, clock=lambda: model.now, progress=False)
    assert runs == {1: [1.0] * 3, 8: [8.0] * 3, 64: [64.0] * 3}
    assert calibrate.time_forwards(model, 16, (1, 8), repeats=2, clock=lambda: model.now, progress=False) == \
        {1: 1.0, 8: 8.0}
    with pytest.raises(ValueError, match="repeats"):
        calibrate.time_forwards(model, 16, (1, 8), repeats=0, progress=False)
