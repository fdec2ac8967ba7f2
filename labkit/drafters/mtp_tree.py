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

from ..models.mtp import MTPModel, mtp_window_targets
from ..models.target import TreeTarget
from .medusa import MedusaDrafter, medusa_tree


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


@torch.no_grad()
def head_topk_accuracy(model: MTPModel, windows: torch.Tensor, T: int, k: int = 8) -> torch.Tensor:
    """(n, k) teacher-forced top-1..top-k accuracy of every offset's head on windows (N, T + n); row 0: head 1."""
    logits = model.training_logits(windows, T)
    rows = []
    for j, lg in enumerate(logits):
        hit = lg.topk(k, dim=-1).indices == mtp_window_targets(windows, T, j)[..., None]   # (N, T, k)
        rows.append(hit.cumsum(-1).clamp(max=1).float().mean((0, 1)))                    # (k,)
    return torch.stack(rows)


def mtp_tree_drafter(model: MTPModel, topk_accuracy: torch.Tensor, budget: int) -> MedusaDrafter:
    """Medusa's drafter on heads 2..n: the `budget` most likely paths by head accuracy (row 0, head 1's, unused)."""
    _require_gloeckle(model)
    if topk_accuracy.shape[0] != model.cfg.n_future:
        raise ValueError(f"topk_accuracy has {topk_accuracy.shape[0]} rows for a model with {model.cfg.n_future} "
                         "heads: measure it with head_topk_accuracy on this model")
    drafter = MedusaDrafter(GloeckleHeads(model), medusa_tree(topk_accuracy[1:], budget))
    drafter.name = f"mtp-tree-gloeckle{model.cfg.n_future}"
    return drafter
