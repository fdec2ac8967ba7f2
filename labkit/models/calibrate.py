"""Choosing the forward path on this machine: read the CPU, time each path, remember the answer.

Which kernels make a k-token verify cost about what a one-token step costs depends on the CPU
(AVX2 only, AVX-512, AVX512_BF16, AMX) and on torch's build, so labkit measures instead of
guessing. For a model's shape and precision it builds a few random-weight layers of that shape
(more weight bytes than the CPU's caches hold, so they stream from memory as the real model's
do), times 1-, 8- and 32-token forwards on every candidate path (the paths take turns), and picks
(`pick`), among the paths no other path beats at every size, the fastest one-token path of those
whose 8-token forward costs at most FLAT one-token forwards (the fastest 8-token path when none is
that flat); among paths within TIE of that one-token time, the one with the fastest 32-token
forward (a token tree's verify) wins.

Timing on a shared machine can mislead, so the other processes' CPU use is read while the paths
are timed (`OthersCPU`). Where they kept more than BUSY cores busy, the paths are timed again, up to
ROUNDS times, each path keeping its fastest run; a choice still made on a busy machine serves this
process only and is not cached (one note line says so). A quiet choice is cached per CPU, torch
version, kernel build, thread count and shape; a cache entry from anything else, or one the rule
would not pick from its own times, is ignored and measured again. `python -m labkit models
--calibration` shows the cache, `--recalibrate` measures its entries again.

    from labkit.models.calibrate import choose_path, machine
    choice = choose_path(model.args, "bf16")     # choice.path, choice.times, choice.source
"""
from __future__ import annotations

import copy
import json
import os
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

import torch
from tqdm import tqdm

from .backends import PATHS, QUANTIZED, apply_path, check_path
from .transformer import ModelArgs, Transformer

FLAT = 1.5                   # a path is flat when t(8) <= FLAT * t(1)
TIE = 1.10                   # one-token times within 10% are a tie, decided by t(32)
BUSY = 0.25                  # cores other processes kept busy above which a timing is not cached
ROUNDS = 3                   # timings of the paths at most, while the machine stays busy
CALIBRATION_TOKENS = (1, 8, 32)
CACHE_VERSION = 3


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo; the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """What a timing depends on: the CPU, its vector ISA and matrix units, torch, the threads."""
    from ..kernels import cpu
    flags = cpu.cpu_flags()
    units = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
             if f in flags]
    return {"cpu": cpu_name(), "isa": cpu.isa(flags), "units": units, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "machine": platform.machine()}


def isa_label(m: dict | None = None) -> str:
    """'AVX-512 + AVX512_BF16', 'AVX2', ... for tables and notebook headers."""
    m = m or machine()
    parts = {"avx512_bf16": "AVX-512 + AVX512_BF16", "avx512": "AVX-512", "avx2": "AVX2", "none": "no AVX2"}[m["isa"]]
    return parts + (" + AMX" if "amx_bf16" in m["units"] else "")


def cpu_slug(name: str) -> str:
    """'AMD EPYC 9B45' -> 'amd-epyc-9b45' (for file names)."""
    return re.sub(r"[^a-z0-9]+", "-", re.sub(r"\((r|tm)\)|cpu|processor|@.*", "", name.lower())).strip("-")


