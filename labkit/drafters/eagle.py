"""EAGLE drafting (Li et al. 2024, EAGLE-1 and EAGLE-2): a feature-level head drafts a tree.

The head (labkit.models.eagle_heads: EAGLE-1's `EagleHead` or EAGLE-3's `Eagle3Head`) takes the
target's feature at the last committed position and the token it led to, predicts the next
feature, reads a token off it with an LM head over the draft vocabulary (EAGLE-1: the target's frozen
rows; EAGLE-3: its own), and continues on its own output.

EAGLE-2's dynamic tree: from the last committed pair, expand the top-k tokens; at every depth
keep the `top_k` nodes with the highest cumulative draft log-probability and expand each of
them by its own top-k; finally rerank every node seen by cumulative log-probability and keep
the best `budget` (a parent always outranks its child, so the kept set is a tree), listed best
first: the first n nodes of a proposal are the tree the drafter makes with budget n.

A CPU cost note: the LM head (151,936 x 1,536, 467 MB in bf16) is as heavy to read as a sixth
of the target, and the tree reads it once per depth. The drafter therefore scores a *draft
vocabulary*, the tokens the target actually produced on the training corpus (EAGLE-3 does the
same with its `d2t` map); tokens outside it are never drafted, which costs acceptance, never
exactness: the target verifies every node with its full vocabulary.

Nor need the head read a long prompt whole. With `window=W` a catch-up of more than `sinks` + W committed
pairs (the prompt, at the first proposal) reads the first `sinks` pairs and the last W only, each at its
own position, so the head's first proposal costs the same whatever the prompt's length; the pairs it
skipped are never read. The target verifies against everything, so the output is unchanged; only how
often the head is right can change. The bench and the command line read HEAD_WINDOW pairs: reading a long prompt whole
costs the head's first proposal more, and on the lab's long-prompt questions its trees were no more often
right for it (data/bench/head_window_amd-epyc-zen5.md).
"""
from __future__ import annotations

import torch

from ..core.tree import Tree
from ..models.backends import readout
from ..models.eagle_heads import FeatureHead
from ..models.transformer import Transformer
from .base import Drafter, Needs, Proposal

HEAD_WINDOW = 256          # pairs of a long prompt the bench's and the command line's heads read, besides 4 sinks


