"""A token tree as a vector of parent indices, and what verifying it needs: mask, positions, paths.

SpecInfer, Medusa and EAGLE verify many candidate continuations in one target forward by laying
them out as a tree: node i holds one token and `parents[i]` is the node before it (-1: the
tree's root, which is the last committed token and not a node itself). Nodes are ordered so
that parents[i] < i; a chain of k tokens is parents = [-1, 0, 1, ..., k-2].

Everything the verifier needs follows from `parents` with tensor ops:
  - the ancestor mask (N, N): node i attends to node j iff j is i or an ancestor of i;
  - depth (N,): 1 for the root's children; a node's RoPE position is root position + depth;
  - paths: for each leaf, its root-to-leaf node indices (the candidate sequences).
Medusa's static "choices" (top-k index paths such as (0,), (0, 1), (1,)) convert once.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True, eq=False)
class Tree:
    parents: torch.Tensor                      # (N,) long, parents[i] in [-1, i)

    def __post_init__(self):
        parents = torch.as_tensor(self.parents).long().cpu()
        if parents.dim() != 1:
            raise ValueError(f"parents must be a 1-D vector of parent indices, got shape {tuple(parents.shape)}")
        idx = torch.arange(parents.numel())
        bad = (parents >= idx) | (parents < -1)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"parents[{i}] = {int(parents[i])}: each parent must be -1 (the root) or an earlier "
                             "node; order the nodes so that parents come before their children")
        object.__setattr__(self, "parents", parents)

    # --- constructors ---------------------------------------------------------------------------
    @classmethod
    def chain(cls, n: int) -> "Tree":
        """n tokens one after the other: the tree of ordinary (chain) speculative decoding."""
        return cls(torch.arange(n) - 1)

    @classmethod
    def from_choices(cls, choices: list[tuple[int, ...]], keep_order: bool = False) -> tuple["Tree", torch.Tensor]:
        """Medusa's choices -> (tree, rank (N,)): node i is the rank[i]-th best token of head depth[i]-1.

        A choice is a path of top-k ranks from the root, e.g. (0, 2) = the best token of head 0, then
        the third best of head 1. Every prefix of a choice must be a choice too. Nodes are sorted by
        depth, or, with keep_order, kept in the given order (each path's prefix must come before it).
        """
        unique = list(dict.fromkeys(tuple(c) for c in choices))
        ordered = unique if keep_order else sorted(unique, key=lambda c: (len(c), c))
        if not ordered or any(len(c) == 0 for c in ordered):
            raise ValueError("choices must be a non-empty list of non-empty tuples of top-k ranks, e.g. [(0,), (0, 0)]")
        index = {c: i for i, c in enumerate(ordered)}
        missing = [c[:-1] for c in ordered if len(c) > 1 and c[:-1] not in index]
        if missing:
            raise ValueError(f"choice prefix {missing[0]} is missing: every prefix of a path must be in the tree")
        late = [c for i, c in enumerate(ordered) if len(c) > 1 and index[c[:-1]] > i]
        if late:
            raise ValueError(f"choice {late[0]} comes before its prefix {late[0][:-1]}: with keep_order, list "
                             "every path after its prefix")
        parents = torch.tensor([index[c[:-1]] if len(c) > 1 else -1 for c in ordered])
        rank = torch.tensor([c[-1] for c in ordered])
        return cls(parents), rank

    # --- derived tensors ------------------------------------------------------------------------
    @property
    def n_nodes(self) -> int:
        return self.parents.numel()

    @cached_property
    def mask(self) -> torch.Tensor:
        """(N, N) bool ancestor mask, the diagonal included: transitive closure by repeated squaring."""
        N = self.n_nodes
        idx = torch.arange(N)
        reach = torch.eye(N, dtype=torch.bool)                                      # (N, N)
        has_parent = self.parents >= 0
        reach[idx[has_parent], self.parents[has_parent]] = True                    # i -> parent(i)
        for _ in range(max(1, N).bit_length()):                                    # paths of length 2^k
            reach = (reach.float() @ reach.float()) > 0                             # (N, N)
        return reach

    @cached_property
    def depth(self) -> torch.Tensor:
        """(N,) 1 for the root's children, 2 for theirs, ...: the number of ancestors, self included."""
        return self.mask.sum(1)

    def positions(self, root_position: int) -> torch.Tensor:
        """(N,) RoPE positions of the nodes when the root sits at `root_position`."""
        return root_position + self.depth

    @cached_property
    def is_leaf(self) -> torch.Tensor:
        """(N,) bool: no node has it as parent."""
        leaf = torch.ones(self.n_nodes, dtype=torch.bool)
        leaf[self.parents[self.parents >= 0]] = False
        return leaf

    @cached_property
    def paths(self) -> torch.Tensor:
        """(n_leaves, max_depth) node indices root to leaf, padded with -1 after the leaf."""
        leaves = self.is_leaf.nonzero()[:, 0]                                       # (n_leaves,)
        on_path = self.mask[leaves]                                                 # (n_leaves, N)
        depth = torch.where(on_path, self.depth, 0)                                 # (n_leaves, N)
        max_depth = int(self.depth.max()) if self.n_nodes else 0
        paths = torch.full((leaves.numel(), max_depth + 1), -1)                    # column 0 is a dump slot
        paths.scatter_(1, depth, torch.arange(self.n_nodes).expand_as(depth))      # node j -> column depth[j]
        return paths[:, 1:]

    def paths_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node`, in order."""
        ancestors = self.mask[node].nonzero()[:, 0]                                 # (depth,)
        return ancestors[self.depth[ancestors].argsort()].tolist()

    def children(self, node: int) -> torch.Tensor:
        """Indices of node `node`'s children (node -1: the root's)."""
        return (self.parents == node).nonzero()[:, 0]

    def verify_mask(self, n_cached: int) -> torch.Tensor:
        """(1+N, n_cached+1+N) bool: the root and nodes see the whole cache, the root, and their ancestors."""
        N = self.n_nodes
        m = torch.zeros(1 + N, n_cached + 1 + N, dtype=torch.bool)
        m[:, : n_cached + 1] = True                                                 # cache + root
        m[1:, n_cached + 1:] = self.mask
        return m
