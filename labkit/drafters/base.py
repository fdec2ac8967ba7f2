"""The one interface every drafter implements: propose tokens after the committed ones.

A proposal is a tree of draft tokens whose root is the last committed token; a chain is the
tree with one child per node, and most drafters (a draft model, prompt lookup, MTP heads) propose
chains. The decoding loops (labkit.decoding) call, per sequence:

    start(prompt_ids, features)     once, after the target's prefill
    propose(tokens, k, sampling)    once per step: at most k nodes to follow the committed `tokens`
    commit(n_cached, features)      after the target has decided: the target's cache now holds the
                                    first n_cached committed tokens (all but the last), and
                                    `features` are the target's features of the positions the step
                                    added (None where the loop has none)

A drafter that learns from the target's verdict on every node it proposed, accepted or not
(lookahead decoding's Jacobi window), sets `reads_verdict`; the tree loop then calls
`verdict(next_tokens)` before `commit`.

A drafter whose proposals list their nodes best first, so that a proposal cut to its first n nodes
is the proposal it would have made with budget n (a chain; suffix decoding's and EAGLE-2's trees;
Medusa's greedy static tree), sets `best_first`: the tree loop's cost-aware budget
(tuning/tree_budget.py) judges every smaller budget from one step only for such a drafter.

A drafter that drafts its tree on the target's device (EAGLE-2's, eagle_device.py) sets `drafts_on_device` and
has `propose_on_device(tokens, k)`: the compiled tree loop then keeps the tree there and reads it back with its one
sync; `propose` stays the interface of every other loop. The compiled chain loop asks `device_parts()` what it
may run on the device (a draft model) and what proposes on the host; no loop names a drafter's class.

A drafter with state (a KV cache) drops what was rejected in `commit`. A drafter that reads the
target's features (Medusa, EAGLE) says so with `reads_features`: only the tree loop, which runs
labkit's own model, can give them. The drafter sees token ids, never text.

The batched loop (labkit.decoding.batched) decodes B sequences at once and calls the same three
steps for all rows: `start_rows`, `propose_rows`, `commit_rows`. By default they keep one copy of
the drafter per row and call the one-sequence methods; a drafter that drafts every row in one
forward (the draft model) overrides them.
"""
from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..core.sampling import SamplingConfig, draw
from ..core.tree import Tree


@dataclass
class Proposal:
    tokens: torch.Tensor                  # (N,) proposed token of each node
    q_draft: torch.Tensor | None = None   # (N, V) distribution node i was drawn from; None: chosen deterministically
    q_token: torch.Tensor | None = None   # (N,) the drafter's probability of (confidence in) each node, for the trace
    tree: Tree | None = None              # parents (N,), parents[i] < i, -1 under the root; None: a chain

    def __post_init__(self):
        if self.q_token is None:
            self.q_token = torch.ones(self.tokens.shape[0])
        if self.tree is not None and self.tokens.shape != self.tree.parents.shape:
            raise ValueError(f"{self.tokens.numel()} tokens for a tree of {self.tree.n_nodes} nodes")

    @property
    def k(self) -> int:
        return self.tokens.shape[0]

    @property
    def is_chain(self) -> bool:
        return self.tree is None or bool((self.tree.parents == torch.arange(self.k) - 1).all())

    def as_tree(self) -> Tree:
        """The proposal's tree (a chain's: node i's parent is node i-1)."""
        return Tree.chain(self.k) if self.tree is None else self.tree

    def limit(self, n: int) -> "Proposal":
        """The first n nodes (still a tree: parents come before children)."""
        if n >= self.k:
            return self
        pick = lambda t: None if t is None else t[:n]
        return Proposal(self.tokens[:n], pick(self.q_draft), pick(self.q_token),
                        None if self.tree is None else Tree(self.tree.parents[:n]))

    def q_or_one_hot(self, vocab_size: int) -> torch.Tensor:
        """q_draft, or the one-hot of a deterministic proposal (what rejection sampling needs)."""
        if self.q_draft is not None:
            return self.q_draft
        return torch.nn.functional.one_hot(self.tokens, vocab_size).float()      # (N, V)

    @classmethod
    def empty(cls, like: torch.Tensor) -> "Proposal":
        return cls(like.new_empty(0, dtype=torch.long))


