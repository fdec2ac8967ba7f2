"""Tree speculative decoding: propose a tree -> verify every node in one forward -> accept a path -> compact.

The loop of `speculative.py` with a tree in place of a chain (SpecInfer, Medusa, EAGLE). A step
feeds the last committed token (the root) and the N tree nodes in one target forward, each node
at RoPE position root + depth and attending to the cache, the root and its own ancestors
(`Tree.verify_mask`); the first step feeds the nodes alone, as the prefill read the whole prompt
and gave the root's features and logits. Acceptance picks the longest root-to-leaf path the target agrees with plus
one token of the target's; rollback keeps exactly the accepted path's KV entries, moved into
place right after the root (`KVCache.commit_path`), and drops every other branch.

Tree drafters (Medusa, EAGLE) read the target's features, so the loop hands them the final
hidden state of every position it adds to the cache (see drafters/base.py). A `TreeTarget`
(models/target.py) names other features: a multi-token model's are all its heads' hidden states (drafters/mtp_tree.py).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from ..core.sampling import (
    GREEDY,
    SamplingConfig,
    argmax,
    probs_from_logits,
    token_probs,
)
from ..core.trace import Step
from ..core.tree import Tree
from ..core.tree_acceptance import (
    TreeAcceptance,
    greedy_tree_accept,
    tree_speculative_accept,
)
from ..core.tree_budget import BudgetPolicy, FixedBudget
from ..drafters.base import Drafter, Proposal, tree_target
from ..models.target import TreeTarget, as_tree_target
from ..models.transformer import Transformer
from .base import Decoder, Generation, check_drafter, check_sampling

NO_NODES = torch.empty(0, dtype=torch.long)   # a plain step's

# An acceptance rule other than the exact ones (Medusa's typical acceptance): (tree, node tokens, logits) -> acceptance
AcceptRule = Callable[[Tree, torch.Tensor, torch.Tensor], TreeAcceptance]


class TreeDecoder(Decoder):
    """One sequence decoded with a tree drafter; each `step()` is one target forward over a tree."""

    def __init__(self, target: Transformer | TreeTarget, drafter: Drafter, prompt_ids: torch.Tensor,
                 max_new_tokens: int, budget: int | BudgetPolicy = 32, sampling: SamplingConfig = GREEDY,
                 eos_token_ids: tuple[int, ...] = (), seed: int | None = None, accept_rule: AcceptRule | None = None):
        """budget: tree nodes per step, or a policy choosing them each step (core.tree_budget.BudgetPolicy)."""
        policy = budget if callable(getattr(budget, "budget", None)) else FixedBudget(budget)
        check_drafter(drafter), check_sampling(sampling)
        if accept_rule is not None and not sampling.greedy:
            raise ValueError("a custom accept_rule (typical acceptance) replaces sampling: use temperature 0 with it")
        if getattr(policy, "needs_best_first", False) and not drafter.needs.best_first:
            raise ValueError(f"the {policy.name} budget judges smaller trees by cutting this step's proposal, but "
                             f"{drafter.name}'s proposals are not listed best first (Needs.best_first): "
                             "give it a fixed budget (an int)")
        target = tree_target(drafter, as_tree_target(target))
        self.begin(target, prompt_ids, max_new_tokens, f"tree/{drafter.name}", eos_token_ids, seed, sampling)
        drafter.check_target(target)
        self.target, self.drafter, self.budget, self.accept_rule = target, drafter, policy, accept_rule
        t0 = time.perf_counter()
        with torch.no_grad():
            self.cache = target.new_cache()                     # every prompt token: the first step feeds no root
            features = target.features(self.prompt[None].to(target.device), self.cache)             # (T, F)
            self.prefill_root = features[-1:], target.logits(features[-1:]).cpu()   # the root's (1, F), (1, V)
            t1 = time.perf_counter()
            drafter.start(self.prompt, features[:-1])           # the root's features come with its step's commit
            policy.start(self.prompt)
        self.trace.prefill_time = self.trace.total_time = time.perf_counter() - t0
        self.trace.draft_prefill_time = time.perf_counter() - t1

    @torch.no_grad()
    def _advance(self) -> Step:
        """propose a tree -> verify it -> accept a path -> commit and compact, once. A budget of 0 (or no room) is a
        plain step: no tree, the root alone through the target, its token picked as plain decoding picks it."""
        n_cached = self.cache.length - (self.prefill_root is not None)        # the root's slot
        t0 = time.perf_counter()
        budget = min(self.budget.budget(), self.max_new_tokens - self.trace.n_generated - 1, self.cache.room() - 1)
        # 1. Propose: a tree of candidate continuations
        proposal = Proposal.empty(NO_NODES) if budget <= 0 else \
            self.drafter.propose(torch.tensor(self.tokens), budget, self.sampling, self.generator).limit(budget)
        tree, nodes = proposal.as_tree(), proposal.tokens.cpu()                              # (N,)
        # 2. Verify: root + every node in one forward, each node seeing only its ancestors
        t1 = time.perf_counter()
        hidden, logits = self.verify(tree, nodes, n_cached)                              # (1+N, F), (1+N, V)
        t2 = time.perf_counter()
        # 3. Accept: the longest agreeing path plus one token of the target's
        acc, p_nodes = self.accept(tree, nodes, proposal.q_draft, logits)
        verdict = argmax(logits) if self.drafter.needs.verdict else None                 # (1+N,) after every node
        # 4. Commit: keep the root and the accepted path in the cache, compacted; drop every other branch
        keep = torch.tensor([0] + [1 + i for i in acc.path])                             # (1+n,) slots after n_cached
        if nodes.numel():                                 # a plain step's cache holds the root alone already
            self.cache.commit_path(keep, start=n_cached)
        self.drafter.commit(n_cached + keep.numel(), hidden[keep.to(hidden.device)], verdict)
        new_tokens = self._commit(acc.tokens(nodes))
        step = Step(nodes.tolist(), acc.n_accepted, acc.next_token, acc.bonus, t1 - t0, t2 - t1, p_nodes,
                    proposal.q_token.tolist(), parents=tree.parents.tolist(), path=acc.path, asked=max(budget, 0))
        self.budget.update(step)
        return self._record(step, new_tokens, t0)

    def accept(self, tree: Tree, nodes: torch.Tensor, q_draft: torch.Tensor | None,
               logits: torch.Tensor) -> tuple[TreeAcceptance, list[float]]:
        """The longest path the target agrees with plus one token of the target's, by the loop's rule (custom,
        greedy or rejection sampling), and the target's probability of each node (N,), for the trace."""
        parent_rows = tree.parents + 1                                                    # (N,) row of each node's parent
        if self.accept_rule is not None or self.sampling.greedy:
            acc = (self.accept_rule or greedy_tree_accept)(tree, nodes, logits)
            return acc, token_probs(logits, parent_rows, nodes)
        p_target = probs_from_logits(logits, self.sampling)                              # (1+N, V)
        acc = tree_speculative_accept(tree, nodes, q_draft, p_target, self.generator)
        return acc, p_target[parent_rows, nodes].tolist()

    def verify(self, tree: Tree, nodes: torch.Tensor, n_cached: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Features (1+N, F) and logits (1+N, V) of the root (slot n_cached) and the N nodes. On the first step the
        root is the prompt's last token, already in the cache, and the prefill gave its row: the nodes go alone."""
        root, self.prefill_root = self.prefill_root, None
        device = self.target.device
        if root is None:
            feed = torch.tensor([self.tokens[-1]] + nodes.tolist(), device=device)[None]            # (1, 1+N)
            if not nodes.numel():  # a plain step (budget 0): the root alone, as plain decoding computes it (no mask)
                hidden = self.target.features(feed, self.cache)                                     # (1, F)
            else:
                positions = torch.cat([torch.tensor([n_cached]), tree.positions(n_cached)])         # (1+N,)
                mask = tree.verify_mask(n_cached).to(device)                                        # (1+N, S)
                hidden = self.target.features(feed, self.cache, positions[None].to(device), mask)  # (1+N, F)
            return hidden, self.target.logits(hidden).cpu()                                         # (1+N, V)
        root_hidden, root_logits = root
        if not nodes.numel():
            return root_hidden, root_logits
        positions, mask = tree.positions(n_cached), tree.verify_mask(n_cached)[1:].to(device)      # (N,), (N, S)
        hidden = self.target.features(nodes[None].to(device), self.cache, positions[None].to(device), mask)  # (N, F)
        logits = self.target.logits(hidden).cpu()                                                 # (N, V)
        return torch.cat([root_hidden, hidden]), torch.cat([root_logits.to(logits.dtype), logits])


def tree_generate(target: Transformer | TreeTarget, drafter: Drafter, prompt_ids: torch.Tensor, max_new_tokens: int,
                  budget: int | BudgetPolicy = 32, sampling: SamplingConfig = GREEDY, eos_token_ids: tuple[int, ...] = (),
                  seed: int | None = None, accept_rule: AcceptRule | None = None) -> Generation:
    """Decode up to max_new_tokens after prompt_ids (T,) with a tree drafter proposing up to `budget` nodes a step."""
    return TreeDecoder(target, drafter, prompt_ids, max_new_tokens, budget, sampling, eos_token_ids, seed,
                       accept_rule).run()
