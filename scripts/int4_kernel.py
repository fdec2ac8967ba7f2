"""labkit's 4-bit linear kernel alone: time against rows, on AMX tiles and on vector code only.

    python scripts/int4_kernel.py          # -> data/bench/int4_kernel_<cpu>_<isa>.{json,md,png}

Every linear layer of the 1.5B target's 28 blocks (q/k/v, o, gate/up, down: 0.80 GB packed, more than
any CPU cache here), random weights in labkit's int4 format, one call per layer as a forward makes
them, timed for M = 1 .. 64 rows (a verify of M tokens). Where the CPU has AMX, calls of 2+ rows run on
the tile unit; `int4_use_amx(False)` sends them to the vector code (VNNI or AVX2) for comparison; the
two give the same bits (tests/test_cpu_kernels.py). The bandwidth line is the packed bytes over the
measured copy bandwidth. Rows take turns (round robin) and the best of `--repeats` counts.

The same number of weights again from the cache (`--in-cache`, the vector code): the block's largest layer
(gate/up, 16.4 MiB packed with its scales, within the last-level cache of the CPUs here) called over and over until it has
multiplied as many weights as the pass above. That pass streams nothing from memory, so its time is the
arithmetic's (and the cache's feed): what M rows cost a CPU whose memory were free. Where it exceeds
1.3 x the streamed pass of one row, no blocking of the work makes t(8)/t(1) <= 1.3 on that CPU.
"""
from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from labkit.bench.writer import markdown_table, write_outputs  # noqa: E402
from labkit.hw.device import measure_copy_bandwidth  # noqa: E402
from labkit.kernels import cpu  # noqa: E402
from labkit.models.calibrate import isa_label, load_average, machine, machine_slug  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# (out_features, in_features) of one block of qwen2.5-coder-1.5b: fused q/k/v, o, fused gate/up, down
BLOCK = ((2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960))
ROWS = (1, 2, 4, 8, 16, 32, 64)


