"""What this device can move and compute: facts and measurements, each labelled with its source.

On a GPU, NVML gives the name, the memory size and the peak DRAM bandwidth (max memory clock
x bus width x 2 transfers a clock); with no NVML (a laptop, this CPU box) we say so once and
measure instead: a torch copy benchmark for memory bandwidth, a matmul for FLOP/s, and the
CPU's facts from /proc/cpuinfo. Nothing is guessed: a number we cannot get is absent.
"""
from __future__ import annotations

import os
import platform
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..models.calibrate import sync


@dataclass(frozen=True)
class Measure:
    """A number with its unit and where it came from ("measured: ...", "NVML: ...", "datasheet: ...")."""
    value: float
    unit: str
    source: str

    def __str__(self) -> str:
        scale = next(((s, p) for s, p in [(1e12, "T"), (1e9, "G"), (1e6, "M")] if abs(self.value) >= s), (1, ""))
        return f"{self.value / scale[0]:.3g} {scale[1]}{self.unit} ({self.source})"


@dataclass
class DeviceProfile:
    """The roofline's two numbers for one device, plus the facts shown next to them."""
    name: str
    kind: str                      # "cpu" or "cuda"
    bandwidth: Measure             # bytes/s the roofline uses (measured where possible)
    peak_flops: Measure            # FLOP/s the roofline uses
    facts: dict[str, Measure | str] = field(default_factory=dict)

    def table(self) -> list[tuple[str, str]]:
        rows = [("device", self.name), ("memory bandwidth", str(self.bandwidth)), ("peak compute", str(self.peak_flops))]
        return rows + [(k, str(v)) for k, v in self.facts.items()]


_nvml_warned = False


def nvml_handle(index: int = 0):
    """An NVML device handle, or None (with one plain warning per process) when NVML is missing."""
    global _nvml_warned
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as e:  # pynvml missing, no driver (NVMLError_LibraryNotFound), no such device
        if not _nvml_warned:
            warnings.warn(f"No NVML here ({type(e).__name__}: {e}): no GPU telemetry; showing measured CPU "
                          "numbers instead", RuntimeWarning, stacklevel=2)
            _nvml_warned = True
        return None


def nvml_facts(handle) -> dict[str, Measure | str]:
    """Name, memory size and peak DRAM bandwidth of an NVML device; a fact NVML refuses is left out."""
    import pynvml
    facts: dict[str, Measure | str] = {"name": pynvml.nvmlDeviceGetName(handle)}
    facts["memory"] = Measure(pynvml.nvmlDeviceGetMemoryInfo(handle).total, "B", "NVML")
    try:
        clock_mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
        bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
        facts["peak bandwidth"] = Measure(2 * clock_mhz * 1e6 * bus_bits / 8, "B/s",
                                          f"NVML: 2 x max memory clock {clock_mhz} MHz x {bus_bits}-bit bus")
    except pynvml.NVMLError as e:
        facts["peak bandwidth"] = f"not reported by NVML ({e})"
    try:
        facts["GPM (DRAM bandwidth metrics)"] = "yes" if pynvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice \
            else "no (needs Hopper or newer)"
    except pynvml.NVMLError as e:
        facts["GPM (DRAM bandwidth metrics)"] = f"no ({e})"
    return facts


def cpu_facts() -> dict[str, Measure | str]:
    """Model name and core count from /proc/cpuinfo and the OS, total memory from /proc/meminfo."""
    facts: dict[str, Measure | str] = {"cpu": platform.processor() or platform.machine()}
    try:
        info = Path("/proc/cpuinfo").read_text()
        names = [ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")]
        if names:
            facts["cpu"] = names[0]
        flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "").split()
        facts["bf16/fp16 matmul units"] = ", ".join(f for f in ("avx512_bf16", "amx_bf16", "avx512_fp16") if f in flags) \
            or "none (bf16 matmuls run on generic AVX code)"
    except OSError:
        pass
    facts["logical cores"] = str(os.cpu_count())
    facts["torch threads"] = str(torch.get_num_threads())
    try:
        kb = next(int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
        facts["memory"] = Measure(kb * 1024, "B", "/proc/meminfo")
    except (OSError, StopIteration):
        pass
    return facts


def add_timing_args(parser) -> None:
    """--threads and --cpu-time for a benchmark script's argparse parser."""
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with this thread's CPU time (use with --threads 1): stable on a shared machine")


def timing_clock(device: str, threads: int | None, cpu_time: bool):
    """Set torch's threads; the clock to time with: this thread's CPU time on one CPU thread, else wall time."""
    if threads:
        torch.set_num_threads(threads)
    if cpu_time and (torch.device(device).type != "cpu" or torch.get_num_threads() != 1):
        raise SystemExit("--cpu-time measures one CPU thread: use it with --device cpu --threads 1")
    return time.thread_time if cpu_time else time.perf_counter


def clock_name(clock) -> str:
    return "CPU time of this thread" if clock is time.thread_time else "wall time"


def measure_copy_bandwidth(device: str | torch.device = "cpu", size_mib: int = 256, repeats: int = 5,
                           clock=time.perf_counter) -> Measure:
    """Bytes/s of a large tensor copy (read + write both counted), the best of `repeats`.

    clock: time.perf_counter (wall), or time.thread_time with torch.set_num_threads(1) on a shared CPU.
    """
    device = torch.device(device)
    n = size_mib * 2**20
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):                        # the first copy warms up (page faults, clocks)
        sync(device)
        t0 = clock()
        dst.copy_(src)
        sync(device)
        best = min(best, clock() - t0)
    return Measure(2 * n / best, "B/s", f"measured: torch copy of {size_mib} MiB on {device.type}, "
                                        f"{torch.get_num_threads()} threads, read+write, best of {repeats}, "
                                        f"{clock_name(clock)}")


def measure_matmul_flops(device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16, n: int = 2048,
                         repeats: int = 3, clock=time.perf_counter) -> Measure:
    """FLOP/s of an n x n x n matmul in `dtype`, the best of `repeats` (what the decoder's linears can reach)."""
    device = torch.device(device)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        sync(device)
        t0 = clock()
        a @ b
        sync(device)
        best = min(best, clock() - t0)
    return Measure(2 * n**3 / best, "FLOP/s", f"measured: {n}^3 {str(dtype).removeprefix('torch.')} matmul "
                                              f"on {device.type}, {torch.get_num_threads()} threads, best of "
                                              f"{repeats}, {clock_name(clock)}")


def describe(device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16, quick: bool = False,
             clock=time.perf_counter) -> DeviceProfile:
    """The device's roofline numbers: measured bandwidth and FLOP/s, NVML's peak next to them on a GPU.

    quick: smaller benchmarks (a second instead of several), for notebooks and tests.
    """
    device = torch.device(device)
    size, n = (64, 1024) if quick else (256, 2048)
    if device.type == "cuda" and not quick:
        size, n = 2048, 8192                    # a GPU's L2 holds 50+ MB and needs large matmuls to fill
    bandwidth = measure_copy_bandwidth(device, size_mib=size, clock=clock)
    flops = measure_matmul_flops(device, dtype, n=n, clock=clock)
    if device.type == "cuda":
        handle = nvml_handle(device.index or 0)
        facts = nvml_facts(handle) if handle is not None else {"name": torch.cuda.get_device_name(device)}
        return DeviceProfile(str(facts.pop("name")), "cuda", bandwidth, flops, facts)
    nvml_handle()   # says once that there is no GPU telemetry, where that is so
    facts = cpu_facts()
    return DeviceProfile(str(facts.pop("cpu")), "cpu", bandwidth, flops, facts)
