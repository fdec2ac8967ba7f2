"""Lookahead decoding (Fu et al., ICML 2024): Jacobi iterations ride along in the verify forward. No model.

Jacobi decoding guesses the next W tokens and lets the target improve all W guesses at once,
each from the guesses before it; a guess that a pass leaves unchanged has converged. Lookahead
decoding keeps the last N-1 iterations of such guesses as a 2D window and harvests n-grams from it:

    window (N-1, W)   level 0 is the oldest guess, level N-2 the newest; the cell at level j,
                      column i stands at position root + 1 + i + j and sees the root, level 0's
                      cells 0..i and its own column's cells at levels 1..j-1 (a Jacobi trajectory)
    pool              n-grams, keyed by their first token: each column's trajectory plus the
                      target's next token after its newest cell (N tokens), at most G per key

Each step proposes one tree, verified by the tree decoder in one target forward:

1. Verification branch: the pool's n-grams that start with the last committed token (the root):
   up to G candidate continuations of N-1 tokens.
2. Lookahead branch: the window itself. Each cell's attention is exactly its ancestors in a tree
   (level 0 is a chain from the root, each column hangs off its level-0 cell), so the window is
   just more tree nodes with the usual tree mask and positions; identical paths share a node.
3. The target's verdict on every node (commit's `verdict`): the tokens after the newest level's cells are
   the next Jacobi iteration. Every column gives an n-gram for the pool; the levels shift up.
4. Commit: after s committed tokens the root moved s places, so the window slides s-1 columns
   left (one place is the level shift) and the freed columns take tokens of the context.

The candidates are checked like any tree, so greedy output equals autoregressive output and
sampling keeps the target's distribution (nodes are deterministic picks: one-hot drafts). The
Jacobi update reads the target's greedy tokens also when sampling; the pool only feeds drafts.

The window costs (N-1)·W extra tokens in every verify forward. On a GPU that forward costs
about one token's; on a CPU each extra token costs something (the verify-cost curve), so a
small window suits it. The level-0 chain is a candidate too: Jacobi's own guesses can be accepted.
"""
from __future__ import annotations

import torch

from ..core.sampling import SamplingConfig
from ..core.tree import Tree
from .base import Drafter, Needs, Proposal


class NGramPool:
    """At most `per_key` n-grams for each first token, the most recent first; a repeat moves to the front."""

    def __init__(self, per_key: int):
        self.per_key, self.grams = per_key, {}

    def add(self, first: int, rest: tuple[int, ...]) -> None:
        grams = self.grams.setdefault(first, [])
        if rest in grams:
            grams.remove(rest)
        grams.insert(0, rest)
        del grams[self.per_key:]

    def get(self, first: int) -> list[tuple[int, ...]]:
        return self.grams.get(first, [])

    def __len__(self) -> int:
        return sum(map(len, self.grams.values()))


class _TrieBuilder:
    """Token paths from the root merged into one tree: a path's node is made once (parents before children)."""

    def __init__(self):
        self.tokens, self.parents, self.index = [], [], {}

    def child(self, parent: int, token: int) -> int:
        key = (parent, token)
        if key not in self.index:
            self.index[key] = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
        return self.index[key]


