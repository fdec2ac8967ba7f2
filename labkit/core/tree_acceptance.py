"""Acceptance over a token tree: the longest root-to-leaf path the target agrees with, plus one token.

The verify pass gives the target's distribution after the root (row 0) and after every node
(row 1+i). A node is *correct* when its token is what the target picks after its parent; the
step commits the deepest node whose whole path is correct, then one token of the target's.

Sampling uses multi-candidate rejection sampling (SpecInfer, Miao et al. 2024; EAGLE, Li et al.
2024): at each node the children are tried in order; child c with token x, drawn from q_c, is
accepted with probability min(1, p(x) / q_c(x)); after a rejection the target's distribution
becomes the residual norm(max(0, p - q_c)) and the next sibling is tried against it. When no
child is accepted the next token is drawn from what is left. With one child per node this is
exactly Leviathan / Chen rejection sampling; with top-k children (q_c one-hot, as in EAGLE's and
Medusa's deterministic trees) a rejected token's mass is simply removed from p. Either way the
committed tokens are distributed as the target's own samples.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import argmax, sample
from .tree import Tree


@dataclass(frozen=True)
class TreeAcceptance:
    path: list[int]      # accepted nodes, root to leaf (may be empty)
    next_token: int      # the target's token after the last accepted node (correction or bonus)
    bonus: bool          # the path ends at a leaf: every drafted token on it was accepted

    @property
    def n_accepted(self) -> int:
        return len(self.path)

    def tokens(self, node_tokens: torch.Tensor) -> list[int]:
        """The tokens this step commits: the accepted path and the next token."""
        return node_tokens[self.path].tolist() + [self.next_token]


def greedy_tree_accept(tree: Tree, node_tokens: torch.Tensor, target_logits: torch.Tensor) -> TreeAcceptance:
    """Deepest node whose path matches the target's argmax everywhere (the first of them); exact for greedy decoding.

    node_tokens: (N,), target_logits: (1+N, V) (row 0: after the root, row 1+i: after node i). Level by level
    from the root, it reads the argmax of the root's row and of each node found correct so far: a row's argmax
    reads a whole vocabulary, and a step's correct nodes are a path or two, not the tree's every row.
    """
    tokens, children = node_tokens.tolist(), {}
    for node, parent in enumerate(tree.parents.tolist()):
        children.setdefault(parent, []).append(node)
    pick, level, correct = {}, [-1], []                                     # pick: node -> the target's token after it
    while level:
        pick.update((n, int(argmax(target_logits[n + 1]))) for n in level)     # row views: no copy of the rows
        level = [c for n in level for c in children.get(n, []) if tokens[c] == pick[n]]
        correct += level
    if not correct:
        return TreeAcceptance([], pick[-1], bonus=False)
    depth = tree.depth.tolist()
    best = min(correct, key=lambda c: (-depth[c], c))                       # first of the deepest
    return TreeAcceptance(tree.paths_to(best), pick[best], bonus=bool(tree.is_leaf[best]))


def tree_speculative_accept(tree: Tree, node_tokens: torch.Tensor, q_draft: torch.Tensor | None,
                            p_target: torch.Tensor, generator: torch.Generator | None = None) -> TreeAcceptance:
    """Multi-candidate rejection sampling down the tree: output ~ p_target exactly.

    node_tokens: (N,); q_draft: (N, V) distribution each node was drawn from, None for
    deterministic nodes (top-k picks: q is their one-hot); p_target: (1+N, V).
    """
    path, node = [], -1
    p = p_target[0]                                                          # (V,) after the root
    while True:
        children = tree.children(node)
        accepted = None
        for c in children.tolist():
            x = int(node_tokens[c])
            q_x = 1.0 if q_draft is None else float(q_draft[c, x])
            if float(torch.rand((), generator=generator)) * q_x < float(p[x]):   # u < p/q without dividing by 0
                accepted = c
                break
            if q_draft is None:
                residual = p.clone()
                residual[x] = 0.0                                            # max(0, p - onehot(x))
            else:
                residual = (p - q_draft[c]).clamp(min=0)
            p = residual / residual.sum() if residual.sum() > 0 else p       # p == q up to rounding: keep p
        if accepted is None:
            return TreeAcceptance(path, int(sample(p, generator)), bonus=children.numel() == 0 and node >= 0)
        path.append(accepted)
        node, p = accepted, p_target[accepted + 1]
