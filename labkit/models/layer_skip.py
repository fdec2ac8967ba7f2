"""The target with some of its layers skipped: a cheaper model that shares every weight with it.

Self-speculative decoding by layer skipping (Draft & Verify, Zhang et al. 2024; SWIFT, Xia et
al. 2025) drafts with the target itself, minus a set of its transformer blocks: the residual
stream simply passes a skipped block by. No second model is loaded; the embedding, the kept
blocks, the final norm and the LM head are the target's own tensors. The skipped model keeps
its own KV cache, one layer per kept block.
"""
from __future__ import annotations

import torch

from .kv_cache import KVCache
from .layers import rope_cos_sin
from .transformer import Transformer, positions_and_mask


class LayerSkipModel:
    """`target` running only the blocks not in `skip`; a Target (vocab, context, device, cache, forward)."""

    def __init__(self, target: Transformer, skip: tuple[int, ...] | list[int]):
        n = target.args.n_layers
        skip = sorted(set(int(i) for i in skip))
        if any(not 0 <= i < n for i in skip):
            raise ValueError(f"layers to skip must lie in [0, {n}) for a {n}-layer target, got {skip}")
        if len(skip) >= n:
            raise ValueError(f"skipping all {n} layers leaves no model: keep at least one")
        self.target, self.skip = target, tuple(skip)
        self.keep = [i for i in range(n) if i not in self.skip]

    vocab_size = property(lambda self: self.target.vocab_size)
    max_seq_len = property(lambda self: self.target.max_seq_len)
    device = property(lambda self: self.target.device)

    @property
    def layer_fraction(self) -> float:
        """Kept blocks / all blocks (the LM head runs either way)."""
        return len(self.keep) / self.target.args.n_layers

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        a, p = self.target.args, self.target.embed_tokens.weight
        return KVCache(len(self.keep), batch_size, a.n_kv_heads, max_len or a.max_seq_len, a.head_dim, p.dtype,
                       p.device)

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None, num_logits: int | None = None) -> torch.Tensor:
        """Logits (B, T', V) of tokens (B, T) after the cache, through the kept blocks only."""
        t, T = self.target, tokens.shape[1]
        positions, mask = positions_and_mask(tokens, cache, positions, mask)
        cos, sin = rope_cos_sin(positions, t.args.head_dim, t.args.rope_theta, t.embed_tokens.weight.dtype)
        x = t.embed_tokens(tokens)                                                        # (B, T, D)
        for slot, i in enumerate(self.keep):
            x = t.layers[i](x, cos, sin, cache, slot, mask)                               # cache layer = slot
        cache.advance(T)
        h = t.norm(x)                                                                     # (B, T, D)
        if num_logits is not None:
            h = h[:, -num_logits:].clone(memory_format=torch.contiguous_format)
        return t.lm_head(h).float()                                                       # (B, T', V)
