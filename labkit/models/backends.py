"""Forward paths: which kernels labkit's Transformer runs its linear layers and attention with.

transformer.py is the reference, written with nn.Linear and torch's attention. A path is a swap of
those modules, applied once at load; the model code is the same on every path:

    reference   nn.Linear and scaled_dot_product_attention: the model as written
    onednn      linear weights prepacked once for oneDNN (torch.utils.mkldnn); torch's attention
    packed      labkit's CPU kernels (kernels/cpu): weight-streaming linear layers whose cost is
                nearly flat from 1 to ~12 tokens, per-row decode attention, and RMSNorm, RoPE and
                SwiGLU fused into one call each; all batch invariant, so a k-token verify gives the
                bits of k one-token steps. A forward's blocks run in one C++ call (models/fused.py)
    packed-amx  on a CPU with AMX, bf16: the packed path up to WIDE_ROWS - 1 tokens, and oneDNN's AMX
                tile kernels (a second copy of the weights) for wider forwards (trees, prefill),
                where AMX does 16-64 rows in about the time the weights take to stream; a verify that
                wide is then not bit-identical to one-token steps (bf16 rounding differs)

Precision is the weights': fp32 or bf16 as loaded (activations follow), or int8 / int4. int8 runs
torch's weight-only CPU kernel (bf16 activations). int4 runs labkit's own 4-bit kernel on the packed
path (kernels/cpu/int4.cpp: groups of 32 weights with an fp16 scale and minimum, int8 activations,
integer dot products, on AMX tiles for 2+ rows where the CPU has them; batch invariant, so a k-token
verify gives the bits of k one-token steps) and torch's weight-only int4 kernel elsewhere. A
quantized model is a model of its own: speculative decoding reproduces that model's plain decoding,
not the bf16 one's (its quality against bf16: scripts/precision_quality.py). `labkit.models.calibrate` picks the path on each machine; `load_model(backend=...)`,
`--backend` and `--draft-precision` override it.
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from .layers import RMSNorm, Rotary, SDPAttention, SwiGLU

PATHS = ("reference", "onednn", "packed", "packed-amx")
PRECISIONS = ("fp32", "bf16", "int8", "int4")
QUANTIZED = ("int8", "int4")
INT4_GROUP = 32                      # int4: one scale and zero per 32 weights of a row
WIDE_ROWS = 12                       # packed-amx: forwards of this many rows or more go to oneDNN (AMX)


@dataclass(frozen=True)
class ForwardPath:
    """What ran a model's forward: the path, the weights' precision, the device."""
    name: str = "reference"          # reference | onednn | packed | transformers
    precision: str = ""              # fp32 | bf16 | fp16 | int8 | int4 ("": as the weights are)
    device: str = "cpu"

    def filled(self, weight: torch.Tensor) -> "ForwardPath":
        """This path with the precision and device read off a dense weight where they are unset."""
        return self if self.precision else replace(self, precision=precision_of(weight.dtype), device=weight.device.type)

    def __str__(self) -> str:
        return f"{self.name} path, {self.precision} weights, {self.device}"

    def to_dict(self) -> dict:
        return {"path": self.name, "precision": self.precision, "device": self.device}


def precision_of(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


class KernelAttention(nn.Module):
    """labkit's per-row decode attention (kernels/cpu); falls back to torch's where it is not compiled."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        from ..kernels import cpu
        if q.shape[-1] not in cpu.HEAD_DIMS or q.is_cuda or q.dtype not in (torch.float32, torch.bfloat16):
            return cpu.attention_ref(q, k, v, mask)
        return cpu.decode_attention(q, k, v, mask)                                          # (B, H, T, hd)


ATTENTIONS = ("sdpa", "triton")