class EagleDrafter(Drafter):
    """EAGLE-2 dynamic-tree drafting (or a chain with top_k=1) on the target's features."""

    name = "eagle"

    def __init__(self, head: FeatureHead, target: Transformer, draft_vocab: torch.Tensor | None = None,
                 top_k: int = 8, depth: int = 6, window: int | None = None, sinks: int = 4):
        """window: at most this many pairs of a long catch-up (the prompt) besides the first `sinks` are read
        (None: every pair)."""
        if top_k < 1 or depth < 1:
            raise ValueError(f"top_k and depth must be >= 1, got top_k={top_k}, depth={depth}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be an integer >= 1 (pairs the head reads of a long prompt) or None for "
                             f"all of them, got {window!r}")
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise ValueError(f"sinks must be an integer >= 0 (the first pairs the head keeps), got {sinks!r}")
        self.head, self.target, self.top_k, self.depth = head, target, top_k, depth
        self.window, self.sinks = window, sinks
        if draft_vocab is None:
            draft_vocab = torch.arange(target.vocab_size)
        self.draft_vocab = draft_vocab.long().to(target.device)                         # (Vd,) ids in the target's vocab
        rows = head.readout_rows(target.lm_head.weight, self.draft_vocab)              # (Vd, D), sliced once
        self.readout = readout(rows, target.path)                                       # f -> f @ rows.T, the target's path
        self.name = f"{head.kind}-chain" if top_k == 1 else f"{head.kind}-tree"
        # nodes come best first (see _best_subtree): the first n are the tree of budget n
        self.needs = Needs(features=True, best_first=True, target=head.tree_target)

    def _log_probs(self, f: torch.Tensor) -> torch.Tensor:
        """Draft log-probabilities (..., Vd) over the draft vocabulary from the head's outputs (..., D)."""
        return self.readout(self.head.readout_input(f)).float().log_softmax(-1)

    def start(self, prompt_ids, features=None):
        self.tokens = prompt_ids.tolist()
        self.pending = [features.clone()]          # target features the head has not read yet, (m, D) each
        self.n_features = features.shape[0]        # L: every committed position's feature so far
        self.cache = self.head.new_cache(self.target.max_seq_len)
        self.n_pairs = 0                                                                # committed pairs accounted for
        self.skipped = 0                                                                # of them, never read (window)

    def commit(self, n_cached, features=None, verdict=None):
        self.pending.append(features)              # kept until the next proposal reads them (no copy of them all)
        self.n_features += features.shape[0]

    @torch.no_grad()
    def propose(self, tokens, budget, sampling, generator=None) -> Proposal:
        L, dev = self.n_features, self.target.device
        if L == 0:                                                                     # a one-token prompt: no feature yet
            return Proposal.empty(tokens)
        # 1. Catch up on the committed pairs (f_t, x_{t+1}), t = n_pairs .. L-1, dropping last step's tree
        self.cache.truncate(self.n_pairs - self.skipped)
        if L > self.n_pairs:                                                           # (else: a second proposal)
            new = self._unread(L)                                                      # (m,) pair indices to read
            embeds = self.target.embed_tokens(tokens[new + 1].to(dev))                  # (m, D)
            pending = torch.cat(self.pending)                                          # features n_pairs..L-1
            context = self.head.context(pending[new - self.n_pairs])                   # (m, D)
            self.pending = []
            self.skipped += L - self.n_pairs - new.numel()
            self.f_next = self.head(context[None], embeds[None], self.cache,
                                    new[None].to(dev))[0, -1]                          # (D,) predicts x_{L+1}
            self.n_pairs = L
        f_hat = self.f_next
        # 2. Grow the tree depth by depth, expanding the top_k best nodes of each layer (EAGLE-2)
        k = min(self.top_k, budget)
        logp = self._log_probs(f_hat)                                                  # (Vd,)
        score, idx = logp.topk(k)                                                      # (k,)
        all_tokens, all_parents, all_scores = [self.draft_vocab[idx].cpu()], [torch.full((k,), -1)], [score.cpu()]
        all_depths = [torch.ones(k, dtype=torch.long)]
        layer = torch.arange(k)                                                        # node ids of the current layer
        layer_f = f_hat.expand(k, -1)                                                  # (k, D) feature that chose them
        slot_of = torch.full((k,), -1)                                                 # (n_nodes,) tree slot of each fed node
        slot_parents = torch.empty(0, dtype=torch.long)                                # (n_fed,) parent slot of each tree slot
        n_nodes, n_read = k, self.n_pairs - self.skipped                                # n_read: pairs in the cache
        for d in range(1, min(self.depth, budget)):     # a tree of `budget` nodes is never deeper than that
            # feed the layer's pairs (feature that chose the node, node token) at position L-1+d, each
            # seeing the committed pairs, its ancestors' slots and itself: the fed nodes' tree mask
            parents = torch.cat(all_parents)                                           # (n_nodes,)
            slot_of[layer] = slot_parents.numel() + torch.arange(layer.numel())
            layer_parents = parents[layer]                                             # (k,)
            slot_parents = torch.cat([slot_parents, torch.where(layer_parents >= 0, slot_of[layer_parents.clamp(min=0)], -1)])
            fed = Tree(slot_parents)
            mask = torch.cat([torch.ones(layer.numel(), n_read, dtype=torch.bool),
                              fed.mask[-layer.numel():]], dim=1)                      # (k, n_read + n_fed)
            node_tokens = torch.cat(all_tokens)[layer]                                 # (k,)
            positions = torch.full((1, layer.numel()), L - 1 + d, device=dev)
            out = self.head(layer_f[None], self.target.embed_tokens(node_tokens.to(dev))[None], self.cache,
                            positions, mask.to(dev))[0]                               # (k, D)
            # every node of the layer proposes its top-k children; cumulative scores rank them globally
            logp = self._log_probs(out)                                                # (k, Vd)
            child_score, child_idx = logp.topk(k, dim=-1)                              # (k, k)
            cum = (torch.cat(all_scores)[layer][:, None] + child_score.cpu()).flatten()   # (k*k,)
            all_tokens.append(self.draft_vocab[child_idx].flatten().cpu())
            all_parents.append(layer.repeat_interleave(k))
            all_scores.append(cum)
            all_depths.append(torch.full((k * k,), d + 1))
            slot_of = torch.cat([slot_of, torch.full((k * k,), -1)])
            best = cum.topk(k).indices                                                 # (k,) of the k*k children
            layer = n_nodes + best
            layer_f = out.repeat_interleave(k, dim=0)[best.to(dev)]                    # (k, D)
            n_nodes += k * k
        # 3. Rerank: the `budget` best nodes by cumulative log-probability, parents before children
        tokens_, parents_, scores_ = torch.cat(all_tokens), torch.cat(all_parents), torch.cat(all_scores)
        keep = _best_subtree(parents_, torch.cat(all_depths), scores_, budget)
        new_index = torch.full((n_nodes,), -1)
        new_index[keep] = torch.arange(keep.numel())
        kept_parents = torch.where(parents_[keep] >= 0, new_index[parents_[keep].clamp(min=0)], -1)
        return Proposal(tokens_[keep], None, scores_[keep].exp(), Tree(kept_parents))

    def _unread(self, L: int) -> torch.Tensor:
        """The committed pairs (m,) to read now, of n_pairs .. L-1: all of them, or with a window and more than
        `sinks` + window of them, those among the first `sinks` pairs and the last `window`."""
        new = torch.arange(self.n_pairs, L)
        if self.window is None or new.numel() <= self.sinks + self.window:
            return new
        return torch.cat([new[new < self.sinks], new[-self.window:]])


def _best_subtree(parents: torch.Tensor, depth: torch.Tensor, scores: torch.Tensor, budget: int) -> torch.Tensor:
    """Indices of the `budget` highest-scoring nodes whose parents are all kept (ties: shallower first), best first:
    the first n of them are the best subtree of n nodes, and every parent comes before its children."""
    order = torch.arange(parents.numel())
    order = order[depth[order].argsort(stable=True)]                                   # ties in score: by depth, index
    order = order[(-scores[order]).argsort(stable=True)]                               # (n_nodes,) best first
    kept: dict[int, None] = {}                                                         # insertion-ordered
    for i in order.tolist():
        if len(kept) == budget:
            break
        if parents[i] < 0 or int(parents[i]) in kept:
            kept[i] = None
    return torch.tensor(list(kept), dtype=torch.long)


# --- checkpoints -------------------------------------------------------------------------------------


