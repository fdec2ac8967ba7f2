"""Choosing the forward path on this machine: the rule, the cache, and a cache that is never trusted blindly."""
from __future__ import annotations

import json
import multiprocessing
import time

import pytest
import torch

from labkit.models import calibrate
from labkit.models.calibrate import choose_path, pick
from labkit.models.transformer import ModelArgs

pytestmark = pytest.mark.serial          # reads the machine's load and times forward paths: alone, never beside a worker
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


def test_pick_never_takes_a_path_another_beats_at_every_size():
    """Timed under load (1.5B target, bf16): the packed path's 8-token forward was inflated to 1.81 one-token
    forwards, so only the reference path looked flat, though it lost at 1, 8 and 32 tokens alike."""
    loaded = {"packed": {"1": 25.7, "8": 46.6, "32": 106.7}, "reference": {"1": 61.4, "8": 66.9, "32": 424.2}}
    assert calibrate.dominated(loaded) == {"reference"}
    assert pick(loaded) == "packed"
    loaded["onednn"] = {"1": 30.0, "8": 36.0, "32": 90.0}        # flat and beaten nowhere at all sizes: it wins
    assert calibrate.dominated(loaded) == {"reference"} and pick(loaded) == "onednn"
    assert calibrate.dominated({"a": {"1": 1.0, "8": 2.0}, "b": {"1": 1.0, "8": 3.0}}) == set()   # a tie is no beat


class Others:
    """OthersCPU with a fixed reading: the cores other processes kept busy, as a shared machine would show."""
    cores = 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(calibrate, "OthersCPU", Others)          # quiet, whatever else runs on this machine
    monkeypatch.setattr(calibrate, "_THIS_PROCESS", {})
    return tmp_path


LOADED = {"packed": {"1": 0.0257, "8": 0.0466, "32": 0.1067}, "reference": {"1": 0.0614, "8": 0.0669, "32": 0.4242}}


def test_a_busy_machine_re_measures_and_never_caches(cache_dir, monkeypatch, capsys):
    """Other processes busy through every round: the choice (still the undominated path) serves this process only,
    with one note line, and nothing is written to the cache; a later quiet process measures and caches."""
    calls = []

    def measure(args, precision, paths, **kw):
        calls.append(precision)
        return {p: dict(LOADED[p]) for p in paths}
    monkeypatch.setattr(calibrate, "measure", measure)
    monkeypatch.setattr(calibrate, "candidates", lambda precision: ["reference", "packed"])
    monkeypatch.setattr(Others, "cores", 1.4)
    choice = choose_path(SMALL, "bf16")
    assert choice.path == "packed" and choice.source == "busy" and choice.rounds == calibrate.ROUNDS
    assert choice.others_cpu == 1.4 and len(calls) == calibrate.ROUNDS
    note = capsys.readouterr().err.strip().splitlines()
    assert len(note) == 1 and "1.4 cores busy" in note[0] and "--recalibrate" in note[0]
    assert not (cache_dir / "calibration.json").exists()
    assert choose_path(SMALL, "bf16") is choice and len(calls) == calibrate.ROUNDS     # this process: not again
    monkeypatch.setattr(calibrate, "_THIS_PROCESS", {})                                   # a new process, quiet
    monkeypatch.setattr(Others, "cores", 0.05)
    quiet = choose_path(SMALL, "bf16")
    assert quiet.source == "measured" and quiet.rounds == 1 and len(calls) == calibrate.ROUNDS + 1
    assert choose_path(SMALL, "bf16").source == "cache"


def test_a_round_that_ran_quiet_ends_the_measuring(cache_dir, monkeypatch):
    """Busy in the first round, quiet in the second: each path keeps its fastest run, and the choice is cached."""
    readings, rounds = iter([1.2, 0.0]), []

    class Varying(Others):
        def __exit__(self, *exc):
            self.cores = next(readings)

    def measure(args, precision, paths, **kw):
        rounds.append(1)
        slow = 3.0 if len(rounds) == 1 else 1.0                   # the busy round ran 3x slower
        return {"packed": {T: s * slow for T, s in LOADED["packed"].items()}, "reference": dict(LOADED["reference"])}
    monkeypatch.setattr(calibrate, "OthersCPU", Varying)
    monkeypatch.setattr(calibrate, "measure", measure)
    choice = choose_path(SMALL, "bf16")
    assert choice.source == "measured" and choice.rounds == 2 and choice.times["packed"] == LOADED["packed"]
    assert json.loads((cache_dir / "calibration.json").read_text())["entries"]


def test_a_cached_choice_the_rule_would_not_make_is_measured_again(cache_dir, monkeypatch):
    """A cache written by an older rule (a dominated path chosen, say) is not read: measured again."""
    calls = []
    monkeypatch.setattr(calibrate, "measure", fake_measure(calls))
    choose_path(SMALL, "bf16")
    path = cache_dir / "calibration.json"
    data = json.loads(path.read_text())
    (key, entry), = data["entries"].items()
    entry["times"] = {p: dict(t) for p, t in LOADED.items()}
    entry["path"] = "reference"
    path.write_text(json.dumps(data))
    assert choose_path(SMALL, "bf16").source == "measured" and len(calls) == 2


def test_models_calibration_shows_and_recalibrate_redoes_the_cache(cache_dir, monkeypatch, capsys):
    from labkit.cli import main
    calls = []
    monkeypatch.setattr(calibrate, "measure", fake_measure(calls))
    choose_path(SMALL, "bf16")
    choose_path(SMALL, "fp32")
    assert main(["models", "--calibration"]) == 0
    shown = capsys.readouterr().out
    assert "2 entries, 2 of this machine" in shown and shown.count("<- chosen") == 2 and "t(8)/t(1)" in shown
    assert main(["models", "--recalibrate"]) == 0
    again = capsys.readouterr().out
    assert again.count("measured again:") == 2 and len(calls) == 4


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_others_cpu_reads_a_real_load():
    """The reader the choice trusts: two spinning processes show as busy cores, well above BUSY."""
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_spin, args=(3.0,)) for _ in range(2)]
    for w in workers:
        w.start()
    time.sleep(1.0)                       # past their start-up
    with calibrate.OthersCPU() as others:
        time.sleep(1.0)
    for w in workers:
        w.join()
    assert others.cores is not None and others.cores > calibrate.BUSY


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
