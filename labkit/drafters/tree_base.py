"""The interface of drafters that propose a *tree* of tokens (Medusa, EAGLE) instead of a chain.

A tree drafter sees what a chain drafter sees (the committed token ids) plus the target's own
features: the final normed hidden state of every position in the target's cache. The loop
(`labkit.tree_decoding.TreeDecoder`) keeps one invariant: the target's cache holds every
committed token but the last, and the drafter has been given the features of exactly those
positions, in order (`start` gets the prompt's, `extend` the new ones after each step).

A proposal is a parent vector plus one token per node. The root of the tree is the last
committed token (not a node); nodes whose parent is -1 are candidates for the token after it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..sampling import SamplingConfig
from ..tree import Tree
from .base import Drafter


@dataclass
class TreeProposal:
    tokens: torch.Tensor                  # (N,) token of each node
    tree: Tree                            # parents (N,), parents[i] < i, -1 under the root
    q_draft: torch.Tensor | None = None   # (N, V) distribution node i was drawn from; None: chosen deterministically
    score: torch.Tensor | None = None     # (N,) the drafter's confidence in each node (for plots), optional

    def __post_init__(self):
        if self.tokens.shape != self.tree.parents.shape:
            raise ValueError(f"{self.tokens.numel()} tokens for a tree of {self.tree.n_nodes} nodes")

    @property
    def n_nodes(self) -> int:
        return self.tokens.numel()

    def limit(self, n: int) -> "TreeProposal":
        """The first n nodes (still a tree: parents come before children)."""
        if n >= self.n_nodes:
            return self
        pick = lambda t: None if t is None else t[:n]
        return TreeProposal(self.tokens[:n], Tree(self.tree.parents[:n]), pick(self.q_draft), pick(self.score))


class TreeDrafter(ABC):
    name: str = "tree-drafter"

    def check_target(self, target) -> None:
        """Raise ValueError, saying what to do, when this drafter cannot draft for `target`."""

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor) -> None:
        """A new sequence: `prompt_ids` (T,), `features` (T-1, D) of the prompt's cached positions."""

    def extend(self, features: torch.Tensor) -> None:
        """The features (m, D) of the positions the last step added to the target's cache."""

    @abstractmethod
    def propose(self, tokens: torch.Tensor, budget: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> TreeProposal:
        """A tree of at most `budget` nodes to follow `tokens` (N,), the committed sequence."""


class TreeTarget(ABC):
    """What the tree decoder verifies with: what its drafter reads per position (`features`) and how
    the target's next-token logits follow from them. labkit's Transformer is wrapped as one whose
    features are its final hidden states (`labkit.tree_decoding.NativeTreeTarget`); a multi-token
    model's are every head's hidden state, so the heads' drafts for the next step come from the last
    accepted node (`labkit.drafters.mtp_tree`).
    """
    model: torch.nn.Module         # the wrapped model: the context, vocabulary, device and cache are its
    feature_dim: int
    feature_dtype: torch.dtype

    vocab_size = property(lambda self: self.model.vocab_size)
    max_seq_len = property(lambda self: self.model.max_seq_len)
    device = property(lambda self: self.model.device)

    def new_cache(self):
        """An empty KV cache for one sequence."""
        return self.model.new_cache()

    @abstractmethod
    def features(self, tokens: torch.Tensor, cache, positions: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        """Features (T, F) of tokens (1, T) after the cache, which advances; positions/mask as for a tree."""

    @abstractmethod
    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Next-token logits (T, V) from features (T, F)."""


class ChainAsTree(TreeDrafter):
    """Any chain drafter (a draft model, prompt lookup) as a tree drafter whose tree is a chain."""

    def __init__(self, drafter: Drafter):
        self.drafter, self.name = drafter, drafter.name

    def check_target(self, target):
        self.drafter.check_target(target)

    def start(self, prompt_ids, features):
        self.drafter.start(prompt_ids)

    def propose(self, tokens, budget, sampling, generator=None):
        self.drafter.rollback(tokens.numel() - 1)   # its cache slots past the committed-but-last tokens are stale
        p = self.drafter.propose(tokens, budget, sampling, generator)
        return TreeProposal(p.tokens, Tree.chain(p.tokens.numel()), p.q_draft, p.q_token)
