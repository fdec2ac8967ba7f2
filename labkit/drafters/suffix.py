"""Suffix decoding (Oliaro et al., NeurIPS 2025): draft a token tree from what followed before. No model.

Prompt lookup copies the one continuation of the latest earlier match. Suffix decoding keeps
*every* substring seen so far, with how often each was followed by each token, and proposes a
tree of the likeliest continuations:

1. Index. A `SuffixTrie` holds every substring of up to `max_pattern + max_depth` tokens of the
   sequences it was given, each node counting its occurrences. There are two: one over this
   request (prompt and output so far, extended as tokens are committed), one over earlier
   outputs (`observe`, and, with `remember=True`, each finished request's output).
2. Match. The longest suffix of the committed tokens (at most `max_pattern`) that occurred
   before with a continuation: its node in the trie.
3. Speculate. From that node, grow a tree best-first. A child's score is its parent's score
   times the child's share of the parent's continuations (count / sum of sibling counts), an
   estimate of the probability that the whole path is right; the sum of the scores is the
   expected number of accepted tokens. Nodes below `min_prob` are not added, and the tree holds
   at most `spec_factor x match length` nodes: a long match earns a long speculation (the
   paper's adaptive speculation length).
4. Choose. Of the request's tree and the earlier outputs' tree, the one with the higher score.

The tree is verified by the tree decoder (labkit.decoding.tree) like any tree drafter, so
greedy output equals autoregressive output and sampling keeps the target's distribution (the
nodes are deterministic picks: rejection sampling treats each as a one-hot draft).

Here the index is a depth-bounded suffix trie (each committed token adds at most one node per
depth), not the paper's compressed suffix tree: simpler to read, the same counts.
"""
from __future__ import annotations

import heapq
import math

import torch

from ..core.sampling import SamplingConfig
from ..core.tree import Tree
from .base import Drafter, Needs, Proposal


class _Node:
    __slots__ = ("count", "children")

    def __init__(self):
        self.count = 0                                  # occurrences of the substring ending here
        self.children: dict[int, _Node] | None = None   # next token -> node

    def child(self, token: int) -> "_Node":
        if self.children is None:
            self.children = {}
        node = self.children.get(token)
        if node is None:
            node = self.children[token] = _Node()
        return node


class SuffixTrie:
    """Every substring (up to `max_len` tokens) of the sequences added, with occurrence counts.

        trie = SuffixTrie(max_len=24)
        seq = trie.new_sequence()
        trie.extend(seq, [5, 6, 7, 5, 6])          # appends; a sequence can be extended again later
        node = trie.find([5, 6])                   # node.count == 2, node.children == {7: ...}
    """

    def __init__(self, max_len: int):
        if not isinstance(max_len, int) or max_len < 2:
            raise ValueError(f"max_len (longest substring indexed) must be an integer >= 2, got {max_len!r}")
        self.root, self.max_len, self.n_tokens = _Node(), max_len, 0

    def new_sequence(self) -> list[_Node]:
        """A cursor for one sequence: the nodes of its suffixes of length 1 .. max_len-1 (none yet)."""
        return []

    def extend(self, cursor: list[_Node], tokens: list[int]) -> None:
        """Append `tokens` to the sequence of `cursor`: every new substring ending at each token is counted."""
        for token in tokens:
            nodes = [self.root.child(token)] + [n.child(token) for n in cursor[: self.max_len - 1]]
            for node in nodes:
                node.count += 1
            cursor[:] = nodes                           # suffix of length i+1 at index i
            self.n_tokens += 1

    def find(self, pattern: list[int]) -> _Node | None:
        """The node of `pattern`, or None when it never occurred."""
        node = self.root
        for token in pattern:
            if node.children is None or token not in node.children:
                return None
            node = node.children[token]
        return node

    def match(self, context: list[int], max_pattern: int) -> tuple[_Node | None, int]:
        """The longest suffix of `context` (at most max_pattern tokens) that occurred with a continuation:
        (its node, its length), or (None, 0)."""
        for p in range(min(max_pattern, len(context), self.max_len - 1), 0, -1):
            node = self.find(context[-p:])
            if node is not None and node.children:
                return node, p
        return None, 0


