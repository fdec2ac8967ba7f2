"""labkit's CPU kernels for decoding, in C++, each beside its torch reference.

- `packed_linear`: y = x W^T + b for the few rows of a decode or verify step. W is packed once
  (`pack_linear`) into column blocks streamed in order, every row of the call reuses each weight
  while it is in cache, and the next weights are prefetched during the arithmetic: a forward over
  8 tokens reads the weights once, as a forward over 1 does. Reference: `torch.nn.functional.linear`.
- `int4_linear`: the same for 4-bit weights (groups of 32 with an fp16 scale and minimum, packed
  once by `pack_int4`) and int8 activations (each row's groups of 32 with a scale of their own):
  integer dot products, 32 at a time, whose cost per row is a quarter of fp32's, so 8 rows cost
  little more than 1. Reference: `int4_linear_ref` (the same arithmetic in torch).
- `decode_attention`: T queries over a KV cache, one row at a time (grouped-query heads read each
  key once, hidden slots skipped, softmax in fp32). Reference: `scaled_dot_product_attention`.
- `rms_norm`, `rope`, `silu_mul`: a decoder layer's per-token operations, each fused into one call
  that rounds where torch rounds. References: labkit.core.ops's `rms_norm`, `apply_rope`, `swiglu`.

Both are batch invariant: a row's output has the same bits whether it is computed alone or with
63 others, so a k-token verify reproduces k one-token steps exactly, in bf16 as in fp32.

The sources are compiled on first use, for this CPU (-march=native: AVX-512, AVX512_BF16 dot
products where the CPU has them, else AVX2 + FMA), with torch's C++ extension builder (needs a
C++ compiler and ninja) into labkit's cache, once per CPU, source and torch version.

    python -m labkit.kernels.cpu          # build, check against the references, print what was built
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

SOURCES = ("vec.h", "linear.cpp", "int4.cpp", "attention.cpp", "pointwise.cpp", "blocks.cpp", "module.cpp")
HEAD_DIMS = (64, 128, 256)          # decode_attention is compiled for these head sizes


class KernelsUnavailable(RuntimeError):
    """The CPU kernels cannot run here; the message says why (and what would fix it)."""


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa(flags: set[str] | None = None) -> str:
    """The vector ISA the kernels compile for on this CPU: 'avx512_bf16', 'avx512', 'avx2' or 'none'."""
    flags = cpu_flags() if flags is None else flags
    if "avx512f" in flags:
        return "avx512_bf16" if "avx512_bf16" in flags else "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "none"


@lru_cache(maxsize=None)
def _build_tag(march: str = "native") -> str:
    """Changes whenever the sources, torch, the compiler, the CPU's features or -march do: a new build then."""
    h = hashlib.sha256(march.encode())
    for name in SOURCES:
        h.update((Path(__file__).parent / name).read_bytes())
    cxx = os.environ.get("CXX", "c++")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        version = ""
    h.update(f"{torch.__version__}|{version}|{' '.join(sorted(cpu_flags()))}".encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    from labkit.files.shipped import cache_dir
    return cache_dir() / "kernels"


BUILD_TIMEOUT_S = 600               # how long a load waits for another process's build of the same kernels


@lru_cache(maxsize=None)
def load(march: str = "native"):
    """The compiled module (built on first call for this CPU); KernelsUnavailable when it cannot be.

    march: gcc's -march; "native" (the default) for this CPU; the tests also build "haswell" (AVX2
    + FMA) on an AVX-512 machine to check the AVX2 code.

    A build survives any death of its process: it runs in a folder of its own and only a finished
    module is renamed into place, and the lock that keeps two processes from building the same
    kernels at once is an flock, which the operating system releases when its holder dies."""
    if platform.machine() not in ("x86_64", "AMD64") or isa() == "none":
        raise KernelsUnavailable(f"labkit's CPU kernels need an x86-64 CPU with AVX2 and FMA (this is "
                                 f"{platform.machine()}, ISA {isa()}): the reference path runs instead")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise KernelsUnavailable("no C++ compiler (c++) on PATH to build labkit's CPU kernels: install g++ "
                                 "(apt-get install g++), or use the reference path")
    tag = _build_tag(march)
    name, out = f"labkit_cpu_{tag}", build_dir() / tag
    built = out / f"{name}.so"
    if built.is_file():
        return _import(name, built)
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = open(build_dir() / f"{tag}.lock", "a+")
    except OSError as e:
        raise KernelsUnavailable(f"cannot write labkit's kernel cache {build_dir()} ({e.strerror or e}): set "
                                 "LABKIT_CACHE to a folder you can write to; the reference path runs instead") from None
    with lock:
        _wait_for(lock, out, float(os.environ.get("LABKIT_BUILD_TIMEOUT", BUILD_TIMEOUT_S)))
        if built.is_file():                                    # another process finished it while we waited
            return _import(name, built)
        lock.seek(0), lock.truncate(), lock.write(f"{os.getpid()}\n"), lock.flush()
        for stale in build_dir().glob(f".{tag}-*"):            # left by builds that died: nobody holds the lock
            shutil.rmtree(stale, ignore_errors=True)
        what = f"this CPU ({isa()})" if march == "native" else f"-march={march}"
        print(f"compiling labkit's CPU kernels for {what} (once, about a minute) ...", file=sys.stderr)
        scratch = Path(tempfile.mkdtemp(prefix=f".{tag}-", dir=build_dir()))
        try:
            from torch.utils import cpp_extension
            module = cpp_extension.load(
                name=name, sources=[str(Path(__file__).parent / s) for s in SOURCES if s.endswith(".cpp")],
                extra_cflags=["-O3", f"-march={march}", "-ffp-contract=off", "-fopenmp"], extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(Path(__file__).parent)], build_directory=str(scratch), verbose=False)
            os.replace(scratch / f"{name}.so", built)          # atomic: a module in `out` is always whole
        except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as e:
            errors = [ln.strip() for ln in str(e).splitlines() if "error" in ln.lower()] or str(e).strip().splitlines()
            raise KernelsUnavailable(f"building labkit's CPU kernels failed: {errors[0][:300]} (build files in "
                                     f"{scratch}); the reference path runs instead") from e
        shutil.rmtree(scratch, ignore_errors=True)
        return module