def machine_slug(m: dict) -> str:
    """'intel-xeon_avx512-bf16-amx': the CPU's name and its ISA (one name can cover CPUs of several generations)."""
    isa = m["isa"].replace("_", "-") + ("-amx" if "amx_bf16" in m.get("units", []) else "")
    return f"{cpu_slug(m['cpu'])}_{isa}"


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _busy_ticks() -> tuple[int, int]:
    """(every CPU's busy clock ticks, this process's), from /proc."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return user + nice + system + irq + softirq + steal, int(own[11]) + int(own[12])   # utime + stime


class OthersCPU:
    """Cores other processes kept busy, on average, while a block ran (None where /proc is missing).

        with OthersCPU() as others:
            ...                                  # the timed runs
        others.cores                             # e.g. 0.02: quiet; 1.5: the runs shared the CPU

    The load average cannot say this in a notebook: it trails by a minute and counts this process's
    own work, such as loading the models just before.
    """
    cores: float | None = None

    def __enter__(self) -> "OthersCPU":
        try:
            self._start = (_busy_ticks(), time.perf_counter())
        except (OSError, ValueError, IndexError):
            self._start = None
        return self

    def __exit__(self, *exc) -> None:
        if self._start is None:
            return
        try:
            (busy0, own0), t0 = self._start
            busy1, own1 = _busy_ticks()
        except (OSError, ValueError, IndexError):
            return
        seconds = max(1e-9, time.perf_counter() - t0)
        self.cores = max(0.0, ((busy1 - busy0) - (own1 - own0)) / os.sysconf("SC_CLK_TCK") / seconds)


def others_cpu(seconds: float = 1.0) -> float | None:
    """Cores kept busy by other processes over the next `seconds` (None where /proc is missing)."""
    with OthersCPU() as others:
        time.sleep(seconds)
    return others.cores


@dataclass
class PathChoice:
    """The path chosen for one shape and precision, with the timings it was chosen from."""
    path: str
    precision: str
    times: dict[str, dict[str, float]]   # path -> {"1": seconds, "8": ..., "32": ...}
    machine: dict
    source: str                          # "measured", "cache", or "busy" (measured under load: this process only)
    measured_at: str = ""
    others_cpu: float | None = None      # cores other processes kept busy during the last timing round
    rounds: int = 1                      # timing rounds it took (more while the machine was busy)
    shape: dict | None = None            # the ModelArgs timed, to measure the entry again (--recalibrate)

    def ratio(self, path: str | None = None) -> float:
        """t(8) / t(1) of `path` (the chosen one by default)."""
        t = self.times[path or self.path]
        return t["8"] / t["1"]


def candidates(precision: str) -> list[str]:
    """The paths worth timing for `precision` on this machine (the reference always; the rest if they run)."""
    out = []
    for path in PATHS:
        try:
            check_path(path, precision)
        except ValueError as e:
            if path == "packed":                    # labkit's own kernels: say once why they are not used
                _note_once(f"note: {e}")
            continue
        if precision in QUANTIZED and path == "onednn":      # the same int8/int4 kernels as the reference path
            continue
        out.append(path)
    return out


@lru_cache(maxsize=None)
def _note_once(message: str) -> None:
    print(message, file=sys.stderr)


def cache_file() -> Path:
    from .hub import cache_dir
    return cache_dir() / "calibration.json"


def _key(args: ModelArgs, precision: str, m: dict) -> str:
    from ..kernels import cpu
    try:
        build = cpu._build_tag()
    except OSError:
        build = "none"
    shape = f"d{args.dim}-h{args.hidden_dim}-q{args.n_heads}x{args.head_dim}-kv{args.n_kv_heads}-v{args.vocab_size}"
    return f"{m['cpu']}|{m['isa']}|torch {m['torch']}|kernels {build}|{m['threads']} threads|{shape}|{precision}"


def _read_cache() -> dict:
    """The cached entries, or {} for a missing, unreadable or other-version file (never trusted blindly)."""
    try:
        data = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


def _write_cache(entries: dict) -> None:
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass                         # a read-only cache only costs a re-measurement next time


def _from_cache(entry: object, m: dict, precision: str) -> PathChoice | None:
    """A cached choice if it is well formed and was measured on this machine, torch and shape."""
    try:
        choice = PathChoice(**entry)
        ok = (choice.machine == m and choice.precision == precision and choice.path in choice.times
              and all(set(t) == {str(T) for T in CALIBRATION_TOKENS} for t in choice.times.values())
              and choice.path == pick(choice.times))      # a choice the rule would not make from its times: redo
    except (TypeError, KeyError, ValueError, AttributeError):
        return None
    return replace(choice, source="cache") if ok else None


def calibration_model(args: ModelArgs, precision: str, min_bytes: float = 4e8) -> Transformer:
    """Random-weight layers of `args`'s shape, enough of them that their weights stream from memory."""
    dense = torch.bfloat16 if precision in QUANTIZED or precision == "bf16" else torch.float32
    per_layer = (args.dim * (args.n_heads + 2 * args.n_kv_heads) * args.head_dim + args.n_heads * args.head_dim
                 * args.dim + 3 * args.dim * args.hidden_dim) * torch.finfo(dense).bits / 8
    layers = max(1, min(args.n_layers, int(min_bytes // per_layer) + 1))
    small = replace(args, n_layers=layers, vocab_size=min(args.vocab_size, 4096), tie_embeddings=False,
                    max_seq_len=256)
    return Transformer(small).init_random(seed=0).to(dense).eval().requires_grad_(False)


@torch.no_grad()
def measure(args: ModelArgs, precision: str, paths: list[str], context: int = 64, repeats: int = 4,
            built: dict | None = None) -> dict:
    """Seconds of a 1-, 8- and 32-token forward on each path, for `args`'s shape (best of `repeats`).

    The paths take turns (`time_forward_rounds`), so load from another process slows every path alike
    instead of the one being timed. `built`: a dict that keeps the paths' layers from one call to the next."""
    models = {} if built is None else built
    if set(models) != set(paths):
        layers = calibration_model(args, precision)
        models.clear()
        models.update({path: apply_path(copy.deepcopy(layers), path, precision) for path in paths})
    runs = time_forward_rounds(models, context, CALIBRATION_TOKENS, repeats, progress=False)
    return {path: {str(T): min(r) for T, r in by_T.items()} for path, by_T in runs.items()}


def dominated(times: dict[str, dict[str, float]]) -> set[str]:
    """The paths another path beats at every measured size: never the right choice, however flat they look."""
    return {p for p, t in times.items()
            if any(all(other[T] < t[T] for T in t) for q, other in times.items() if q != p)}


def pick(times: dict[str, dict[str, float]]) -> str:
    """Among the paths no other beats at every size: the fastest one-token path among the flat ones (ties by
    t(32)); the fastest 8-token path when none is flat."""
    times = {p: t for p, t in times.items() if p not in dominated(times)}
    flat = [p for p, t in times.items() if t["8"] <= FLAT * t["1"]]
    if not flat:
        return min(times, key=lambda p: times[p]["8"])
    fastest = min(times[p]["1"] for p in flat)
    best = min((p for p in flat if times[p]["1"] <= TIE * fastest), key=lambda p: times[p]["32"])
    # packed-amx runs the packed kernels below WIDE_ROWS tokens: its 1- and 8-token times are packed's up to noise
    if best == "packed" and "packed-amx" in times and times["packed-amx"]["32"] < times["packed"]["32"]:
        best = "packed-amx"
    return best


@dataclass(frozen=True)
class Timing:
    """The paths' times over one or more rounds (each path's fastest), and the load during the last round."""
    times: dict[str, dict[str, float]]
    others_cpu: float | None             # None where /proc cannot tell
    rounds: int

    @property
    def busy(self) -> bool:
        return self.others_cpu is not None and self.others_cpu > BUSY


def timed(args: ModelArgs, precision: str, paths: list[str]) -> Timing:
    """`measure`, again while other processes keep the machine busy (at most ROUNDS times), each path's fastest
    run kept: a round that ran quiet is as good as a quiet machine's."""
    times: dict[str, dict[str, float]] = {}
    built: dict = {}                               # the layers, built once for every round
    for rounds in range(1, ROUNDS + 1):
        with OthersCPU() as others:
            now = measure(args, precision, paths, built=built)
        times = {p: {T: min(s, times.get(p, {}).get(T, s)) for T, s in t.items()} for p, t in now.items()}
        timing = Timing(times, others.cores, rounds)
        if not timing.busy:
            break
    return timing


_THIS_PROCESS: dict[str, PathChoice] = {}      # choices made on a busy machine: used here, never cached


def choose_path(args: ModelArgs, precision: str, use_cache: bool = True) -> PathChoice:
    """The forward path for a model of `args`'s shape in `precision` on this machine (cached when timed quiet)."""
    check_path("reference", precision)           # an unknown precision: a clear error before any timing
    m = machine()
    key = _key(args, precision, m)
    if use_cache:
        if key in _THIS_PROCESS:
            return _THIS_PROCESS[key]
        if (cached := _from_cache(_read_cache().get(key), m, precision)) is not None:
            return cached
    timing = timed(args, precision, candidates(precision))
    choice = PathChoice(pick(timing.times), precision, timing.times, m, "busy" if timing.busy else "measured",
                        datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        None if timing.others_cpu is None else round(timing.others_cpu, 2), timing.rounds,
                        asdict(args))
    if timing.busy:
        _THIS_PROCESS[key] = choice
        print(f"note: other processes kept {timing.others_cpu:.1f} cores busy while the forward paths were timed "
              f"({timing.rounds} rounds): the {choice.path} path serves this process only and is not cached; "
              "`python -m labkit models --recalibrate` on a quiet machine measures it for good", file=sys.stderr)
        return choice
    entries = _read_cache()
    entries[key] = asdict(choice)
    _write_cache(entries)
    return choice


def cached_choices() -> dict[str, PathChoice]:
    """Every well-formed entry of the calibration cache, by key (this machine's or not)."""
    out = {}
    for key, entry in _read_cache().items():
        try:
            out[key] = replace(PathChoice(**entry), source="cache")
        except TypeError:
            continue
    return out


def recalibrate() -> list[PathChoice]:
    """Measure again every cached entry of this machine (a cache made under load or by an older labkit is
    replaced); entries of other machines are kept as they are."""
    m, out = machine(), []
    for key, choice in cached_choices().items():
        if choice.machine != m or not choice.shape:
            continue
        args = ModelArgs(**choice.shape)
        _THIS_PROCESS.pop(key, None)
        out.append(choose_path(args, choice.precision, use_cache=False))
    return out


def choose_precision(args: ModelArgs, options: tuple[str, ...] = ("bf16", "int8", "int4")) -> PathChoice:
    """For a draft model: the precision (and its path) whose one-token forward is fastest here."""
    best = None
    for precision in options:
        try:
            choice = choose_path(args, precision)
        except ValueError:
            continue
        if best is None or choice.times[choice.path]["1"] < best.times[best.path]["1"]:
            best = choice
    if best is None:
        raise ValueError(f"none of the precisions {options} can run here")
    return best


def describe(choice: PathChoice) -> str:
    """One line for logs and notebook headers."""
    t = choice.times[choice.path]
    return (f"{choice.path} path ({choice.precision}) on {choice.machine['cpu']} [{isa_label(choice.machine)}], "
            f"{choice.machine['threads']} threads: t(1) {t['1'] * 1e3:.1f} ms, t(8)/t(1) {choice.ratio():.2f} "
            f"on the calibration layers ({choice.source})")


def run_facts(target, draft=None) -> dict:
    """Where a run ran: CPU, ISA, threads, and each model's forward path and precision."""
    m = machine()
    facts = {"cpu": m["cpu"], "isa": isa_label(m), "threads": m["threads"], "torch": m["torch"],
             "target": str(target.path), "target_path": target.path.to_dict()}
    if draft is not None:
        facts.update(draft=str(draft.path), draft_path=draft.path.to_dict())
    return facts


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on a CPU), so a clock reads finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def time_forwards(model, context: int, tokens: tuple[int, ...], repeats: int,
                  clock=time.perf_counter, progress: bool = True) -> dict[int, float]:
    """Best-of-`repeats` seconds of one forward of T tokens after `context` cached ones (rolled back each time).

    The verify-cost curve: all T logits computed, as a verify pass does. The token counts take turns
    (round robin), so a burst of load from another process on a shared machine slows one round of
    every T rather than all runs of one T. Each timed forward follows an untimed one of the same
    width, as a decoding loop's forwards follow each other: a one-token forward timed right after a
    wide one can read slow (the wide one's caches and clocks linger), which would make every verify look
    cheaper against it than the loop then finds it.
    """
    runs = time_forward_runs(model, context, tokens, repeats, clock, progress)
    return {T: min(r) for T, r in runs.items()}     # the least disturbed run: the machine may be shared


def time_forward_runs(model, context: int, tokens: tuple[int, ...], repeats: int,
                      clock=time.perf_counter, progress: bool = True) -> dict[int, list[float]]:
    """Every timed run of `time_forwards` ({T: `repeats` seconds}): their spread is the noise."""
    return time_forward_rounds({None: model}, context, tokens, repeats, clock, progress)[None]


@torch.no_grad()
def time_forward_rounds(models: dict, context: int, tokens: tuple[int, ...], repeats: int,
                        clock=time.perf_counter, progress: bool = True) -> dict:
    """{name: {T: `repeats` seconds}}: each model's forward of T tokens after `context` cached ones, timed in
    rounds of every model and T (round robin), so a burst of load from another process slows one round of
    each rather than every run of one. Each timed forward follows an untimed one of the same model and T,
    which warms it up and leaves the kernels' state and caches as a loop of such forwards does."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats (timed runs per width) must be an integer >= 1, got {repeats!r}")
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, model in models.items():
        device = model.device
        cache = model.new_cache(max_len=context + max(tokens))
        model(torch.randint(0, model.vocab_size, (1, context), generator=g).to(device), cache, num_logits=1)
        feeds = {T: torch.randint(0, model.vocab_size, (1, T), generator=g).to(device) for T in tokens}
        state[name] = (cache, feeds)
    runs = {name: {T: [] for T in tokens} for name in models}
    with tqdm(total=repeats * len(tokens) * len(models), desc="forwards", disable=not progress) as bar:
        for _ in range(repeats):
            for name, model in models.items():
                cache, feeds = state[name]
                for T in tokens:
                    model(feeds[T], cache)                  # untimed: the same width just ran, as in a loop
                    cache.truncate(context)
                    sync(model.device)
                    t0 = clock()
                    model(feeds[T], cache)
                    sync(model.device)
                    runs[name][T].append(clock() - t0)
                    cache.truncate(context)
                    bar.update()
    return runs
