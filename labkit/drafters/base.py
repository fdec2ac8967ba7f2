"""The one interface every drafter implements: propose tokens after the committed ones.

A proposal is a tree of draft tokens whose root is the last committed token; a chain is the
tree with one child per node, and most drafters (a draft model, prompt lookup, MTP heads) propose
chains. The decoding loops (labkit.decoding) call, per sequence:

    start(prompt_ids, features)            once, after the target's prefill
    propose(tokens, k, sampling)           once per step: at most k nodes to follow the committed `tokens`
    commit(n_cached, features, verdict)    after the target has decided: the target's cache now holds the
                                           first n_cached committed tokens (all but the last); `features`
                                           are the target's features of the positions the step added and
                                           `verdict` its greedy token after every proposed node (each None
                                           where the drafter does not read it or the loop has none)

and, before the first, `check_target(target)`, which refuses a target the drafter cannot draft for.
A drafter with state (a KV cache) drops what was rejected in `commit`. The drafter sees token ids,
never text.

What a drafter asks of the loop it runs in is one declared record, `needs` (a `Needs`): the
target's features (Medusa, EAGLE: only the tree loops, which run labkit's own model, give them),
the verdict on every node (lookahead's Jacobi window), proposals listed best first (what lets a
cost-aware budget price smaller trees from one step), sampled tokens, a target of its own
(EAGLE-3's taps), and the faster paths some loops offer: a draft model the compiled chain loop
runs on the device, a tree drafted on the device for the compiled tree loop, every row of a batch
drafted in one forward. Each of those paths is a protocol of the loop that uses it, written down
there (decoding/compiled.py, compiled_tree.py, batched.py); no loop names a drafter's class.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
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


@dataclass(frozen=True)
class Needs:
    """What a drafter asks of the loop that runs it; the default, a chain drafter on token ids, runs in every loop."""
    features: bool = False            # drafts from the target's features (start's and commit's `features`): tree loops
    verdict: bool = False             # the target's greedy token after every proposed node (commit's `verdict`)
    best_first: bool = False          # the first n nodes of a proposal are its proposal with budget n
    samples_tokens: bool = False      # when sampling, its tokens are draws from q (Proposal.q_draft), not top-k picks
    target: Callable | None = None    # the tree target it reads, made from the plain one (EAGLE-3's taps); None: plain
    device: str | None = None         # "model": a draft model the compiled chain loop may run on the device, from
                                      #   device_parts() (decoding/compiled.py); "tree": a tree drafted on the
                                      #   target's device by propose_on_device() (decoding/compiled_tree.py)
    rows: bool = False                # drafts every row of a batch in one forward: rows(prompts, max_len)
                                      #   (decoding/batched.py); otherwise the batch keeps a copy per row

    def __post_init__(self):
        if self.device not in (None, "model", "tree"):
            raise ValueError(f"Needs.device must be None, 'model' or 'tree', got {self.device!r}")


class Drafter(ABC):
    name: str = "drafter"
    needs: Needs = Needs()

    def check_target(self, target) -> None:
        """Raise ValueError, saying what to do, when this drafter cannot draft for `target`."""

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        """A new sequence: `prompt_ids` (T,); `features` (T-1, F) of the prompt's cached positions, if read."""

    @abstractmethod
    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> Proposal:
        """At most k draft nodes (a chain or a tree) to follow `tokens` (N,), the committed sequence so far."""

    def commit(self, n_cached: int, features: torch.Tensor | None = None, verdict: torch.Tensor | None = None) -> None:
        """The target kept the first `n_cached` tokens; forget state beyond them. `features` (m, F): the target's
        features of the m positions this step added to its cache (when `needs.features`, and in the tree loops).
        `verdict` (1+N,): when `needs.verdict`, the target's greedy token after the root and after each node of the
        last proposal, whether the node was accepted or not."""


def tree_target(drafter: Drafter, target):
    """The tree loops' target as `drafter` reads it: the one given, or the one its needs name (EAGLE-3's taps)."""
    return target if drafter.needs.target is None else drafter.needs.target(target)
