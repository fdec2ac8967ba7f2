"""A background sampler of memory telemetry, lined up with the decoder's steps.

With NVML: memory used, memory-controller utilisation (percent of time DRAM was read or
written) and, on Hopper or newer, DRAM bandwidth utilisation from the GPM metrics
(NVML_GPM_METRIC_DRAM_BW_UTIL between two GPM samples). Without NVML: a plain warning once,
then host memory from /proc/meminfo and the process's resident size; bandwidth utilisation is
left empty (None), never made up. Samples carry time.perf_counter() stamps, the clock the
decoder's trace uses, so `per_step` can average them over each step's window.
"""
from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .device import nvml_handle


@dataclass(frozen=True)
class Sample:
    t: float                          # time.perf_counter() seconds
    memory_used: float                # bytes: the GPU's (NVML) or the host's (/proc/meminfo)
    memory_util: float | None         # % of time device memory was busy (NVML), None on the host
    dram_bw_util: float | None        # % of peak DRAM bandwidth (NVML GPM, Hopper+), None elsewhere
    process_rss: float | None = None  # bytes resident for this process (host only)


class Sampler:
    """`with Sampler() as s: ...` records a Sample every `interval` seconds in a daemon thread."""

    def __init__(self, interval: float = 0.02, device_index: int = 0):
        if interval <= 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval}")
        self.interval, self.samples = interval, []
        self.handle = nvml_handle(device_index)
        self.source = "NVML" if self.handle is not None else "host (/proc/meminfo, no NVML)"
        self.gpm_error: str | None = None
        self._gpm_lock = threading.Lock()
        self._gpm_prev = self._gpm_sample() if self.handle is not None else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._gpm_prev is not None:
            import pynvml
            pynvml.nvmlGpmSampleFree(self._gpm_prev)
            self._gpm_prev = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.read())
            self._stop.wait(self.interval)

    def read(self) -> Sample:
        """One sample now."""
        t = time.perf_counter()
        if self.handle is None:
            return Sample(t, host_memory_used(), None, None, process_rss())
        import pynvml
        mem = pynvml.nvmlDeviceGetMemoryInfo(self.handle)
        util = pynvml.nvmlDeviceGetUtilizationRates(self.handle)
        return Sample(t, float(mem.used), float(util.memory), self._dram_bw_util())

    def _gpm_sample(self):
        import pynvml
        try:
            if not pynvml.nvmlGpmQueryDeviceSupport(self.handle).isSupportedDevice:
                self.gpm_error = "no GPM on this GPU (needs Hopper or newer)"
                return None
            return pynvml.nvmlGpmSampleGet(self.handle, pynvml.nvmlGpmSampleAlloc())
        except pynvml.NVMLError as e:
            self.gpm_error = f"NVML GPM unavailable: {e}"
            return None

    def _dram_bw_util(self) -> float | None:
        """DRAM bandwidth utilisation (%) since the previous GPM sample; None without GPM.

        If NVML refuses a GPM sample midway (e.g. "In use by another client": a monitoring agent
        holds the GPM counters), the sampler says why in `gpm_error`, stops asking, and goes on
        with the other fields: a telemetry gap, never a crash.
        """
        with self._gpm_lock:               # the sampler thread and a caller's read() may both ask
            if self._gpm_prev is None:
                return None
            import pynvml
            try:
                now = pynvml.nvmlGpmSampleGet(self.handle, pynvml.nvmlGpmSampleAlloc())
                query = pynvml.c_nvmlGpmMetricsGet_t()
                query.version, query.numMetrics = pynvml.NVML_GPM_METRICS_GET_VERSION, 1
                query.sample1, query.sample2 = self._gpm_prev, now
                query.metrics[0].metricId = pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL
                pynvml.nvmlGpmMetricsGet(query)
            except pynvml.NVMLError as e:
                self.gpm_error = f"NVML GPM stopped: {e}"
                pynvml.nvmlGpmSampleFree(self._gpm_prev)
                self._gpm_prev = None
                return None
            pynvml.nvmlGpmSampleFree(self._gpm_prev)
            self._gpm_prev = now
            value = float(query.metrics[0].value)
            return None if math.isnan(value) else value       # NaN: too short an interval to say


def host_memory_used() -> float:
    """Bytes in use on the host: MemTotal - MemAvailable."""
    info = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()}
    return float(info["MemTotal"] - info["MemAvailable"])


def process_rss() -> float | None:
    try:
        return float(int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError):
        return None


def per_step(samples: list[Sample], windows: list[tuple[float, float]]) -> list[dict]:
    """Mean of each field over the samples inside each (start, end) window; None where none fell in."""
    rows = []
    for start, end in windows:
        inside = [s for s in samples if start <= s.t <= end]
        row = {"start": start, "end": end, "n_samples": len(inside)}
        for name in ("memory_used", "memory_util", "dram_bw_util", "process_rss"):
            vals = [getattr(s, name) for s in inside if getattr(s, name) is not None]
            row[name] = sum(vals) / len(vals) if vals else None
        rows.append(row)
    return rows


def run_with_telemetry(decoder, interval: float = 0.005) -> tuple[list[dict], Sampler]:
    """Step a SpeculativeDecoder to the end under a Sampler; row i averages trace.steps[i]'s window."""
    windows = []
    with Sampler(interval) as sampler:
        while not decoder.done:
            t0 = time.perf_counter()
            decoder.step()
            windows.append((t0, time.perf_counter()))
    return per_step(sampler.samples, windows), sampler
