"""A readable Llama / Qwen2-family decoder: RMSNorm, RoPE, GQA, SwiGLU, optional qkv bias.

Built bottom-up like nanoGPT's model.py. Two things make it fit speculative decoding:
the KV cache is an explicit argument (see kv_cache.py), and `forward` takes explicit position
ids and an explicit attention mask, so a chain of draft tokens and a tree of them (a later
issue) verify through the same code. Weights load from transformers checkpoints (q/k/v and
gate/up fused into one matmul each on load); tests check the logits against transformers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .backends import ForwardPath
from .fused import fused_blocks
from .kv_cache import KVCache
from .layers import RMSNorm, Rotary, SDPAttention, SwiGLU, rope_cos_sin

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


@dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int                 # SwiGLU inner width
    head_dim: int = 0               # derived from dim / n_heads when 0
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qkv_bias: bool = False          # Qwen2 has it, Llama does not (unless attention_bias)
    o_bias: bool = False            # Llama with attention_bias
    tie_embeddings: bool = False
    max_seq_len: int = 4096

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        """Map a transformers config.json (Llama or Qwen2 family) onto ModelArgs."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(f"native model covers {SUPPORTED_MODEL_TYPES}, not {model_type!r}; "
                                      "load it with backend='hf' instead")
        if cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {}).get("rope_type", "default") != "default":
            raise NotImplementedError("native model implements plain RoPE only; load this model with backend='hf'")
        if cfg.get("mlp_bias"):
            raise NotImplementedError("native model has no MLP biases; load this model with backend='hf'")
        rope = cfg.get("rope_parameters") or {}
        if missing := [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "intermediate_size") if not isinstance(cfg.get(k), int) or cfg[k] < 1]:
            raise ValueError(f"the model's config.json has no usable {', '.join(missing)} (a {model_type} config "
                             "gives each as a positive integer): restore config.json from the model's source")
        return cls(
            vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"],
            n_heads=cfg["num_attention_heads"],
            n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            hidden_dim=cfg["intermediate_size"], head_dim=cfg.get("head_dim") or 0,
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            qkv_bias=model_type == "qwen2" or cfg.get("attention_bias", False),
            o_bias=model_type == "llama" and cfg.get("attention_bias", False),
            tie_embeddings=cfg.get("tie_word_embeddings", False),
            max_seq_len=cfg.get("max_position_embeddings", 4096),
        )


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, in_dim: int | None = None):
        """in_dim: the width of the input q, k and v are projected from (default args.dim; EAGLE-3's layer: 2 dim)."""
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        # q, k and v in one matmul (gpt-fast's wqkv): one weight read, one call instead of three
        self.qkv_proj = nn.Linear(in_dim or args.dim, (args.n_heads + 2 * args.n_kv_heads) * args.head_dim,
                                  bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.o_bias)
        self.rope = Rotary()
        self.core = SDPAttention()      # softmax(q k^T / sqrt(hd)) v; a forward path may swap in its own kernel

    def forward(self, x, cos, sin, cache: KVCache, layer: int, mask: torch.Tensor | None):
        B, T, _ = x.shape
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)                  # (B, H, T, hd)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)               # (B, Hkv, T, hd)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)               # (B, Hkv, T, hd)
        q, k = self.rope(q, k, cos, sin)
        k_all, v_all = cache.write(layer, k, v)                                         # (B, Hkv, S, hd)
        # grouped-query attention: each K/V head serves H / Hkv query heads, read in place (no repeated copy)
        y = self.core(q, k_all, v_all, mask)                                            # (B, H, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = nn.Linear(args.dim, 2 * args.hidden_dim, bias=False)       # gate and up, one matmul
        self.act = SwiGLU()
        self.down_proj = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def fuse_hf_weights(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """transformers' names (model.layers.i.self_attn.q_proj.weight, ...) -> ours, q/k/v and gate/up concatenated.

    dtype: write every tensor once, as a fresh copy in this precision (the fused ones straight from their
    parts, which may still lie on a file's memory map); None keeps the parts' precision."""
    state, fused = {k.removeprefix("model."): v for k, v in state.items()}, set()

    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        out = torch.empty(sum(p.shape[0] for p in parts), *parts[0].shape[1:], dtype=dtype or parts[0].dtype)
        return torch.cat(parts, 0, out=out)                                  # converted while copied, once

    for key in [k for k in state if ".self_attn.q_proj." in k]:
        prefix, kind = key.split(".self_attn.q_proj.")
        parts = [state.pop(f"{prefix}.self_attn.{n}_proj.{kind}") for n in "qkv"]
        state[f"{prefix}.self_attn.qkv_proj.{kind}"] = cat(parts)
        fused.add(f"{prefix}.self_attn.qkv_proj.{kind}")
    for key in [k for k in state if ".mlp.gate_proj." in k]:
        prefix = key.split(".mlp.gate_proj.")[0]
        gate, up = state.pop(key), state.pop(f"{prefix}.mlp.up_proj.weight")
        state[f"{prefix}.mlp.gate_up_proj.weight"] = cat([gate, up])
        fused.add(f"{prefix}.mlp.gate_up_proj.weight")
    return state if dtype is None else {k: v if k in fused else v.to(dtype, copy=True) for k, v in state.items()}


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, cos, sin, cache, layer, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def chain_mask(n_cached: int, n_new: int, device=None) -> torch.Tensor:
    """Causal mask (T, S) for T new tokens after `n_cached` cached ones: token i sees slots <= n_cached+i."""
    slots = torch.arange(n_cached + n_new, device=device)
    return slots[None, :] <= (n_cached + torch.arange(n_new, device=device))[:, None]


def positions_and_mask(tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor | None,
                       mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The defaults of a forward of tokens (B, T) after the cache: positions cache.length + arange(T), a causal
    mask (None for one token, which sees everything); a clear error when the cache has no room for them."""
    B, T = tokens.shape
    if cache.length + T > cache.max_len:
        raise ValueError(f"{cache.length} cached + {T} new tokens exceed the context of {cache.max_len}")
    if positions is None:
        positions = (cache.length + torch.arange(T, device=tokens.device)).expand(B, T)
    if mask is None and T > 1:
        mask = chain_mask(cache.length, T, tokens.device)
    return positions, mask


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        weight = torch.empty(args.vocab_size, args.dim)      # on the default device: "meta" when a checkpoint fills it
        if weight.device.type != "meta":                     # nn.Embedding's own init; on meta torch spends seconds
            nn.init.normal_(weight)                          # drawing a (V, D) normal it then throws away
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim, _weight=weight)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.forward_path = ForwardPath()   # which kernels run it (backends.apply_path swaps them)

    @property
    def path(self) -> ForwardPath:
        """The kernels and weight precision this model's forward runs with (see backends.py)."""
        return self.forward_path.filled(self.embed_tokens.weight)

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.args.max_seq_len

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        """An empty cache for `batch_size` sequences of up to `max_len` tokens (default: the context)."""
        p = self.embed_tokens.weight
        return KVCache(self.args.n_layers, batch_size, self.args.n_kv_heads, max_len or self.args.max_seq_len,
                       self.args.head_dim, p.dtype, p.device)

    def hidden(self, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor | None = None,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """Final normed hidden states (B, T, D) of `tokens` (B, T) appended after the cache.

        positions: (B, T) RoPE positions, default cache.length + arange(T) (a tree passes depths).
        mask: bool (T, S) or (B, 1, T, S) over the S = cache.length + T slots, default causal.
        """
        positions, mask = positions_and_mask(tokens, cache, positions, mask)
        h = self.blocks(tokens, cache, positions, mask)                                 # (B, T, D)
        cache.advance(tokens.shape[1])
        return h

    def blocks(self, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor,
               mask: torch.Tensor | None, run_block=None) -> torch.Tensor:
        """The layers alone: embed, every block (each writes its keys/values to `cache`), final norm.

        No defaults and no bookkeeping: `hidden` adds those; the static, compiled decode path
        (decoding/static.py) calls this with position and mask tensors of fixed shape, and may pass
        `run_block(block, x, cos, sin, cache, layer, mask)` to run each block its own way (compiled once).
        """
        cos, sin = rope_cos_sin(positions, self.args.head_dim, self.args.rope_theta, self.embed_tokens.weight.dtype)
        x = self.embed_tokens(tokens)                                                   # (B, T, D)
        fused = fused_blocks(self) if run_block is None and type(cache) is KVCache else None   # packed: one C++ call
        if fused is not None and fused.applies(x, cache):
            return self.norm(fused(x, cos, sin, cache, mask))
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, mask) if run_block is None else run_block(layer, x, cos, sin, cache, i, mask)
        return self.norm(x)

    def forward(self, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, num_logits: int | None = None) -> torch.Tensor:
        """Logits (B, T', V) for the last `num_logits` of the T new tokens (all when None)."""
        h = self.hidden(tokens, cache, positions, mask)                                 # (B, T, D)
        if num_logits is not None:
            # standard strides: a CPU bf16 matmul of a (B, n, D) slice with the batch stride of (B, T, D) falls off
            # torch's fast path
            h = h[:, -num_logits:].clone(memory_format=torch.contiguous_format)
        return self.lm_head(h).float()                                                  # (B, T', V)

    @torch.no_grad()
    def init_random(self, std: float = 0.02, seed: int = 0) -> "Transformer":
        """Random weights, for the tiny test models."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
        return self


def _swapped(model: nn.Module) -> list[nn.Module]:
    """The linear layers a forward path swapped in (backends.py): they hold their weights as buffers."""
    found = [m for m in model.modules() if hasattr(m, "weight_stats")]
    inner = {id(m.wide) for m in found if getattr(m, "wide", None) is not None}     # packed-amx's second copy
    return [m for m in found if id(m) not in inner]


def _tied_and_swapped(model: nn.Module) -> bool:
    head = getattr(model, "lm_head", None)
    return bool(getattr(getattr(model, "args", None), "tie_embeddings", False)) and hasattr(head, "weight_stats")


def count_params(model: nn.Module) -> int:
    """Parameters, on any forward path (a tied LM head counted once)."""
    n = sum(p.numel() for p in model.parameters()) + sum(m.weight_stats()[0] for m in _swapped(model))
    return n - (model.lm_head.weight_stats()[0] if _tied_and_swapped(model) else 0)


def weight_bytes(model: nn.Module) -> int:
    """Bytes read per decode step to stream every weight once (tied weights counted once), on any path."""
    n = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(m.weight_stats()[1] for m in _swapped(model))
    if _tied_and_swapped(model):    # the LM head streams its own (packed) copy; the embedding only looks rows up
        n -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return n
