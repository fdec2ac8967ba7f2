"""EAGLE-2's dynamic tree drafted without leaving the device: the EAGLE drafter of the compiled tree loop.

`EagleDrafter` (eagle.py) is the reference. It grows the tree on the host: each layer's scores come back to the CPU
to pick the next layer, and the tree is reranked in Python. On a GPU each of those reads waits for the device, and
the host's work between them leaves it idle. Here the same tree grows in fixed shapes, on the device:

1. Catch up: the head reads the pairs (feature, next token) the last step committed, at most depth + 1 of them
   (8 after a run of plain steps), padded to max(depth + 1, 8) rows, in its own static cache (slots, positions
   and mask are tensors). A padding row writes a slot past the committed pairs, which nothing reads before it is
   written again.
2. Grow: depth - 1 forwards of the top_k best nodes of a layer, each node seeing the committed pairs, its fed
   ancestors and itself (the mask made on the device); each proposes its top_k children, and the top_k children
   by cumulative log-probability form the next layer (EAGLE-2).
3. Rerank: every node seen, by cumulative log-probability, best first (ties: the earlier node, so a parent comes
   before its child: a child's score is its parent's plus a log-probability <= 0), the first 64 kept and their
   parents re-indexed. Every prefix of the list is then the best tree of its size, what `_best_subtree` gives.

Each of the two parts (catch up; grow and rerank) is one fixed-shape function: compiled with torch.compile when
asked (whole, or its decoder layer only) and, on CUDA, recorded once as a CUDA graph and replayed. Nothing is read back: `propose_on_device` returns
the tree's tokens, parents and scores on the device, the compiled tree loop lays the tree out there
(decoding.compiled_tree.lay_out_on_device) and reads it back with the step's one sync. `propose`, the host
interface every loop can call, reads the same tree back at once.

The tree is always grown top_k wide and depth deep, and the best `budget` nodes kept, as EAGLE-2 does; the
reference narrows its layers to `budget` nodes when budget < top_k, so below that the two trees can differ.
A long catch-up (the prompt, or a window's) runs eagerly at its own length.
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from ..core.ops import rope_cos_sin
from ..core.tree import Tree
from ..models.compile_blocks import COMPILE_MODES, compile_blocks
from ..models.cuda_graph import capture_graph
from ..models.eagle_heads import FeatureHead
from ..models.kv_cache import LayerSlots, StaticKVCache
from ..models.transformer import Transformer
from .base import Proposal
from .eagle import EagleDrafter

MAX_KEPT = 64               # nodes a proposal lists at most: the compiled tree loop's widest verify
CATCH_UP = 8                # pairs a catch-up reads in its fixed shape at least: a run of plain steps commits up to 8


class DeviceTree(NamedTuple):
    tokens: torch.Tensor        # (N,) node tokens, best first
    parents: torch.Tensor       # (N,) long, -1 under the root, parents[i] < i
    q_token: torch.Tensor       # (N,) the head's probability of each node's whole path


class DeviceEagleDrafter(EagleDrafter):
    """EAGLE-2 dynamic-tree drafting in fixed shapes on the target's device; trees as `EagleDrafter` grows them.

        drafter = DeviceEagleDrafter(head, target, vocab, top_k=8, depth=6, compile="blocks", cuda_graph=True)
        CompiledTreeDecoder(target, drafter, max_len=1024, compile="blocks", cuda_graph=True).generate(ids, 256)
    """

    def __init__(self, head: FeatureHead, target: Transformer, draft_vocab: torch.Tensor | None = None,
                 top_k: int = 8, depth: int = 6, window: int | None = None, sinks: int = 4,
                 compile: bool | str = False, cuda_graph: bool = False, compile_backend: str = "inductor",
                 max_len: int | None = None):
        """compile: True, torch.compile each part whole; "blocks", the head's decoder layer only (compiled once per
        shape and shared, as the compiled loops' "blocks": seconds, not minutes); cuda_graph: record each part
        once as a CUDA graph (the target on a CUDA device); max_len: the longest sequence it drafts for (default the
        target's context), what its cache holds besides a tree: every forward reads all of its slots."""
        super().__init__(head, target, draft_vocab, top_k, depth, window, sinks)
        self.needs = replace(self.needs, device="tree")        # propose_on_device: the compiled tree loop's protocol
        if cuda_graph and target.device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs the target on a CUDA device; use cuda_graph=False on "
                             f"{target.device.type}")
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
        k, dev, a = top_k, target.device, head.args
        self.catch_rows = max(depth + 1, CATCH_UP)      # a tree step commits at most depth + 1 pairs, a plain run 8
        self.n_fed = (depth - 1) * k                    # tree nodes the head reads: its slots after the committed
        self.n_seen = k + (depth - 1) * k * k           # nodes scored
        self.n_kept = min(MAX_KEPT, self.n_seen)
        if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2):
            raise ValueError(f"max_len must be an integer >= 2 (the longest sequence drafted for), got {max_len!r}")
        self.max_len = (max_len or target.max_seq_len) + max(self.catch_rows, self.n_fed)
        p = head.block.post_attention_layernorm.weight
        self.static_cache = StaticKVCache(1, 1, a.n_kv_heads, self.max_len, a.head_dim, p.dtype, dev)
        self.slot_ids = torch.arange(self.max_len, device=dev)                     # (S,)
        self.rows = torch.arange(self.catch_rows, device=dev)                      # (C,)
        self.ramp = torch.arange(k, device=dev)                                    # (k,)
        # the catch-up's inputs, filled in place: features (C, F) (made at the first catch-up), tokens, first slot,
        # first position, and the last real row; the tree's: f_next (D,), its first slot and the last pair's position
        self.feats = None
        self.tok = torch.zeros(self.catch_rows, dtype=torch.long, device=dev)
        self.tok_host = torch.zeros(self.catch_rows, dtype=torch.long, pin_memory=dev.type == "cuda")
        self.base, self.pos0, self.last = (torch.zeros(1, dtype=torch.long, device=dev) for _ in range(3))
        self.f_next = torch.zeros(a.dim, dtype=p.dtype, device=dev)
        self.tree_base, self.tree_pos = (torch.zeros(1, dtype=torch.long, device=dev) for _ in range(2))
        self.run_block = compile_blocks(compile_backend) if compile == "blocks" else None
        self.catch_step = self._runner(self._catch_up_rows, compile is True, cuda_graph, compile_backend)
        self.grow_step = self._runner(self._grow, compile is True, cuda_graph, compile_backend)

    @staticmethod
    def _runner(fn, whole: bool, cuda_graph: bool, backend: str):
        """fn, compiled whole when asked, recorded as a CUDA graph at its first call when asked (outputs refilled)."""
        run = torch.compile(fn, backend=backend, dynamic=False) if whole else fn
        if not cuda_graph:
            return run
        recorded = {}

        def replay():
            if not recorded:
                recorded["graph"], recorded["out"] = capture_graph(run, warmups=3)
            recorded["graph"].replay()
            return recorded["out"]
        return replay

    # --- the head, in fixed shapes ---------------------------------------------------------------------------
    def _head(self, context: torch.Tensor, embeds: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
        """The head's outputs (T, D) for pairs (context (T, D), embeds (T, D)) written at `slots` (T,), at RoPE
        `positions` (T,), each row seeing the slots of `mask` (T, S)."""
        a = self.head.args
        cos, sin = rope_cos_sin(positions[None], a.head_dim, a.rope_theta, context.dtype)   # (1, 1, T, hd)
        x = self.head.pair_input(context, embeds)[None]                                   # (1, T, D or 2D)
        if self.run_block is None:
            out = self.head.block(x, cos, sin, LayerSlots(self.static_cache.k[0], self.static_cache.v[0], slots), 0,
                                  mask)                                                   # (1, T, D)
        else:                                                   # the compiled block reads the cache's slots
            self.static_cache.slots = slots
            out = self.run_block(self.head.block, x, cos, sin, self.static_cache, 0, mask)
        return self.head.output(out)[0]                                                   # (T, D)

    def _catch_up_rows(self) -> torch.Tensor:
        """The head's output (1, D) at the last real row of the padded catch-up."""
        slots = self.base + self.rows                                              # (C,)
        mask = self.slot_ids <= slots[:, None]                                     # (C, S) each row: up to itself
        out = self._head(self.head.context(self.feats), self.target.embed_tokens(self.tok), slots,
                         self.pos0 + self.rows, mask)                              # (C, D)
        return out.index_select(0, self.last)                                      # (1, D)

    def _grow(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tree from f_next, reranked: (tokens, parents, cumulative log-probabilities), (n_kept,) each."""
        k, dev = self.top_k, self.f_next.device
        logp = self._log_probs(self.f_next)                                        # (Vd,)
        score, idx = logp.topk(k)                                                  # (k,)
        tokens, scores = [self.draft_vocab[idx]], [score]
        parents = [torch.full((k,), -1, device=dev)]
        layer, layer_score, layer_tok = self.ramp, score, tokens[0]                # (k,) node ids, scores, tokens
        layer_f = self.f_next.expand(k, -1)                                        # (k, D) the feature that chose them
        fed = torch.zeros(k, max(self.n_fed, 1), dtype=torch.bool, device=dev)     # (k, n_fed) fed ancestors
        rel = self.slot_ids - self.tree_base                                       # (S,) slot - first tree slot
        in_tree = (rel >= 0) & (rel < self.n_fed)
        for d in range(1, self.depth):
            # feed the layer at position L-1+d, fed index (d-1)k + j; each sees the committed pairs, its fed
            # ancestors and itself
            own = (d - 1) * k + self.ramp                                          # (k,)
            fed = fed | (torch.arange(fed.shape[1], device=dev) == own[:, None])   # (k, n_fed)
            mask = (rel < 0) | (in_tree & fed[:, rel.clamp(0, fed.shape[1] - 1)])  # (k, S)
            out = self._head(layer_f, self.target.embed_tokens(layer_tok), self.tree_base + own,
                             (self.tree_pos + d).expand(k), mask)                 # (k, D)
            # every node proposes its top-k children; cumulative scores pick the next layer (EAGLE-2)
            child_score, child_idx = self._log_probs(out).topk(k, dim=-1)         # (k, k)
            cum = (layer_score[:, None] + child_score).flatten()                   # (k*k,)
            child_tok = self.draft_vocab[child_idx].flatten()                      # (k*k,)
            tokens.append(child_tok)
            parents.append(layer.repeat_interleave(k))
            scores.append(cum)
            best = cum.topk(k).indices                                             # (k,) of the k*k children
            layer = k + (d - 1) * k * k + best
            layer_score, layer_tok, layer_f, fed = cum[best], child_tok[best], out[best // k], fed[best // k]
        # rerank: best first, ties by index (depth order), so every parent precedes its children
        tokens, parents, scores = torch.cat(tokens), torch.cat(parents), torch.cat(scores)   # (n_seen,) each
        keep = (-scores).argsort(stable=True)[:self.n_kept]                        # (n_kept,)
        new_index = torch.full_like(parents, -1).scatter(0, keep, torch.arange(self.n_kept, device=dev))
        kept_parents = parents[keep]                                               # (n_kept,)
        kept_parents = torch.where(kept_parents >= 0, new_index[kept_parents.clamp(min=0)], -1)
        return tokens[keep], kept_parents, scores[keep]

    # --- the drafter -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def start(self, prompt_ids, features=None):
        """Read the prompt's pairs now (the reference reads them at its first proposal), so that a step's drafting
        is the fixed shapes alone."""
        super().start(prompt_ids, features)
        self.cache = None                          # the reference's cache: this drafter reads static_cache
        if self.n_features:
            self._catch_up(prompt_ids)

    @torch.no_grad()
    def propose_on_device(self, tokens: torch.Tensor, budget: int) -> DeviceTree:
        """The best min(budget, 64) nodes of the tree after the committed `tokens` (host, (n,)), on the device;
        empty before the first feature (a one-token prompt)."""
        if self.n_features == 0 or budget < 1:
            empty = torch.zeros(0, dtype=torch.long, device=self.f_next.device)
            return DeviceTree(empty, empty, empty.float())
        self._catch_up(tokens)
        kept_tokens, kept_parents, kept_scores = self.grow_step()
        n = min(budget, self.n_kept)
        return DeviceTree(kept_tokens[:n], kept_parents[:n], kept_scores[:n].exp())

    @torch.no_grad()
    def propose(self, tokens, budget, sampling, generator=None) -> Proposal:
        """`propose_on_device`, read back: a Proposal for any tree loop."""
        tree = self.propose_on_device(tokens, budget)
        if tree.tokens.numel() == 0:
            return Proposal.empty(tokens)
        return Proposal(tree.tokens.cpu(), None, tree.q_token.float().cpu(), Tree(tree.parents.cpu()))

    def _catch_up(self, tokens: torch.Tensor) -> None:
        """Read the committed pairs not read yet into the head's cache; f_next: its output at the last of them."""
        L = self.n_features
        if L == self.n_pairs:                                      # a second proposal: f_next holds
            return
        new = self._unread(L)                                      # (m,) pair indices to read
        m, n_read = new.numel(), self.n_pairs - self.skipped      # n_read: the head's slots in use
        if n_read + m + max(self.catch_rows, self.n_fed) > self.max_len:
            raise ValueError(f"{L + 1} tokens exceed this drafter's cache: build it with max_len >= {L + 1}")
        pending = torch.cat(self.pending)                          # (L - n_pairs, F) features n_pairs..L-1
        self.pending = []
        if m <= self.catch_rows and m == L - self.n_pairs:         # a step's pairs: the fixed shape
            if self.feats is None:
                self.feats = pending.new_zeros(self.catch_rows, pending.shape[1])           # (C, F)
            self.feats[:m].copy_(pending)
            self.tok_host[:m] = tokens[self.n_pairs + 1:L + 1]
            self.tok.copy_(self.tok_host, non_blocking=True)
            self.base.fill_(n_read)
            self.pos0.fill_(self.n_pairs)
            self.last.fill_(m - 1)
            f = self.catch_step()[0]                                                        # (D,)
        else:                                                      # the prompt, or a window of it: its own length
            dev = self.f_next.device
            slots = n_read + torch.arange(m, device=dev)                                    # (m,)
            context = self.head.context(pending[new - self.n_pairs])                       # (m, D)
            embeds = self.target.embed_tokens(tokens[new + 1].to(dev))                     # (m, D)
            f = self._head(context, embeds, slots, new.to(dev), self.slot_ids <= slots[:, None])[-1]   # (D,)
        self.f_next.copy_(f)
        self.skipped += L - self.n_pairs - m
        self.n_pairs = L
        self.tree_base.fill_(n_read + m)
        self.tree_pos.fill_(L - 1)