class TritonAttention(SDPAttention):
    """labkit's Triton attention over a static cache (kernels/cache_attention: K/V read once per head group, the
    cache split across programs, its unused tail skipped) where the mask is a (T, S) bool one, as the compiled loops
    give it; torch's attention (SDPAttention) for any other mask."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        from ..kernels import cache_attention as cache
        if mask is not None and mask.dtype == torch.bool and mask.shape == (q.shape[2], k.shape[2]):
            return cache.cache_attention(q, k, v, mask)                                      # (B, H, T, hd)
        return super().forward(q, k, v, mask)


def use_attention(model: nn.Module, kind: str) -> nn.Module:
    """Run every attention of `model` (each layer's `core`) with `kind`, in place: "sdpa", torch's
    scaled_dot_product_attention (the reference, and the default), or "triton", kernels/cache_attention (CUDA; a CPU
    runs it only under TRITON_INTERPRET=1, slowly). Steps compiled after the swap trace the new attention."""
    if kind not in ATTENTIONS:
        raise ValueError(f"unknown attention {kind!r}: choose from {', '.join(ATTENTIONS)}")
    device = next(model.parameters()).device
    if kind == "triton":
        from ..kernels import HAVE_TRITON
        if not HAVE_TRITON:
            raise ValueError("the Triton attention needs Triton (pip install triton, on a machine with a CUDA GPU); "
                             "use attention='sdpa'")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"the Triton attention runs on CUDA GPUs; this model is on {device.type}: use "
                             "attention='sdpa' (a CPU's packed forward path has its own attention kernel)")
    layers = attention_layers(model)
    if kind == "triton" and any(isinstance(m.core, KernelAttention) for m in layers):
        raise ValueError("this model runs the packed CPU path's attention; load it on the reference path "
                         "(backend='reference') to choose the attention")
    for m in layers:
        m.core = TritonAttention() if kind == "triton" else SDPAttention()
    return model


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The attention layers under `model`: those whose `core` (softmax(q k^T / sqrt(hd)) v) is one of the swaps here."""
    cores = (SDPAttention, KernelAttention)                                 # TritonAttention is an SDPAttention
    return [m for m in model.modules() if isinstance(getattr(m, "core", None), cores)]


def attention_of(model: nn.Module) -> str:
    """Which attention `model`'s layers run: "sdpa", "triton", or the CPU kernels' "packed"."""
    kinds = {type(m.core) for m in attention_layers(model)}
    names = {SDPAttention: "sdpa", TritonAttention: "triton", KernelAttention: "packed"}
    return "+".join(sorted(names.get(k, k.__name__) for k in kinds))


def _numel(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel()


def _fused_ok(x: torch.Tensor, size: int) -> bool:
    """The fused CPU kernels take fp32/bf16 CPU tensors whose row size is a whole number of vectors."""
    return not x.is_cuda and x.dtype in (torch.float32, torch.bfloat16) and size % 32 == 0


class KernelRMSNorm(nn.Module):
    """model.RMSNorm in one call (kernels/cpu/pointwise.cpp); same weight, same rounding."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels import cpu
        if not _fused_ok(x, x.shape[-1]):
            return cpu.rms_norm_ref(x, self.weight, self.eps)
        return cpu.rms_norm(x, self.weight, self.eps)


class KernelRotary(nn.Module):
    """model.Rotary in one call per tensor."""

    def forward(self, q, k, cos, sin):
        from ..kernels import cpu
        if not _fused_ok(q, q.shape[-1]) or cos.dtype != q.dtype:
            return cpu.rope_ref(q, cos, sin), cpu.rope_ref(k, cos, sin)
        return cpu.rope(q, cos, sin), cpu.rope(k, cos, sin)


class KernelSwiGLU(nn.Module):
    """model.SwiGLU in one call."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        from ..kernels import cpu
        if not _fused_ok(gate_up, gate_up.shape[-1] // 2):
            return cpu.silu_mul_ref(gate_up)
        return cpu.silu_mul(gate_up)


class PackedLinear(nn.Module):
    """nn.Linear through labkit's weight-streaming kernel; the weight is packed once, here.

    wide_rows: also keep the weight in oneDNN's layout and send products of this many rows or
    more there (the packed-amx path); None: every product runs the packed kernel."""

    def __init__(self, linear: nn.Linear, wide_rows: int | None = None):
        super().__init__()
        from ..kernels import cpu
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", cpu.pack_linear(linear.weight))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())
        self.wide_rows = wide_rows
        self.wide = OneDNNLinear(linear) if wide_rows else None

    def weight_stats(self) -> tuple[int, int]:
        """(parameters, bytes one forward streams): the packed copy (packed-amx keeps a second one for wide rows)."""
        n, b = self.in_features * self.out_features, _numel(self.bias)
        return n + b, n * self.packed.element_size() + b * 4

    @property
    def weight(self) -> torch.Tensor:
        """The (N, K) weight unpacked again (a copy, for code that reads it once, e.g. a head's vocabulary)."""
        return self._unpack(self.packed)[: self.out_features]

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids` (n, K), unpacking only the blocks that hold them."""
        width = self.packed.shape[2]                                     # NBW columns a block
        blocks, where = (ids // width).unique(return_inverse=True)
        return self._unpack(self.packed[blocks])[where * width + ids % width]

    def _unpack(self, p: torch.Tensor) -> torch.Tensor:
        # [Nb][K][NBW] or [Nb][K/2][NBW][2] -> (Nb * NBW, K)
        return p.permute(0, 2, 1, 3).reshape(-1, self.in_features) if p.dim() == 4 else \
            p.transpose(1, 2).reshape(-1, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels import cpu
        if self.wide is not None and x.numel() >= self.wide_rows * self.in_features:
            return self.wide(x).to(x.dtype)
        return cpu.packed_linear(x, self.packed, self.out_features, self.bias)


class OneDNNLinear(nn.Module):
    """nn.Linear with the weight reordered once into oneDNN's layout (torch.utils.mkldnn's recipe)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        self.w = linear.weight.detach().to_mkldnn(self.dtype)                       # (N, K), oneDNN layout
        bias = linear.bias.detach().float() if linear.bias is not None else torch.zeros(self.out_features)
        self.b = bias.to_mkldnn()                                                   # fp32, as torch.utils.mkldnn
        self.n_bias = 0 if linear.bias is None else self.out_features

    def weight_stats(self) -> tuple[int, int]:
        """(parameters, bytes): the weight and the bias (held outside torch's buffers, in oneDNN's tensors)."""
        n = self.in_features * self.out_features
        return n + self.n_bias, n * torch.finfo(self.dtype).bits // 8 + self.n_bias * 4

    @property
    def weight(self) -> torch.Tensor:
        return self.w.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(self.dtype).contiguous()           # (M, K)
        y = torch._C._nn.mkldnn_linear(x2.to_mkldnn(), self.w, self.b).to_dense()   # (M, N)
        return y.view(*x.shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    """Weight-only int8: one symmetric scale per output row; torch's `_weight_int8pack_mm` (bf16 activations)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()                                               # (N, K)
        scale = (w.abs().amax(1) / 127).clamp(min=1e-12)                                 # (N,)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("q", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(torch.bfloat16))

    def weight_stats(self) -> tuple[int, int]:
        b = _numel(self.bias)
        return self.q.numel() + b, self.q.numel() + (self.scale.numel() + b) * 2

    @property
    def weight(self) -> torch.Tensor:
        return (self.q.float() * self.scale.float()[:, None]).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()            # (M, K)
        y = torch.ops.aten._weight_int8pack_mm(x2, self.q, self.scale)                  # (M, N)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """Weight-only int4: a scale and a minimum per 32 weights; torch's `_weight_int4pack_mm_for_cpu`."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        N, K = linear.weight.shape
        if K % INT4_GROUP or N % 16:
            raise ValueError(f"int4 weights need layers of (N, K) with N divisible by 16 and K by {INT4_GROUP} "
                             f"(torch's kernel); this model has a ({N}, {K}) layer: use int8 or bf16")
        w = linear.weight.detach().float().view(N, K // INT4_GROUP, INT4_GROUP)         # (N, G, 32)
        lo, hi = w.amin(-1), w.amax(-1)                                                  # (N, G)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(N, K)
        self.in_features, self.out_features = K, N
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        # the kernel dequantizes (q - 8) * scale + zero, so zero = lo + 8 * scale; (G, N, 2) in bf16
        self.register_buffer("scale_zero", torch.stack([scale.t(), (lo + 8 * scale).t()], -1).contiguous()
                             .to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(torch.bfloat16))

    def weight_stats(self) -> tuple[int, int]:
        n, b = self.in_features * self.out_features, _numel(self.bias)
        return n + b, n // 2 + (self.scale_zero.numel() + b) * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()            # (M, K)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, INT4_GROUP, self.scale_zero)  # (M, N)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class PackedInt4Linear(nn.Module):
    """nn.Linear in 4 bits through labkit's int4 kernel (kernels/cpu/int4.cpp); packed once, here."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        from ..kernels import cpu
        self._hold(cpu.quantize_int4(linear.weight), linear.bias)

    @classmethod
    def from_int4(cls, weights, bias: torch.Tensor | None = None) -> "PackedInt4Linear":
        """The layer of weights already in 4 bits (a kernels.cpu.Int4Weights), packed as they are."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._hold(weights, bias)
        return layer

    def _hold(self, weights, bias: torch.Tensor | None) -> None:
        from ..kernels import cpu
        self.out_features, self.in_features = weights.q.shape
        packed, scales = cpu.pack_int4(weights)
        self.register_buffer("packed", packed)                                        # (N/16, K/4, 32) uint8
        self.register_buffer("scales", scales)                                        # (N/16, K/32, 2, 16) fp16
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    def weight_stats(self) -> tuple[int, int]:
        n, b = self.in_features * self.out_features, _numel(self.bias)
        return n + b, self.packed.numel() + self.scales.numel() * 2 + b * 4

    @property
    def weight(self) -> torch.Tensor:
        """The (N, K) weight the 4 bits stand for (a bf16 copy, for code that reads it once)."""
        from ..kernels import cpu
        return cpu.unpack_int4(self.packed, self.scales, self.out_features).dequantize().to(torch.bfloat16)

    def int4_rows(self, ids: torch.Tensor):
        """The rows `ids` (n,) in 4 bits (a kernels.cpu.Int4Weights), unpacking only the blocks that hold them."""
        from ..kernels import cpu
        blocks, where = (ids // cpu.INT4_BLOCK).unique(return_inverse=True)
        w = cpu.unpack_int4(self.packed[blocks], self.scales[blocks], len(blocks) * cpu.INT4_BLOCK)
        rows = where * cpu.INT4_BLOCK + ids % cpu.INT4_BLOCK
        return cpu.Int4Weights(w.q[rows], w.scale[rows], w.lo[rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels import cpu
        return cpu.int4_linear(x, self.packed, self.scales, self.out_features, self.bias)


def weight_dtype(linear: nn.Module) -> torch.dtype:
    """The dtype a linear layer on any path computes in (without unpacking its weight)."""
    if isinstance(linear, nn.Linear):
        return linear.weight.dtype
    if isinstance(linear, PackedLinear):
        return linear.packed.dtype
    if isinstance(linear, OneDNNLinear):
        return linear.dtype
    return torch.bfloat16                                    # int8 / int4: bf16 activations


def rows_of(linear: nn.Module, ids: torch.Tensor) -> nn.Module:
    """The outputs `ids` (n,) of a linear layer on any path, as a layer of the same kind and precision: on the packed
    paths and in int8 its outputs are `linear`'s at `ids`, bit for bit (each output is computed on its own), so a
    draft that scores a few tokens scores them as its whole LM head does. The weights are not quantized again."""
    ids = ids.long()
    bias = getattr(linear, "bias", None)
    sub_bias = None if bias is None else bias[ids.to(bias.device)]
    if isinstance(linear, PackedInt4Linear):
        return PackedInt4Linear.from_int4(linear.int4_rows(ids), sub_bias)
    if isinstance(linear, Int8Linear):
        layer = copy.copy(linear)
        layer._buffers = {"q": linear.q[ids].contiguous(), "scale": linear.scale[ids].contiguous(), "bias": sub_bias}
        layer.out_features = len(ids)
        return layer
    if isinstance(linear, Int4Linear):
        raise ValueError("torch's int4 kernel (the reference path's int4) keeps its weights in a layout labkit cannot "
                         "cut rows from: load the draft with backend='packed' to give it a vocabulary of its own")
    rows = linear.weight_rows(ids) if isinstance(linear, PackedLinear) else linear.weight[ids.to(linear.weight.device)]
    dense = nn.Linear(linear.in_features, len(ids), bias=bias is not None, device="meta")
    dense.weight = nn.Parameter(rows.detach().clone(), requires_grad=False)
    if bias is not None:
        dense.bias = nn.Parameter(sub_bias.detach().clone(), requires_grad=False)
    if isinstance(linear, PackedLinear):
        return PackedLinear(dense, wide_rows=linear.wide_rows)
    if isinstance(linear, OneDNNLinear):
        return OneDNNLinear(dense)
    return dense


def readout(weight: torch.Tensor, path: ForwardPath) -> nn.Module:
    """x -> x @ weight.T (weight (N, K), e.g. some rows of an LM head) as a bias-free linear layer on `path`."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
    lin.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return linear_for(lin, path) if path.device == "cpu" else lin


def _linear_for(path: str, precision: str):
    if precision == "int8":
        return Int8Linear
    if precision == "int4":
        return PackedInt4Linear if path == "packed" else Int4Linear
    if path == "packed-amx":
        return lambda linear: PackedLinear(linear, wide_rows=WIDE_ROWS)
    return {"reference": None, "onednn": OneDNNLinear, "packed": PackedLinear}[path]


def onednn_bf16() -> bool:
    """Whether torch's mkldnn_linear runs bf16 here (it refuses CPUs without these instructions)."""
    from ..kernels import cpu
    flags = cpu.cpu_flags()
    return "avx_ne_convert" in flags or {"avx512bw", "avx512vl", "avx512dq"} <= flags


def check_path(path: str, precision: str) -> None:
    """A clear error for an unknown path or precision, or one this machine cannot run."""
    if path not in PATHS:
        raise ValueError(f"unknown forward path {path!r}: choose from {', '.join(PATHS)} (or 'auto')")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: choose from {', '.join(PRECISIONS)}")
    if path.startswith("packed"):
        from ..kernels import cpu
        ok, why = cpu.available()
        if not ok:
            raise ValueError(f"the {path} path cannot run here: {why}")
    if path == "onednn" and precision == "bf16" and not onednn_bf16():
        raise ValueError("oneDNN's bf16 linear needs a CPU with AVX-512 (avx512bw, avx512vl, avx512dq) or "
                         "avx_ne_convert, which this one lacks: use the packed or reference path, or fp32")
    if path == "packed-amx":
        from ..kernels import cpu
        if "amx_bf16" not in cpu.cpu_flags() or precision != "bf16":
            raise ValueError("the packed-amx path needs a CPU with AMX (amx_bf16) and bf16 weights: "
                             "use the packed path")
    if precision in QUANTIZED and not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        raise ValueError(f"{precision} weights need torch's weight-only CPU kernels (torch >= 2.3): use bf16 or fp32")


def linear_for(linear: nn.Linear, path: ForwardPath) -> nn.Module:
    """`linear` as the module `path` runs it with (itself on the reference path)."""
    cls = _linear_for(path.name, path.precision)
    return linear if cls is None else cls(linear)


@torch.no_grad()
def apply_path(model: nn.Module, path: str, precision: str) -> nn.Module:
    """Swap `model`'s nn.Linear and attention modules for `path`'s, in place; record it in `model.forward_path`.

    `model` is a labkit Transformer (or any module with a `forward_path` field) on the reference
    path, as loaded, on the CPU. Tied weights (an LM head sharing the embedding) are converted
    separately; the embedding lookup keeps the dense table.
    """
    check_path(path, precision)
    current = model.forward_path
    if current.name != "reference" or current.precision in QUANTIZED:
        raise ValueError(f"the model already runs the {current}: load it again to choose another path")
    device = next(model.parameters()).device
    if device.type != "cpu" and path != "reference":
        raise ValueError(f"the {path} path runs on a CPU; this model is on {device} (use backend='reference')")
    dense = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(precision, torch.bfloat16)
    if precision in QUANTIZED:
        model.to(dense)                                  # activations (and the embedding table) in bf16
    elif next(model.parameters()).dtype != dense:
        raise ValueError(f"this model was loaded in {next(model.parameters()).dtype}; load it with dtype="
                         f"{precision!r} for {precision} weights")
    model.forward_path = swap_modules(model, ForwardPath(path, precision, device.type))
    return model


def swap_modules(module: nn.Module, path: ForwardPath, keep: tuple[str, ...] = ()) -> ForwardPath:
    """Swap every nn.Linear under `module` for `path`'s; on the packed path also the attention,
    RMSNorm, RoPE and SwiGLU modules for their fused kernels. keep: children of `module` left as they are (an
    EAGLE-3 head's LM head, whose rows its drafter reads as a tensor)."""
    fused = {SDPAttention: KernelAttention, RMSNorm: KernelRMSNorm, Rotary: KernelRotary, SwiGLU: KernelSwiGLU}
    for name, child in module.named_children():
        if name in keep:
            continue
        if isinstance(child, nn.Linear):
            setattr(module, name, linear_for(child, path))
        elif path.name.startswith("packed") and type(child) in fused:
            kernel = fused[type(child)]
            setattr(module, name, kernel(child) if kernel is KernelRMSNorm else kernel())
        else:
            swap_modules(child, path)
    return path
