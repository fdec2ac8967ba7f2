"""Tree drafting from Gloeckle heads: Medusa's static tree filled by heads trained with the trunk.

The chain drafter (mtp.py) drafts each head's top-1 byte. When a head's first guess is wrong its
second or third often is right (a byte two ahead is usually one of a few letters), and Medusa's
answer applies unchanged: lay each head's top-k out as a tree, keep the `budget` paths most likely
to be right (chosen from the heads' measured top-k accuracy, `labkit.drafters.medusa.medusa_tree`), and
verify every path in one forward (`labkit.decoding.tree`).

What differs from Medusa is the verifier. A Gloeckle head is a transformer block with its own KV
cache, so the verify forward runs the trunk and every head over the tree nodes (each head's cache
is a layer of the shared cache, so `KVCache.commit_path` compacts them all with the trunk's). The
tree decoder's features are therefore every head's hidden state side by side, (T, n*D): head 1's
gives the verify logits, heads 2..n's at the last accepted position give the next tree. The
invariant is Medusa's: the last cached position is n-2 (input x_{n-2}); head j (1-based) there
predicts x_{n-2+j}, so head 2 predicts the token after the root, the tree's first level.
Greedy output equals the model's own greedy (head 1) output: head 1 verifies every node.
"""
from __future__ import annotations

import torch

from ..models.adapters import GloeckleHeads, _require_gloeckle
from ..models.mtp import MTPModel
from .medusa import MedusaDrafter, medusa_tree


def mtp_tree_drafter(model: MTPModel, topk_accuracy: torch.Tensor, budget: int) -> MedusaDrafter:
    """Medusa's drafter on heads 2..n: the `budget` most likely paths by head accuracy (row 0, head 1's, unused)."""
    _require_gloeckle(model)
    if topk_accuracy.shape[0] != model.cfg.n_future:
        raise ValueError(f"topk_accuracy has {topk_accuracy.shape[0]} rows for a model with {model.cfg.n_future} "
                         "heads: measure it with head_topk_accuracy on this model")
    drafter = MedusaDrafter(GloeckleHeads(model), medusa_tree(topk_accuracy[1:], budget))
    drafter.name = f"mtp-tree-gloeckle{model.cfg.n_future}"
    return drafter
