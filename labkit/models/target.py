"""What the decoding loops verify with: the `Target` protocol, and the tree loop's `TreeTarget`.

Every decoder is annotated with `Target`: a model with a vocabulary, a context length, a device,
a fresh KV cache per sequence, and a forward that takes token ids (B, T) after the cache (which
advances) and returns next-token logits. labkit's `Transformer` and `MTPModel` are targets, and
so is a transformers model behind `loading.HFCausalLM`; a wrapper that adds something to a model
(`Wrapped`) delegates the four facts to it once, here.

The tree loop needs more: explicit positions and masks, and the features the drafter reads per
position (`TreeTarget`). labkit's Transformer is one whose features are its final normed hidden
states (`NativeTreeTarget`); a multi-token model's are every head's hidden state
(`labkit.models.adapters.MTPTreeTarget`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol, runtime_checkable

import torch

from .kv_cache import KVCache
from .transformer import Transformer


@runtime_checkable
class Target(Protocol):
    vocab_size: int
    max_seq_len: int
    device: torch.device

    def new_cache(self) -> KVCache:
        """An empty KV cache for one sequence."""

    def __call__(self, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None, num_logits: int | None = None) -> torch.Tensor:
        """Logits (B, T', V) for tokens (B, T) after the cache (which advances); the last num_logits rows."""


class Wrapped:
    """A target wrapping `self.model`: the vocabulary, context, device and cache are the model's."""
    model: torch.nn.Module

    vocab_size = property(lambda self: self.model.vocab_size)
    max_seq_len = property(lambda self: self.model.max_seq_len)
    device = property(lambda self: self.model.device)

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        return self.model.new_cache(batch_size, max_len)


class TreeTarget(Wrapped, ABC):
    """What the tree loop verifies with: per-position features, and the next-token logits they give."""
    feature_dim: int
    feature_dtype: torch.dtype

    @abstractmethod
    def features(self, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        """Features (T, F) of tokens (1, T) after the cache, which advances; positions/mask as for a tree."""

    @abstractmethod
    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Next-token logits (T, V) from features (T, F)."""


class NativeTreeTarget(TreeTarget):
    """labkit's Transformer as a tree target: its features are its final normed hidden states."""

    def __init__(self, model: Transformer):
        self.model, self.feature_dim = model, model.args.dim
        self.feature_dtype = model.embed_tokens.weight.dtype

    def features(self, tokens, cache, positions=None, mask=None):
        return self.model.hidden(tokens, cache, positions, mask)[0]                     # (T, D)

    def logits(self, features):
        return self.model.lm_head(features).float()                                     # (T, V)


def as_tree_target(target: Transformer | TreeTarget) -> TreeTarget:
    if isinstance(target, TreeTarget):
        return target
    if not isinstance(target, Transformer):
        raise TypeError("tree decoding needs labkit's native model (explicit tree mask and positions, hidden "
                        "states for the drafter): load the target with backend='native', or wrap another model "
                        "in a TreeTarget (labkit.models.target) as labkit.drafters.mtp_tree does")
    return NativeTreeTarget(target)