def layers(n_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """(packed, scales, N, K) of every layer of `n_blocks` blocks; each block's weights differ (no cache reuse)."""
    g = torch.Generator().manual_seed(0)
    base = [cpu.quantize_int4(torch.randn(n, k, generator=g) * 0.02) for n, k in BLOCK]
    out = []
    for b in tqdm(range(n_blocks), desc="packing"):
        for qw, (n, k) in zip(base, BLOCK):
            packed, scales = cpu.pack_int4(cpu.Int4Weights(qw.q.roll(b, 0), qw.scale, qw.lo))
            out.append((packed, scales, n, k))
    return out


def in_cache_layers(weights) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """One gate/up layer, repeated to multiply as many weights as `weights` hold: a pass fed from the cache."""
    gate_up = next(w for w in weights if (w[2], w[3]) == BLOCK[2])
    total = sum(n * k for _, _, n, k in weights)
    return [gate_up] * round(total / (gate_up[2] * gate_up[3]))


def last_level_cache() -> int | None:
    """Bytes of the CPU's last-level cache (Linux sysfs), None where it does not say."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM" else int(text))
    return max(sizes, default=None)


def time_rows(weights, rows: tuple[int, ...], repeats: int, amx: bool) -> dict[int, float]:
    """Best-of-`repeats` seconds of one pass over every layer, per row count (rows take turns)."""
    kernels = cpu.load()
    was = kernels.int4_use_amx(amx)
    try:
        xs = {M: {k: torch.randn(M, k).bfloat16() for _, k in BLOCK} for M in rows}
        runs = {M: [] for M in rows}
        for _ in tqdm(range(repeats + 1), desc="AMX tiles" if amx else "vector code"):
            for M in rows:
                t0 = time.perf_counter()
                for packed, scales, n, k in weights:
                    cpu.int4_linear(xs[M][k], packed, scales, n)
                runs[M].append(time.perf_counter() - t0)
        return {M: min(r[1:]) for M, r in runs.items()}                # the first round warms up
    finally:
        kernels.int4_use_amx(was)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=28, help="transformer blocks' worth of layers")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "data/bench"))
    ap.add_argument("--in-cache", action="store_true",
                    help="time the vector code on the same number of weights from the cache too (the arithmetic)")
    ap.add_argument("--name", default=None, help="output name (default int4_kernel_<cpu>_<isa>)")
    a = ap.parse_args()
    m, load0 = machine(), load_average()
    weights = layers(a.blocks)
    nbytes = sum(p.numel() * p.element_size() + s.numel() * s.element_size() for p, s, _, _ in weights)
    bandwidth = measure_copy_bandwidth("cpu", size_mib=512)
    kernels = cpu.load()
    runs = {"vector": time_rows(weights, ROWS, a.repeats, amx=False)}
    if kernels.int4_amx():
        runs["amx"] = time_rows(weights, ROWS, a.repeats, amx=True)
    cached = in_cache_layers(weights) if a.in_cache else None
    if cached:
        runs["cached"] = time_rows(cached, ROWS, a.repeats, amx=False)
    line = nbytes / bandwidth.value
    vector = "vector code (VNNI)" if kernels.int4_vnni() else "vector code (AVX2)"
    code = {"vector": vector, "amx": "AMX tiles", "cached": f"{vector}, weights from the cache"}
    rows = [{"code": code[name], "rows": M, "ms": t * 1e3, "ratio": t / times[1], "vs_line": t / line}
            for name, times in runs.items() for M, t in times.items()]
    facts = {"cpu": m["cpu"], "isa": isa_label(m), "threads": m["threads"], "torch": m["torch"], "blocks": a.blocks,
             "packed_bytes": nbytes, "bandwidth": {"value": bandwidth.value, "source": bandwidth.source},
             "in_cache": {"layer_bytes": cached[0][0].numel() + 2 * cached[0][1].numel(), "calls": len(cached),
                          "last_level_cache": last_level_cache()} if cached else None,
             "load_average": {"before": load0, "after": load_average()},
             "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    table = "\n".join(markdown_table(rows, {"code": "{code}", "rows M": "{rows}", "ms": "{ms:.1f}",
                                            "t(M)/t(1)": "{ratio:.2f}", "t / bandwidth line": "{vs_line:.2f}"}))
    md = (f"# labkit's int4 kernel: time against rows\n\n{m['cpu']} ({isa_label(m)}), {m['threads']} threads, "
          f"torch {m['torch']}; load average {load0[0]} before, {facts['load_average']['after'][0]} after; "
          f"{facts['date']}. Every linear layer of {a.blocks} blocks of the 1.5B target's shapes, random int4 "
          f"weights ({nbytes / 1e9:.2f} GB packed), one call per layer, best of {a.repeats}. Bandwidth line: "
          f"{line * 1e3:.1f} ms (the packed bytes / {bandwidth.value / 1e9:.1f} GB/s, {bandwidth.source}). "
          "t(M)/t(1) is against each code's own one-row time; one row always runs the vector code.\n\n"
          + table + "\n" + (floor_sentences(runs, facts) if cached else ""))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, times in runs.items():
        ax.plot(list(times), [t * 1e3 for t in times.values()], "o-", label=code[name])
    ax.axhline(line * 1e3, color="tab:red", lw=2.5, alpha=0.3, label="bandwidth line")
    ax.set(xscale="log", xlabel="rows M (tokens in one forward)", ylabel="ms for every layer once", ylim=(0, None),
           title=f"int4 linear layers, {m['cpu']} ({isa_label(m)})")
    ax.set_xticks(ROWS, [str(r) for r in ROWS])
    ax.legend()
    write_outputs(Path(a.out) / (a.name or f"int4_kernel_{machine_slug(m)}"), {"facts": facts, "rows": rows}, md, fig)
    print(md)


def floor_sentences(runs: dict[str, dict[int, float]], facts: dict) -> str:
    """What the pass from the cache says about the streamed one: the arithmetic of 8 rows against 1 row's stream."""
    c, llc = facts["in_cache"], facts["in_cache"]["last_level_cache"]
    streamed, cached = runs["vector"], runs["cached"]
    floor = cached[8] / streamed[1]
    where = f"its {llc / 2**20:.0f} MiB last-level cache" if llc else "the cache"
    verdict = ("more than 1.3: with memory this fast no blocking of the work brings the vector code's t(8)/t(1) to "
               "1.3 on this CPU; only fewer integer operations a row would (or a CPU with more of them a cycle: "
               "AMX tiles)" if floor > 1.3 else
               "at most 1.3: memory this slow leaves the arithmetic room to hide under one row's stream")
    return (f"\nFrom the cache (the gate/up layer, {c['layer_bytes'] / 2**20:.1f} MiB, within {where}, called "
            f"{c['calls']} times): 8 rows take {cached[8] * 1e3:.1f} ms and 1 row {cached[1] * 1e3:.1f} ms, so each "
            f"row past the first costs {(cached[8] - cached[1]) / 7 * 1e3:.2f} ms of arithmetic. The 8 rows' "
            f"arithmetic alone is {floor:.2f} x the streamed pass of one row ({streamed[1] * 1e3:.1f} ms), "
            f"{verdict}; streamed, 8 rows took {streamed[8] * 1e3:.1f} ms "
            f"({streamed[8] / streamed[1]:.2f} x).\n")


if __name__ == "__main__":
    main()
