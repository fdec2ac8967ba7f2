"""Typical acceptance (Cai et al. 2024, Medusa, sec. 2.3.1): keep draft tokens the target finds plausible.

Instead of rejection sampling (exact, but it rejects often at temperature > 0), Medusa keeps a
candidate x wherever the target's distribution p_target at its parent gives it
    p_target(x) > min(epsilon, delta * exp(-H(p_target)))
(epsilon: Medusa's `posterior_threshold`, default 0.09; delta: its `posterior_alpha`, default
sqrt(0.09) = 0.3). A confident target (low entropy H) demands a high probability; an unsure one
accepts more. The output is no longer distributed as p_target, but a token the target itself
gives zero probability is never kept. After the longest accepted path (ties: the most likely),
the target's argmax at its last node is the next token, so with one-hot p_target (greedy) this is
exactly greedy tree acceptance.
"""
from __future__ import annotations

import torch

from .tree import Tree
from .tree_acceptance import TreeAcceptance

EPSILON = 0.09          # Medusa's posterior_threshold
DELTA = 0.3             # Medusa's posterior_alpha


def typical_threshold(p_target: torch.Tensor, epsilon: float = EPSILON, delta: float = DELTA) -> torch.Tensor:
    """(..., ) min(epsilon, delta * exp(-H(p))) for distributions p_target (..., V)."""
    entropy = -(p_target * torch.log(p_target.clamp(min=1e-30))).sum(-1)          # (...,) 0 log 0 = 0
    return torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))


def typical_accept(p_target: torch.Tensor, tree: Tree, node_tokens: torch.Tensor,
                   epsilon: float = EPSILON, delta: float = DELTA) -> TreeAcceptance:
    """Medusa's typical acceptance over a tree.

    p_target: (1+N, V) the target's distribution after the root (row 0) and after each node (row 1+i);
    node_tokens: (N,). Node i is accepted when its token passes the threshold of its parent's row
    and its parent is accepted (the root always is).
    """
    N = tree.n_nodes
    if p_target.shape[0] != 1 + N or node_tokens.shape != (N,):
        raise ValueError(f"need p_target (1+N, V) and node_tokens (N,) for N={N} nodes, got "
                         f"{tuple(p_target.shape)} and {tuple(node_tokens.shape)}")
    parent_row = tree.parents + 1                                                  # (N,) row of p_target
    p_x = p_target[parent_row, node_tokens]                                        # (N,)
    passes = p_x > typical_threshold(p_target, epsilon, delta)[parent_row]         # (N,)
    # accepted = passes on the whole root-to-node path: node i's ancestors (mask row i) all pass
    accepted = ~(tree.mask & ~passes[None, :]).any(1) if N else passes              # (N,)
    if not bool(accepted.any()):
        return TreeAcceptance([], int(p_target[0].argmax()), bonus=False)
    depth = torch.where(accepted, tree.depth, 0)                                   # (N,)
    log_p = torch.where(tree.mask, torch.log(p_x.clamp(min=1e-30))[None, :], 0).sum(1)   # (N,) path log-likelihood
    log_p = torch.where(depth == depth.max(), log_p, -torch.inf)
    last = int(log_p.argmax())                                                     # deepest, then most likely
    return TreeAcceptance(tree.paths_to(last), int(p_target[1 + last].argmax()), bonus=bool(tree.is_leaf[last]))


def typical_accept_rule(epsilon: float = EPSILON, delta: float = DELTA, temperature: float = 1.0):
    """Medusa's typical acceptance (labkit/core/typical.py) as the tree decoder's accept_rule.

    The rule gets the verify logits (1+N, V) and judges the nodes against softmax(logits / temperature).
    """
    if temperature <= 0:
        raise ValueError(f"typical acceptance needs a temperature > 0 (its entropy is of softmax(logits / T)), "
                         f"got {temperature}")

    def rule(tree: Tree, node_tokens: torch.Tensor, target_logits: torch.Tensor) -> TreeAcceptance:
        p_target = (target_logits.float() / temperature).softmax(-1)                # (1+N, V)
        return typical_accept(p_target, tree, node_tokens, epsilon, delta)
    return rule
