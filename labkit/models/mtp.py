"""Byte-level transformers with multi-token prediction: Gloeckle heads or DeepSeek-V3 modules.

All three kinds share one next-token path: embedding -> trunk (`n_trunk` blocks) -> head 1 (one
block) -> RMSNorm -> unembedding. They differ in what else predicts the tokens after it:
  - "next":     nothing (the baseline).
  - "gloeckle": Gloeckle et al. 2024, "Better & Faster Large Language Models via Multi-token
                Prediction": heads 2..n, each one more block on the trunk's output, in parallel;
                head j at position i predicts token i+j. One unembedding shared by all heads.
  - "deepseek": DeepSeek-V3 (2024) MTP modules, sequential: module k at position i mixes the
                RMSNorm'd depth-(k-1) hidden state with the RMSNorm'd embedding of token i+k
                (a projection of the two, concatenated), runs one block and predicts token i+k+1,
                so drafted tokens keep their causal chain. Embedding and unembedding shared.
Blocks are labkit.models.layers' (RMSNorm, RoPE, SwiGLU); the trunk and the heads share one KVCache
(heads are layers n_trunk..); each DeepSeek module keeps its own, since module k at position i
needs token i+k and so trails the trunk by k positions.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .backends import ForwardPath
from .kv_cache import KVCache
from .layers import RMSNorm, rope_cos_sin
from .transformer import Block, ModelArgs, chain_mask

KINDS = ("next", "gloeckle", "deepseek")


@dataclass
class MTPConfig:
    kind: str = "next"
    n_future: int = 1              # tokens predicted per position: 1 (next), n heads (gloeckle), depth + 1 (deepseek)
    vocab_size: int = 256          # bytes
    dim: int = 192
    n_trunk: int = 4
    n_heads: int = 6
    hidden_dim: int = 512
    max_seq_len: int = 256
    mtp_weight: float = 1.0        # weight of each extra head's loss (Gloeckle: 1; DeepSeek-V3: lambda / depth)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "next" and self.n_future != 1:
            raise ValueError(f"a next-token model predicts 1 token per position, got n_future={self.n_future}")
        if self.kind != "next" and self.n_future < 2:
            raise ValueError(f"a {self.kind} model needs n_future >= 2, got {self.n_future}")

    @property
    def block_args(self) -> ModelArgs:
        return ModelArgs(vocab_size=self.vocab_size, dim=self.dim, n_layers=self.n_trunk, n_heads=self.n_heads,
                         n_kv_heads=self.n_heads, hidden_dim=self.hidden_dim, max_seq_len=self.max_seq_len)

    @property
    def n_head_blocks(self) -> int:
        """Blocks after the trunk in the shared cache: n parallel heads, or the one next-token head."""
        return self.n_future if self.kind == "gloeckle" else 1

    def to_dict(self) -> dict:
        return asdict(self)


class Rope(NamedTuple):
    """Positions of the tokens being fed: RoPE tables and the attention mask, shared by every block."""
    cos: torch.Tensor              # (B, 1, T, hd)
    sin: torch.Tensor              # (B, 1, T, hd)
    mask: torch.Tensor | None      # (T, S) bool, None for a single token


class PassThroughCache:
    """The cache interface for training on whole windows: keeps nothing, so autograd sees plain tensors."""
    length, max_len = 0, 1 << 30

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        return k_new, v_new

    def advance(self, n_tokens: int) -> None:
        pass


class DeepSeekModule(nn.Module):
    """h_k(i) = Block(W [RMSNorm(h_{k-1}(i)); RMSNorm(Emb(t_{i+k}))])."""

    def __init__(self, cfg: MTPConfig):
        super().__init__()
        args = cfg.block_args
        self.norm_hidden, self.norm_embed = RMSNorm(cfg.dim, args.norm_eps), RMSNorm(cfg.dim, args.norm_eps)
        self.proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = Block(args)

    def forward(self, h_prev: torch.Tensor, e_next: torch.Tensor, rope: Rope, cache) -> torch.Tensor:
        """h_prev, e_next: (B, T, D) -> (B, T, D)."""
        x = self.proj(torch.cat([self.norm_hidden(h_prev), self.norm_embed(e_next)], dim=-1))  # (B, T, D)
        return self.block(x, rope.cos, rope.sin, cache, 0, rope.mask)


class MTPModel(nn.Module):
    def __init__(self, cfg: MTPConfig):
        super().__init__()
        self.cfg, args = cfg, cfg.block_args
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.trunk = nn.ModuleList(Block(args) for _ in range(cfg.n_trunk))
        self.heads = nn.ModuleList(Block(args) for _ in range(cfg.n_head_blocks))
        self.head_norms = nn.ModuleList(RMSNorm(cfg.dim, args.norm_eps) for _ in range(cfg.n_head_blocks))
        n_modules = cfg.n_future - 1 if cfg.kind == "deepseek" else 0
        self.mtp_modules = nn.ModuleList(DeepSeekModule(cfg) for _ in range(n_modules))
        self.module_norms = nn.ModuleList(RMSNorm(cfg.dim, args.norm_eps) for _ in range(n_modules))
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)     # the one unembedding
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    # --- the interface labkit's decoders use (same as labkit.models.transformer.Transformer) ---
    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.cfg.max_seq_len

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def path(self) -> ForwardPath:
        """The forward path (labkit.models.backends): the reference one, at the weights' precision."""
        return ForwardPath().filled(self.embed_tokens.weight)

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        """Trunk + head blocks, one cache (a DeepSeek module's cache: `new_module_cache`)."""
        return self._cache(self.cfg.n_trunk + self.cfg.n_head_blocks, batch_size, max_len)

    def new_module_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        return self._cache(1, batch_size, max_len)

    def _cache(self, n_layers: int, batch_size: int, max_len: int | None) -> KVCache:
        p, a = self.embed_tokens.weight, self.cfg.block_args
        return KVCache(n_layers, batch_size, a.n_kv_heads, max_len or self.cfg.max_seq_len, a.head_dim, p.dtype, p.device)

    def forward(self, tokens: torch.Tensor, cache, positions=None, mask=None, num_logits: int | None = None):
        """Next-token logits (B, T', V) of `tokens` (B, T) after the cache: trunk + head 1, what AR decoding runs.

        positions (B, T) and mask (T, S) as in labkit.models.transformer.Transformer.hidden (a tree passes both).
        """
        rope = self.rope(cache.length, tokens.shape[1], tokens.shape[0], positions, mask)
        h = self.head_hidden(0, self.trunk_hidden(tokens, cache, rope), cache, rope)    # (B, T, D): head 1 only
        cache.advance(tokens.shape[1])
        if num_logits is not None:
            h = h[:, -num_logits:]
        return self.logits(h, 0)

    # --- the pieces: trunk, heads, modules ---
    def rope(self, n_cached: int, T: int, B: int = 1, positions: torch.Tensor | None = None,
             mask: torch.Tensor | None = None) -> Rope:
        """Defaults: the T tokens follow the cache in a chain; a tree gives its positions (B, T) and mask (T, S)."""
        if positions is None:
            positions = (n_cached + torch.arange(T, device=self.device)).expand(B, T)     # (B, T)
        if mask is None and T > 1:
            mask = chain_mask(n_cached, T, self.device)                                # (T, S)
        cos, sin = rope_cos_sin(positions, self.cfg.block_args.head_dim, 10000.0, self.embed_tokens.weight.dtype)
        return Rope(cos, sin, mask)

    def trunk_hidden(self, tokens: torch.Tensor, cache, rope: Rope) -> torch.Tensor:
        """Trunk output z (B, T, D); the caller advances the cache once every head has written too."""
        if cache.length + tokens.shape[1] > cache.max_len:
            raise ValueError(f"{cache.length} cached + {tokens.shape[1]} new tokens exceed the context of {cache.max_len}")
        x = self.embed_tokens(tokens)                                         # (B, T, D)
        for i, block in enumerate(self.trunk):
            x = block(x, rope.cos, rope.sin, cache, i, rope.mask)
        return x

    def head_hidden(self, j: int, z: torch.Tensor, cache, rope: Rope) -> torch.Tensor:
        """Head j's block on the trunk output (0: next token; Gloeckle j: token i+j+1), (B, T, D)."""
        return self.heads[j](z, rope.cos, rope.sin, cache, self.cfg.n_trunk + j, rope.mask)

    def logits(self, h: torch.Tensor, j: int) -> torch.Tensor:
        """Head j's hidden (B, T, D) -> logits (B, T, V) through its norm and the shared unembedding."""
        return self.lm_head(self.head_norms[j](h)).float()

    def module_logits(self, k: int, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.module_norms[k](h)).float()

    def all_head_hidden(self, tokens: torch.Tensor, cache, positions: torch.Tensor | None = None,
                        mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Every head's hidden state [(B, T, D)] for tokens after the cache, which then advances."""
        rope = self.rope(cache.length, tokens.shape[1], tokens.shape[0], positions, mask)
        z = self.trunk_hidden(tokens, cache, rope)                            # (B, T, D)
        hs = [self.head_hidden(j, z, cache, rope) for j in range(self.cfg.n_head_blocks)]
        cache.advance(tokens.shape[1])
        return hs

    def module_hidden(self, k: int, h_prev: torch.Tensor, next_tokens: torch.Tensor, cache) -> torch.Tensor:
        """DeepSeek module k (0-based): depth-k hidden states (B, T, D) at the positions after its cache."""
        rope = self.rope(cache.length, next_tokens.shape[1], next_tokens.shape[0])
        h = self.mtp_modules[k](h_prev, self.embed_tokens(next_tokens), rope, cache)
        cache.advance(next_tokens.shape[1])
        return h

    def training_logits(self, window: torch.Tensor, T: int) -> list[torch.Tensor]:
        """Logits [(B, T, V)] of every predicted offset for the first T positions of `window` (B, T + n).

        Entry j predicts window[:, j+1 : j+1+T]. The naive way: all n logits alive at once.
        """
        x = window[:, :T]                                                     # (B, T)
        hs = self.all_head_hidden(x, PassThroughCache())
        out = [self.logits(h, j) for j, h in enumerate(hs)]
        h = hs[0]
        for k in range(len(self.mtp_modules)):
            h = self.module_hidden(k, h, window[:, k + 1:k + 1 + T], PassThroughCache())
            out.append(self.module_logits(k, h))
        return out

    def loss_weights(self) -> list[float]:
        return [1.0] + [self.cfg.mtp_weight] * (self.cfg.n_future - 1)


def mtp_window_targets(window: torch.Tensor, T: int, j: int) -> torch.Tensor:
    """Targets (B, T) of offset j (0: next token): window[:, j+1 : j+1+T]."""
    return window[:, j + 1:j + 1 + T]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy in nats; logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def head_topk_accuracy(model: MTPModel, windows: torch.Tensor, T: int, k: int = 8) -> torch.Tensor:
    """(n, k) teacher-forced top-1..top-k accuracy of every offset's head on windows (N, T + n); row 0: head 1."""
    logits = model.training_logits(windows, T)
    rows = []
    for j, lg in enumerate(logits):
        hit = lg.topk(k, dim=-1).indices == mtp_window_targets(windows, T, j)[..., None]   # (N, T, k)
        rows.append(hit.cumsum(-1).clamp(max=1).float().mean((0, 1)))                    # (k,)
    return torch.stack(rows)