def speculate(node: _Node, max_nodes: int, max_depth: int, min_prob: float) -> tuple[list[int], list[int], list[float]]:
    """Best-first tree from `node`: (tokens, parents, scores), parents before children, scores = path probability."""
    tokens, parents, scores = [], [], []
    frontier: list[tuple[float, int, int, int, _Node]] = []           # (-score, tie-break, parent index, token, node)
    tie = 0

    def push(parent_node: _Node, parent_index: int, parent_score: float, depth: int) -> None:
        nonlocal tie
        if not parent_node.children or depth >= max_depth:
            return
        total = sum(c.count for c in parent_node.children.values())
        for token, child in parent_node.children.items():
            score = parent_score * child.count / total
            if score >= min_prob:
                heapq.heappush(frontier, (-score, tie, parent_index, token, child))
                tie += 1

    depth_of = []
    push(node, -1, 1.0, 0)
    while frontier and len(tokens) < max_nodes:
        neg_score, _, parent, token, child = heapq.heappop(frontier)
        tokens.append(token)
        parents.append(parent)
        scores.append(-neg_score)
        depth_of.append(1 if parent < 0 else depth_of[parent] + 1)
        push(child, len(tokens) - 1, -neg_score, depth_of[-1])
    return tokens, parents, scores


class SuffixDrafter(Drafter):
    """Suffix decoding: a tree of the likeliest continuations of the longest matching suffix (no model)."""
    name = "suffix"
    needs = Needs(best_first=True)      # grown best first: the first n nodes are the tree of budget n

    def __init__(self, max_pattern: int = 12, max_depth: int = 16, spec_factor: float = 2.0, min_prob: float = 0.1,
                 remember: bool = False):
        """max_pattern: longest suffix matched; max_depth: deepest speculation; spec_factor: nodes per matched
        token; min_prob: the least path probability a node needs; remember: add each finished request's output
        to the earlier-outputs index (as a server does across requests)."""
        for name, value in (("max_pattern", max_pattern), ("max_depth", max_depth)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not (isinstance(spec_factor, (int, float)) and spec_factor > 0):
            raise ValueError(f"spec_factor (tree nodes per matched token) must be > 0, got {spec_factor!r}")
        if not (isinstance(min_prob, (int, float)) and 0 <= min_prob < 1):
            raise ValueError(f"min_prob must be in [0, 1), got {min_prob!r}")
        self.max_pattern, self.max_depth = max_pattern, max_depth
        self.spec_factor, self.min_prob = spec_factor, min_prob
        self.remember = remember
        self.earlier = SuffixTrie(max_pattern + max_depth)              # earlier outputs, kept across requests
        self.local: SuffixTrie | None = None
        self.prompt_len = 0

    def observe(self, token_ids) -> None:
        """Index a token sequence (an earlier output, a document the answers will quote) for later requests."""
        tokens = torch.as_tensor(token_ids).flatten().tolist()
        self.earlier.extend(self.earlier.new_sequence(), tokens)

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        if self.remember and self.local is not None:
            self.observe(self.seen[self.prompt_len:])                   # the previous request's output
        self.local = SuffixTrie(self.max_pattern + self.max_depth)
        self.cursor, self.seen, self.prompt_len = self.local.new_sequence(), [], prompt_ids.numel()

    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> Proposal:
        if self.local is None:
            raise ValueError("call start(prompt_ids) before propose: the suffix drafter indexes the prompt first")
        context = tokens.tolist()
        self.local.extend(self.cursor, context[len(self.seen):])       # the tokens committed since the last step
        self.seen = context
        best = ([], [], [])
        for trie in (self.local, self.earlier):
            node, p = trie.match(context, self.max_pattern)
            if node is None:
                continue
            tree = speculate(node, min(k, math.ceil(self.spec_factor * p)), self.max_depth, self.min_prob)
            if sum(tree[2]) > sum(best[2]):
                best = tree
        if not best[0]:
            return Proposal.empty(tokens)
        nodes, parents, scores = best
        return Proposal(torch.tensor(nodes), None, torch.tensor(scores), Tree(torch.tensor(parents)))