def draft_chain(logits: torch.Tensor, feed, k: int, sampling: SamplingConfig, generator: torch.Generator | None = None,
                stop=None, keep_q: bool = False) -> Proposal:
    """The draft-model family's loop: draw a token from `logits` (V,), keep it, feed it, draw the next, k times.

    feed(i, x): the logits (V,) after draft token i (0-based), x; stop(x, probs): end the chain after x.
    Each token's row q is kept when sampling (rejection sampling needs it) or when `keep_q`.
    """
    drafted, q_rows, q_tok = [], [], []
    for i in range(k):
        x, probs = draw(logits, sampling, generator)                              # (), (V,)
        drafted.append(x)
        q_rows.append(probs)
        q_tok.append(probs[x])
        if i == k - 1 or (stop is not None and stop(int(x), probs)):
            break
        logits = feed(i, x)                                                       # (V,)
    q_draft = torch.stack(q_rows) if keep_q or not sampling.greedy else None      # (n, V)
    return Proposal(torch.stack(drafted), q_draft, torch.stack(q_tok))


class Drafter(ABC):
    name: str = "drafter"
    reads_features: bool = False          # True: drafts from the target's features (the tree loop gives them)
    reads_verdict: bool = False           # True: wants the target's greedy token after every proposed node
    best_first: bool = False              # True: the first n nodes of a proposal are its proposal with budget n
    samples_tokens: bool = False          # True: sampled tokens are draws from q (Proposal.q_draft), not top-k picks
    drafts_on_device: bool = False        # True: has propose_on_device, a tree left on the device (compiled tree loop)

    def check_target(self, target) -> None:
        """Raise ValueError, saying what to do, when this drafter cannot draft for `target`."""

    def device_parts(self) -> tuple:
        """For the compiled chain loop (decoding/compiled.py): (a draft model it may run on the device with static
        caches, or None; the drafter whose proposals it reads on the host, or None). By default the whole drafter
        proposes on the host; one that cannot run there raises ValueError saying what would."""
        return None, self

    def tree_target(self, target):
        """The tree loop's target as this drafter needs it (a TreeTarget): by default the one given, whose features
        are the final hidden states; a drafter that reads other layers (EAGLE-3) wraps it."""
        return target

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        """A new sequence: `prompt_ids` (T,); `features` (T-1, F) of the prompt's cached positions, if read."""

    @abstractmethod
    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> Proposal:
        """At most k draft nodes (a chain or a tree) to follow `tokens` (N,), the committed sequence so far."""

    def commit(self, n_cached: int, features: torch.Tensor | None = None) -> None:
        """The target kept the first `n_cached` tokens; forget state beyond them. `features` (m, F): the
        target's features of the m positions this step added to its cache (None outside the tree loop)."""

    def verdict(self, next_tokens: torch.Tensor) -> None:
        """Tree loop, when `reads_verdict`: the target's greedy token after the root and after each node of the
        last proposal (1+N,), whether the node was accepted or not. Called before `commit`."""

    # B sequences at once (labkit.decoding.batched): the default keeps one copy of this drafter per row.

    def start_rows(self, prompts: list[torch.Tensor], max_len: int) -> None:
        """B new sequences: `prompts`, B tensors (T_b,); `max_len`: the most tokens a row's state may hold."""
        self.__dict__.pop("_rows", None)                 # copies must not carry an earlier batch's rows
        self._rows = [copy.copy(self) for _ in prompts]
        for row, prompt in zip(self._rows, prompts):
            row.start(prompt)

    def propose_rows(self, rows: list[torch.Tensor], k: list[int], sampling: SamplingConfig,
                     generator: torch.Generator | None = None) -> list[Proposal]:
        """Row b's proposal of at most k[b] nodes after its committed tokens rows[b] (N_b,); k[b] = 0: none."""
        return [drafter.propose(tokens, n, sampling, generator) if n > 0 else Proposal.empty(tokens)
                for drafter, tokens, n in zip(self._rows, rows, k)]

    def commit_rows(self, n_cached: list[int]) -> None:
        """The target's cache now holds row b's first n_cached[b] committed tokens."""
        for drafter, n in zip(self._rows, n_cached):
            drafter.commit(n)
