"""Models seen through the interface a loop or a drafter expects: the targets that are not a plain model.

- `MTPVerifier`: a multi-token model as the chain loop's target; it returns head 1's logits and
  keeps every head's view per position, which the MTP drafters read (labkit.drafters.mtp).
- `MTPTreeTarget`: a Gloeckle model as the tree loop's target; its features are every head's
  hidden state side by side. `GloeckleHeads` reads heads 2..n out of such a feature, the way
  Medusa's heads read a hidden state, so Medusa's drafter fills its tree from them.
- `LayerTapsTarget`: labkit's Transformer as the tree loop's target with the outputs of three of
  its blocks as features (`layer_taps`), what an EAGLE-3 head fuses.
"""
from __future__ import annotations

import torch

from .fused import fused_blocks
from .kv_cache import KVCache
from .layers import rope_cos_sin
from .mtp import MTPModel
from .target import TreeTarget, Wrapped
from .transformer import Transformer, positions_and_mask


class MTPVerifier(Wrapped):
    """The speculative loop's target: an MTPModel forward that also keeps every head's view per position."""

    def __init__(self, model: MTPModel):
        if model.cfg.kind == "next":
            raise ValueError("a next-token-only model has no extra heads to draft with: train a gloeckle or "
                             "deepseek model (labkit.training.train_mtp)")
        self.model, cfg = model, model.cfg
        S, D, V = cfg.max_seq_len, cfg.dim, cfg.vocab_size
        self.head1_hidden = torch.zeros(S, D, device=model.device)                      # (S, D) by position
        n_parallel = cfg.n_future - 1 if cfg.kind == "gloeckle" else 0
        self.future_logits = torch.zeros(S, n_parallel, V, device=model.device)         # (S, n-1, V) Gloeckle heads 2..n

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, cache, positions=None, mask=None, num_logits: int | None = None):
        """Head 1's logits (1, T', V) for tokens (1, T); every head's output is kept at positions start..start+T."""
        if tokens.shape[0] != 1 or positions is not None or mask is not None:
            raise ValueError("self-speculative decoding runs one sequence (batch size 1) along a chain")
        start, T = cache.length, tokens.shape[1]
        hs = self.model.all_head_hidden(tokens, cache)                                  # n x (1, T, D)
        self.head1_hidden[start:start + T] = hs[0][0]
        if self.future_logits.shape[1]:
            self.future_logits[start:start + T] = torch.stack(
                [self.model.logits(h[0], j) for j, h in enumerate(hs) if j > 0], dim=1)  # (T, n-1, V)
        h1 = hs[0][:, -num_logits:] if num_logits is not None else hs[0]
        return self.model.logits(h1, 0)                                                 # (1, T', V)


def _require_gloeckle(model: MTPModel) -> None:
    if model.cfg.kind != "gloeckle":
        raise ValueError(f"tree drafting reads parallel heads (a gloeckle model), got kind {model.cfg.kind!r}: "
                         "a deepseek model's modules draft one after another (labkit.drafters.mtp."
                         "self_speculative), a next-token model has no heads to draft with")


class MTPTreeTarget(TreeTarget):
    """A Gloeckle model as the tree decoder's target: features = all n heads' hidden states, concatenated."""

    def __init__(self, model: MTPModel):
        _require_gloeckle(model)
        self.model, self.dim = model, model.cfg.dim
        self.feature_dim, self.feature_dtype = model.cfg.n_future * model.cfg.dim, model.embed_tokens.weight.dtype

    def features(self, tokens, cache, positions=None, mask=None):
        hs = self.model.all_head_hidden(tokens, cache, positions, mask)       # n x (1, T, D)
        return torch.cat(hs, dim=-1)[0]                                       # (T, n*D)

    def logits(self, features):
        return self.model.logits(features[:, :self.dim], 0)                  # (T, V): head 1, the next token


class GloeckleHeads:
    """Heads 2..n read out from one position's feature: what a MedusaDrafter fills its tree from."""

    def __init__(self, model: MTPModel):
        self.model, self.n_heads = model, model.cfg.n_future - 1
        self.dtype = model.lm_head.weight.dtype                               # the shared unembedding's

    def __call__(self, feature: torch.Tensor) -> torch.Tensor:
        """feature (n*D,) -> logits (n-1, V): row k scores the token k+1 after the root."""
        h = feature.view(self.n_heads + 1, -1)                                # (n, D)
        return torch.stack([self.model.logits(h[j], j) for j in range(1, self.n_heads + 1)])


def default_layers(n_layers: int) -> tuple[int, int, int]:
    """Low, middle and high block indices (0-based), as EAGLE-3's code picks them: 1, n/2 - 1, n - 4."""
    if n_layers < 5:
        raise ValueError(f"EAGLE-3 taps three distinct blocks below the last three: need >= 5 layers, got {n_layers}")
    return 1, n_layers // 2 - 1, n_layers - 4


def check_layers(layers, n_layers: int) -> tuple[int, int, int]:
    layers = tuple(int(i) for i in layers)
    if len(layers) != 3 or len(set(layers)) != 3 or any(not 0 <= i < n_layers for i in layers):
        raise ValueError(f"EAGLE-3 fuses three distinct blocks of the target's {n_layers} (0-based), e.g. "
                         f"{default_layers(n_layers) if n_layers >= 5 else (0, 1, 2)}; got {list(layers)}")
    return tuple(sorted(layers))


@torch.no_grad()
def layer_taps(model: Transformer, tokens: torch.Tensor, cache: KVCache, layers: tuple[int, ...],
               positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T, (len(layers) + 1) D): the outputs of blocks `layers` and the final normed hidden state, of tokens
    (B, T) after the cache (which advances); one forward of the target, on its own forward path."""
    positions, mask = positions_and_mask(tokens, cache, positions, mask)
    cos, sin = rope_cos_sin(positions, model.args.head_dim, model.args.rope_theta, model.embed_tokens.weight.dtype)
    x, taps = model.embed_tokens(tokens), []                                            # (B, T, D)
    fused = fused_blocks(model) if type(cache) is KVCache else None   # packed: one C++ call, the same bits
    if fused is not None and fused.applies(x, cache) and list(layers) == sorted(set(layers)):
        *taps, x = fused.with_taps(x, cos, sin, cache, mask, layers)
    else:
        for i, block in enumerate(model.layers):
            x = block(x, cos, sin, cache, i, mask)
            if i in layers:
                taps.append(x)
    cache.advance(tokens.shape[1])
    return torch.cat(taps + [model.norm(x)], dim=-1)


class LayerTapsTarget(TreeTarget):
    """labkit's Transformer for the tree loop, with features (T, 4D) = three blocks' outputs and the final one."""

    def __init__(self, model: Transformer, layers: tuple[int, ...]):
        self.model, self.layers = model, check_layers(layers, model.args.n_layers)
        self.feature_dim = (len(self.layers) + 1) * model.args.dim
        self.feature_dtype = model.embed_tokens.weight.dtype

    def features(self, tokens, cache, positions=None, mask=None):
        return layer_taps(self.model, tokens, cache, self.layers, positions, mask)[0]  # (T, 4D)

    def logits(self, features):
        return self.model.lm_head(features[..., -self.model.args.dim:]).float()         # (T, V)
