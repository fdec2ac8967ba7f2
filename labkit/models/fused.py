"""The packed path's blocks in one call: every layer of a forward run by C++ (kernels/cpu/blocks.cpp).

On the packed path each decoder block is about 25 small operations: norms, four linear layers, RoPE,
the cache write, attention, two residual adds, and the views between them. Their kernels are fast;
calling them from Python is not, so a 1-token step of a small draft spends a good share of its time
between kernels (docs/forward-paths.md measures it), and every speculative method pays it once per
drafted token. `FusedBlocks` hands the whole stack of blocks to one C++ function that calls the same
kernels in the same order, so its output is the module-by-module forward's, bit for bit
(tests/test_fused_blocks.py), and only the calling cost goes.

`Transformer.blocks` uses it by itself where it applies: the packed path (one of labkit's packed
linear kinds in every layer, its fused norm, RoPE, SwiGLU and attention; on packed-amx, forwards of
fewer rows than it sends to oneDNN), a plain `KVCache`, no forward hooks on the layers, a head size
the attention kernel is built for. Anything else (the compiled loops' static cache, a ragged batch
cache, a hook that must see every layer) runs the modules as written. `use_fused(model, False)`
turns it off, to compare the two. `FusedBlocks.with_taps` returns some blocks' outputs too, for
EAGLE-3's target (`adapters.layer_taps`).
"""
from __future__ import annotations

import torch
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from .backends import KernelAttention, KernelRMSNorm, KernelRotary, KernelSwiGLU, PackedInt4Linear, PackedLinear
from .kv_cache import KVCache

_NONE = torch.empty(0)                      # an absent tensor (scales of a bf16 weight, a missing bias)


class FusedBlocks:
    """A model's layers as the flat list of tensors `packed_blocks` reads, gathered once."""

    def __init__(self, model):
        args = model.args
        self.modules = [m for layer in model.layers for m in layer.modules()]   # whose hooks the modules' way runs
        # each module's own hook dicts (torch adds to and removes from these same dicts), gathered once: checking
        # them is then one C-level pass, not a Python loop over some 300 modules
        self.hook_dicts = [d for m in self.modules for d in (m._forward_hooks, m._forward_pre_hooks)]
        self.shape = [args.n_heads, args.n_kv_heads, args.head_dim, args.hidden_dim]
        self.eps = args.norm_eps
        self.scale = args.head_dim ** -0.5                     # as KernelAttention's kernel is called from Python
        self.tensors = [t for layer in model.layers for t in _layer_tensors(layer)]
        wide = [m.wide_rows for m in self.modules if isinstance(m, PackedLinear) and m.wide is not None]
        self.max_rows = min(wide) - 1 if wide else None      # packed-amx: wider products go to oneDNN's copy

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                 mask: torch.Tensor | None) -> torch.Tensor:
        """x (B, T, D) through every block, keys and values written at the cache's slots [length, length + T)."""
        from ..kernels import cpu
        return cpu.load().packed_blocks(x, cos, sin, cache.k, cache.v, cache.length, mask, self.tensors,
                                        self.shape, self.eps, self.scale)                    # (B, T, D)

    def with_taps(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                  mask: torch.Tensor | None, taps: tuple[int, ...]) -> list[torch.Tensor]:
        """As calling it, and the outputs of blocks `taps` (ascending) too: [each tap's (B, T, D)..., the last's]."""
        from ..kernels import cpu
        return cpu.load().packed_blocks_taps(x, cos, sin, cache.k, cache.v, cache.length, mask, self.tensors,
                                             self.shape, self.eps, self.scale, list(taps))

    def applies(self, x: torch.Tensor, cache) -> bool:
        """Whether this forward can run fused: a plain KVCache in x's dtype, no gradient, no forward hook on any
        module of a layer (a hook expects its module to run), and on the packed-amx path fewer rows than go to
        oneDNN."""
        return (type(cache) is KVCache and cache.k.dtype == x.dtype and not x.requires_grad
                and (self.max_rows is None or x.shape[0] * x.shape[1] <= self.max_rows)
                and not (_global_forward_hooks or _global_forward_pre_hooks)
                and not any(self.hook_dicts))


def _layer_tensors(layer) -> list[torch.Tensor]:
    attn, mlp = layer.self_attn, layer.mlp
    out = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        scales = linear.scales if isinstance(linear, PackedInt4Linear) else _NONE
        out += [linear.packed, scales, _NONE if linear.bias is None else linear.bias]
    return out


def fusable(model) -> str | None:
    """None where every block of `model` can run fused; otherwise why not, in a few words."""
    from ..kernels import cpu
    if getattr(model, "forward_path", None) is None or model.forward_path.name not in ("packed", "packed-amx"):
        return "not on the packed path"
    args, dtype = model.args, model.embed_tokens.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16) or model.embed_tokens.weight.is_cuda:
        return f"activations in {dtype} on {model.embed_tokens.weight.device}"
    if args.head_dim not in cpu.HEAD_DIMS or args.head_dim % 32 or args.dim % 32 or args.hidden_dim % 32:
        return f"sizes the fused kernels do not take (head {args.head_dim}, width {args.dim}, MLP {args.hidden_dim})"
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        kinds = [type(layer.input_layernorm), type(layer.post_attention_layernorm), type(attn.rope), type(attn.core),
                 type(mlp.act)]
        if kinds != [KernelRMSNorm, KernelRMSNorm, KernelRotary, KernelAttention, KernelSwiGLU]:
            return "a layer whose modules are not the packed path's kernels"
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if type(linear) not in (PackedInt4Linear, PackedLinear):
                return f"linear layers of kind {type(linear).__name__}"
        if {layer.input_layernorm.eps, layer.post_attention_layernorm.eps} != {args.norm_eps}:
            return "norms of another eps than the model's"
    try:
        cpu.load()
    except cpu.KernelsUnavailable as e:
        return str(e)
    return None


def fused_blocks(model) -> FusedBlocks | None:
    """The model's FusedBlocks, built on first use on its current path; None where its blocks cannot run fused
    or `use_fused` turned them off."""
    path, fused = model.__dict__.get("_fused", (None, None))
    if path is not model.forward_path:
        fused = None if fusable(model) else FusedBlocks(model)
        model.__dict__["_fused"] = (model.forward_path, fused)
    return fused


def use_fused(model, on: bool = True) -> bool:
    """Run `model`'s blocks fused (True, where they can) or module by module (False); returns whether they now run
    fused. The output is the same either way."""
    model.__dict__.pop("_fused", None)
    if not on:
        model.__dict__["_fused"] = (model.forward_path, None)
    return fused_blocks(model) is not None