class LookaheadDrafter(Drafter):
    """Lookahead decoding: a Jacobi window of W columns and N-1 levels, and an n-gram pool of up to G per key."""
    name = "lookahead"
    needs = Needs(verdict=True)

    def __init__(self, window: int = 5, ngram: int = 4, max_verify: int = 5, pool_from_prompt: bool = False,
                 seed: int = 0):
        """window W: Jacobi guesses per level; ngram N: n-gram length (the window holds N-1 levels); max_verify G:
        pool n-grams verified a step; pool_from_prompt: also fill the pool with the prompt's n-grams (the
        reference implementation's option; it adds prompt lookup's strength); seed: the window's initial guesses,
        random tokens of the prompt, are drawn with it."""
        for name, value, least in (("window", window, 1), ("ngram", ngram, 2), ("max_verify", max_verify, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        self.W, self.N, self.G = window, ngram, max_verify
        self.pool_from_prompt, self.seed = pool_from_prompt, seed
        self.window: torch.Tensor | None = None          # (N-1, W) Jacobi guesses, level 0 the oldest
        self.cells: torch.Tensor | None = None           # (N-1, W) node of each cell in the pending proposal

    @property
    def window_nodes(self) -> int:
        """Tree nodes the lookahead branch adds to every verify forward: (N-1)·W."""
        return (self.N - 1) * self.W

    def check_target(self, target) -> None:
        if self.N + self.W >= target.max_seq_len:
            raise ValueError(f"a lookahead window of W={self.W} columns and n-grams of N={self.N} reach "
                             f"{self.N + self.W} positions past the last token, more than the target's context of "
                             f"{target.max_seq_len}: choose a smaller window or ngram")

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        self.context = prompt_ids.flatten().tolist()
        self.gen = torch.Generator().manual_seed(self.seed)
        self.pool = NGramPool(self.G)
        self.window, self.cells = self._guesses((self.N - 1, self.W)), None
        if self.pool_from_prompt:
            for i in range(len(self.context) - self.N + 1):
                self.pool.add(self.context[i], tuple(self.context[i + 1: i + self.N]))

    def _guesses(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Random tokens of the context: the initial guesses the paper uses (the window converges from them)."""
        pick = torch.randint(len(self.context), shape, generator=self.gen)
        return torch.tensor(self.context)[pick]

    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> Proposal:
        if self.window is None:
            raise ValueError("call start(prompt_ids) before propose: the lookahead window starts from the prompt")
        self.context = tokens.tolist()
        tree = _TrieBuilder()
        for gram in self.pool.get(self.context[-1]):                      # 1. verification branch
            node = -1
            for token in gram:
                node = tree.child(node, token)
        cells = torch.full((self.N - 1, self.W), -1)                      # (N-1, W)
        if len(tree.tokens) + self.window_nodes <= k:                     # 2. lookahead branch (when it fits)
            node = -1
            for i in range(self.W):
                node = cells[0, i] = tree.child(node, int(self.window[0, i]))   # level 0: a chain from the root
            for j in range(1, self.N - 1):
                for i in range(self.W):
                    cells[j, i] = tree.child(int(cells[j - 1, i]), int(self.window[j, i]))
        self.cells = cells if bool((cells >= 0).all()) else None
        if not tree.tokens:
            return Proposal.empty(tokens)
        return Proposal(torch.tensor(tree.tokens), tree=Tree(torch.tensor(tree.parents)))

    def iterate(self, next_tokens: torch.Tensor) -> None:
        """3. One Jacobi iteration from the verdict (1+N,): the target's token after each newest-level cell; harvest
        n-grams, shift levels."""
        if self.cells is None:
            return
        new = next_tokens[1 + self.cells[-1]]                             # (W,) the next guess of every column
        trajectories = torch.cat([self.window, new[None]])                # (N, W) each column: an n-gram
        for column in trajectories.T.tolist():
            self.pool.add(column[0], tuple(column[1:]))
        self.window = trajectories[1:]                                    # (N-1, W) level j <- level j+1

    def commit(self, n_cached: int, features: torch.Tensor | None = None, verdict: torch.Tensor | None = None) -> None:
        """3. iterate on the verdict, then 4. slide the window with the root: s committed tokens move it s places,
        one of them the level shift."""
        if verdict is not None:
            self.iterate(verdict)
        shift = n_cached - (len(self.context) - 1) - (1 if self.cells is not None else 0)
        if shift > 0:
            keep = self.window[:, min(shift, self.W):]                    # (N-1, W-shift)
            self.window = torch.cat([keep, self._guesses((self.N - 1, self.W - keep.shape[1]))], dim=1)
        self.cells = None