def _wait_for(lock, out: Path, timeout_s: float) -> None:
    """Take the build lock (an flock on the open file `lock`), waiting while another live process holds it."""
    t0, said = time.monotonic(), False
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        lock.seek(0)
        holder = lock.read().strip() or "?"
        waited = time.monotonic() - t0
        if waited > timeout_s:
            raise KernelsUnavailable(f"process {holder} has been building labkit's CPU kernels in {out} for over "
                                     f"{timeout_s:.0f} s: wait for it or stop it (LABKIT_BUILD_TIMEOUT sets the wait); "
                                     "the reference path runs instead")
        if not said and waited > 2:
            print(f"waiting for process {holder}, which is building labkit's CPU kernels in {out} ...", file=sys.stderr)
            said = True
        time.sleep(0.2)


def _import(name: str, so: Path):
    """Import a finished kernel module from its file."""
    spec = importlib.util.spec_from_file_location(name, so)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise KernelsUnavailable(f"labkit's CPU kernels in {so} do not load ({e}): delete {so.parent} to build "
                                 "them again; the reference path runs instead") from e
    return module


def available() -> tuple[bool, str]:
    """(True, ISA) when the kernels load here, else (False, why not)."""
    try:
        load()
        return True, isa()
    except KernelsUnavailable as e:
        return False, str(e)


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) fp32 or bf16 -> the packed blocks `packed_linear` streams (done once, at load)."""
    return load().pack_linear(weight.detach().contiguous())


def _refuse(what: str) -> None:
    """A call the kernel cannot take, refused here rather than by the kernel's own check: an error thrown inside the
    compiled module has crashed the whole process on some machines (a GPU host's Python, torch 2.11)."""
    raise RuntimeError(what)


def _check_bias(op: str, bias: torch.Tensor | None, n_out: int) -> None:
    """A linear kernel's optional bias: n_out entries (the kernels' fp32_bias check, made before the call)."""
    if bias is not None and bias.numel() != n_out:
        _refuse(f"{op}: bias has {bias.numel()} entries, expected {n_out}")


def packed_linear(x: torch.Tensor, packed: torch.Tensor, n_out: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) -> (..., N) with the packed weight; fp32 x for fp32 weights, bf16 for bf16."""
    k_packed = packed.shape[1] * (2 if packed.dim() == 4 else 1)
    if x.shape[-1] != k_packed or packed.shape[0] * packed.shape[2] < n_out:
        _refuse(f"packed_linear: x has K={x.shape[-1]} but the packed weight ({k_packed} inputs, "
                f"{packed.shape[0] * packed.shape[2]} outputs) does not fit it")
    if x.dtype != packed.dtype:
        _refuse(f"packed_linear: x is {x.dtype} but the weight is packed as {packed.dtype}: convert x")
    _check_bias("packed_linear", bias, n_out)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()                                   # (M, K)
    return load().packed_linear(x2, packed, n_out, bias).view(*x.shape[:-1], n_out)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference `packed_linear` must match."""
    return F.linear(x, weight, bias)


INT4_GROUP = 32                     # int4: weights per scale and minimum along k (and activations per int8 scale)
INT4_BLOCK = 16                     # int4: output columns per packed block
QUANTIZE_ROWS = 128                 # quantize_int4's rows per slice


class Int4Weights(NamedTuple):
    """A weight (N, K) in 4 bits: w = scale * q + lo per group of INT4_GROUP weights along k."""
    q: torch.Tensor          # (N, K) uint8 in 0..15
    scale: torch.Tensor      # (N, K / INT4_GROUP) fp16
    lo: torch.Tensor         # (N, K / INT4_GROUP) fp16

    def dequantize(self) -> torch.Tensor:
        """The (N, K) fp32 weight the 4 bits stand for."""
        N, K = self.q.shape
        w = self.q.float().view(N, -1, INT4_GROUP) * self.scale.float()[..., None] + self.lo.float()[..., None]
        return w.view(N, K)


def quantize_int4(weight: torch.Tensor) -> Int4Weights:
    """Round an (N, K) weight to 4 bits per weight: each group of 32 along k spans its min..max in 15 steps.

    The scale and minimum are stored in fp16 and q is rounded against the stored values, so
    `dequantize()` gives exactly what the kernel multiplies by."""
    N, K = weight.shape
    if K % INT4_GROUP:
        raise ValueError(f"int4 weights need K (in_features) divisible by {INT4_GROUP}; this layer is ({N}, {K}): "
                         "use int8 or bf16 for this model")
    if N > QUANTIZE_ROWS:           # a slice of rows at a time: its temporaries stay in cache
        chunks = [quantize_int4(weight[i:i + QUANTIZE_ROWS]) for i in range(0, N, QUANTIZE_ROWS)]
        return Int4Weights(*(torch.cat(parts, 0) for parts in zip(*chunks)))
    w = weight.detach().float().view(N, K // INT4_GROUP, INT4_GROUP)                  # (N, G, 32)
    lo = w.amin(-1).half()                                                           # (N, G)
    scale = ((w.amax(-1) - lo.float()) / 15).half()
    if not (torch.isfinite(lo).all() and torch.isfinite(scale).all()):
        raise ValueError("a weight group's range does not fit fp16 (|w| > 65504): this layer cannot be stored in "
                         "int4; use bf16")
    s = scale.float()[..., None]
    q = torch.where(s > 0, torch.round((w - lo.float()[..., None]) / s.clamp(min=torch.finfo(torch.float32).tiny)),
                    torch.zeros(()))
    return Int4Weights(q.clamp(0, 15).to(torch.uint8).view(N, K), scale, lo)


def pack_int4(weight: torch.Tensor | Int4Weights) -> tuple[torch.Tensor, torch.Tensor]:
    """An (N, K) weight (or its Int4Weights) -> (packed 4-bit weights, packed scales) for `int4_linear`.

    Blocks of 16 columns; per block, k in steps of 4, 32 bytes a step: byte i holds column i // 4,
    k = 4 * step + i % 4, of the block's first 8 columns in its low nibble and of its last 8 in the
    high one. Scales: per block and group, the 16 scales, then the 16 minimums (fp16)."""
    qw = weight if isinstance(weight, Int4Weights) else quantize_int4(weight)
    N, K = qw.q.shape
    n_blocks = (N + INT4_BLOCK - 1) // INT4_BLOCK
    pad = n_blocks * INT4_BLOCK - N
    q = F.pad(qw.q, (0, 0, 0, pad))                                                  # (Nb * 16, K)
    q = q.view(n_blocks, 2, 8, K // 4, 4).permute(0, 3, 1, 2, 4).reshape(n_blocks, K // 4, 2, 32)
    packed = (q[:, :, 0] | (q[:, :, 1] << 4)).contiguous()                           # (Nb, K/4, 32) uint8
    sl = [F.pad(t, (0, 0, 0, pad)).view(n_blocks, INT4_BLOCK, -1).transpose(1, 2) for t in (qw.scale, qw.lo)]
    scales = torch.stack(sl, 2).contiguous()                                         # (Nb, G, 2, 16) fp16
    return load().on_huge_pages(packed), load().on_huge_pages(scales)


def unpack_int4(packed: torch.Tensor, scales: torch.Tensor, n_out: int) -> Int4Weights:
    """`pack_int4`'s output back to the Int4Weights of its first `n_out` columns (the inverse of the layout above)."""
    n_blocks, groups = scales.shape[:2]
    q = packed.view(n_blocks, -1, 1, 32)
    q = torch.cat([q & 15, q >> 4], 2).view(n_blocks, -1, 2, 8, 4).permute(0, 2, 3, 1, 4)    # (Nb, 2, 8, K/4, 4)
    scale, lo = (scales[:, :, i].transpose(1, 2).reshape(-1, groups)[:n_out] for i in (0, 1))
    return Int4Weights(q.reshape(n_blocks * INT4_BLOCK, -1)[:n_out], scale, lo)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n_out: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) fp32 or bf16 -> (..., N) in x's dtype, with a weight packed by `pack_int4`."""
    K, n_blocks = x.shape[-1], (n_out + INT4_BLOCK - 1) // INT4_BLOCK
    if x.dtype not in (torch.float32, torch.bfloat16):
        _refuse(f"int4_linear: x must be float32 or bfloat16, got {x.dtype}")
    if K % INT4_GROUP:
        _refuse(f"int4_linear: K must be a multiple of {INT4_GROUP}, got {K}")
    if packed.dtype != torch.uint8 or packed.numel() != n_blocks * K // 4 * 32:
        _refuse(f"int4_linear: the packed weight does not fit x's K={K} and {n_out} outputs: pack it with pack_int4")
    _check_bias("int4_linear", bias, n_out)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()                                   # (M, K)
    return load().int4_linear(x2, packed, scales, n_out, bias).view(*x.shape[:-1], n_out)


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (xq (M, G, 32) int8 values as fp32, sx (M, G)): each group of 32 to int8, scale max|x| / 127."""
    xg = x.float().reshape(x.shape[0], -1, INT4_GROUP)                              # (M, G, 32)
    amax = xg.abs().amax(-1)                                                        # (M, G)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros(()))
    return torch.round(xg * inv[..., None]), amax / 127


def int4_linear_ref(x: torch.Tensor, weight: Int4Weights, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference `int4_linear` must match: the same quantized activations and integer group sums, in float64."""
    x2 = x.reshape(-1, x.shape[-1])                                                 # (M, K)
    xq, sx = quantize_rows_ref(x2)
    N, K = weight.q.shape
    q = weight.q.double().view(N, -1, INT4_GROUP)                                   # (N, G, 32)
    isum = torch.einsum("mgk,ngk->mgn", xq.double(), q)                             # (M, G, N), exact integers
    y = (isum * weight.scale.double().t() + xq.double().sum(-1, keepdim=True) * weight.lo.double().t())
    y = (y * sx.double()[..., None]).sum(1)                                         # (M, N)
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype).view(*x.shape[:-1], N)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, H, T, hd) over k, v (B, Hkv, S, hd), mask bool (T, S) or (B, 1, T, S) or None (all slots)."""
    return load().decode_attention(q, k, v, mask, q.shape[-1] ** -0.5)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The reference `decode_attention` must match: torch's attention, K/V heads shared by query groups."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return load().rms_norm(x, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, hd) rotated by cos, sin (B, 1, T, hd) -> a new contiguous (B, H, T, hd)."""
    return load().rope(x, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return load().silu_mul(gate_up)


def rms_norm_ref(x, weight, eps):
    from labkit.core.ops import rms_norm as ref
    return ref(x, weight, eps)


def rope_ref(x, cos, sin):
    from labkit.core.ops import apply_rope
    return apply_rope(x, cos, sin)


def silu_mul_ref(gate_up):
    from labkit.core.ops import swiglu
    return swiglu(gate_up)


def _check() -> None:
    ok, why = available()
    if not ok:
        raise SystemExit(why)
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        w = torch.randn(300, 256, generator=g).to(dtype) * 0.05
        b = torch.randn(300, generator=g).to(dtype)
        x = torch.randn(7, 256, generator=g).to(dtype)
        err = (packed_linear(x, pack_linear(w), 300, b).float() - linear_ref(x, w, b).float()).abs().max().item()
        q, kv = torch.randn(1, 4, 3, 64, generator=g).to(dtype), torch.randn(2, 1, 2, 20, 64, generator=g).to(dtype)
        mask = torch.ones(3, 20, dtype=torch.bool).tril(17)
        aerr = (decode_attention(q, kv[0], kv[1], mask).float() - attention_ref(q, kv[0], kv[1], mask).float()).abs().max()
        print(f"{str(dtype):15s} linear max |err| {err:.2e}, attention {aerr:.2e} (tolerance {tol})")
        assert err < tol * 10 and aerr < tol, "the CPU kernels disagree with their references"
    print(f"labkit CPU kernels OK: {isa()}, bf16 dot products: {load().have_bf16_dot()}, "
          f"{load().block_columns()} columns per block, built in {build_dir()}")


if __name__ == "__main__":
    _check()
