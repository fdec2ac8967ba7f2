"""Medusa-1 drafting (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads"): K small heads on the frozen target's last hidden state, each guessing
one token further ahead (labkit.models.medusa_heads); their top-k guesses fill a static tree that
the target verifies at once.

The tree: `medusa_tree` picks the static tree greedily from the heads' measured top-k accuracy,
as Medusa builds its sparse trees, and `MedusaDrafter` fills it with the heads' top-k tokens.
"""
from __future__ import annotations

import heapq

import torch

from ..core.sampling import SamplingConfig
from ..core.tree import Tree
from ..models.cuda_graph import capture_graph
from ..models.medusa_heads import MedusaHeads
from .base import Drafter, Needs, Proposal


# --- the static tree --------------------------------------------------------------------------------
def rank_accuracy(topk_accuracy: torch.Tensor) -> torch.Tensor:
    """(K, k) P(the right token is head d's rank-r guess) from the cumulative top-1..top-k accuracy (K, k)."""
    topk_accuracy = torch.as_tensor(topk_accuracy, dtype=torch.float64)
    return torch.diff(topk_accuracy, dim=1, prepend=torch.zeros_like(topk_accuracy[:, :1])).clamp(min=0)


def path_value(choice: tuple[int, ...], acc_rank: torch.Tensor) -> float:
    """P(every token on this path is right), heads taken as independent: prod_d acc_rank[d, choice[d]]."""
    return float(torch.prod(torch.stack([acc_rank[d, r] for d, r in enumerate(choice)])))


def medusa_tree(topk_accuracy: torch.Tensor, budget: int) -> list[tuple[int, ...]]:
    """The `budget` paths of highest value (see path_value), greedily, in the order they were added.

    topk_accuracy: (K, k) cumulative top-1..top-k accuracy of each head (as stored in config.json).
    A child's value never exceeds its parent's, so taking the best candidate each time keeps every
    prefix in the tree, and every prefix of the returned list is itself the best tree of its size.
    """
    acc_rank = rank_accuracy(topk_accuracy)                                        # (K, k)
    K, k = acc_rank.shape
    if budget < 1:
        raise ValueError(f"budget must be >= 1 node, got {budget}")
    heap = [(-path_value((r,), acc_rank), (r,)) for r in range(k)]                 # the root's children
    heapq.heapify(heap)
    choices = []
    while heap and len(choices) < budget:
        _, choice = heapq.heappop(heap)
        choices.append(choice)
        if len(choice) < K:
            for r in range(k):
                child = choice + (r,)
                heapq.heappush(heap, (-path_value(child, acc_rank), child))
    return choices


def expected_accepted(choices: list[tuple[int, ...]], topk_accuracy: torch.Tensor) -> float:
    """Expected accepted draft tokens per step: sum of the nodes' path values (siblings are exclusive).

    One more token (the target's own, at the last accepted node) comes with every step.
    """
    acc_rank = rank_accuracy(topk_accuracy)
    return sum(path_value(tuple(c), acc_rank) for c in choices)


def _prefix_ordered(choices: list[tuple[int, ...]]) -> bool:
    """Whether every prefix of the list is prefix-closed (each path's parent comes before it)."""
    seen = set()
    for c in choices:
        if len(c) > 1 and c[:-1] not in seen:
            return False
        seen.add(c)
    return True


# --- the drafter ------------------------------------------------------------------------------------
class MedusaDrafter(Drafter):
    """The heads' top-k tokens in a static tree, from the feature of the last cached position.

    The tree loop's invariant (base.py): the cache holds the committed tokens x_0..x_{n-2}, and the
    last feature we were given is h_{n-2}, whose LM-head output predicted x_{n-1}, the tree's root.
    Head k at position n-2 predicts token n+k: the node at depth d takes head d-1's guesses.
    One sequence at a time (batch size 1).
    """

    def __init__(self, heads: MedusaHeads, choices: list[tuple[int, ...]]):
        choices = [tuple(c) for c in choices]
        # medusa_tree's list is best first (each prefix is the best tree of its size): the tree keeps that order,
        # so the first n nodes of a proposal are the tree of budget n. A hand-written list in another order is
        # sorted by depth, which is prefix-closed but not best first.
        best_first = _prefix_ordered(choices)
        if not best_first:
            choices = sorted(set(choices), key=lambda c: (len(c), c))
        Tree.from_choices(choices)                  # validates: non-empty, prefix-closed
        if max(len(c) for c in choices) > heads.n_heads:
            raise ValueError(f"the choices reach depth {max(len(c) for c in choices)} but there are only "
                             f"{heads.n_heads} heads: drop the deeper paths or load more heads")
        self.heads, self.choices = heads, choices
        self.name = f"medusa{heads.n_heads}"
        self.needs = Needs(features=True, best_first=best_first)
        self.last_feature: torch.Tensor | None = None        # (D,) feature of the last cached position
        self._trees: dict[tuple[int, str], tuple[Tree, torch.Tensor, torch.Tensor]] = {}
        self._graphs: dict[int, tuple] = {}                   # k: (feature buffer, CUDA graph, its outputs)

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        self.last_feature = features[-1] if features is not None and features.shape[0] else None

    def commit(self, n_cached: int, features: torch.Tensor | None = None, verdict: torch.Tensor | None = None) -> None:
        if features is not None and features.shape[0]:
            self.last_feature = features[-1]

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, budget: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> Proposal:
        """The static tree filled with the heads' top-k tokens; deterministic nodes (q_draft None). The tokens stay
        where the heads computed them (a GPU's loop reads them back with its own sync, not one of the drafter's)."""
        if self.last_feature is None or budget < 1:     # a one-token prompt: no cached position yet
            return Proposal.empty(tokens)
        tree, rank, head = self.tree(budget, self.last_feature.device)
        k = 1 + max(c[-1] for c in self.choices[:tree.n_nodes])                 # the deepest rank the tree uses
        top_p, top_ids = self.top_k(self.last_feature, k)                       # (K, k) each
        return Proposal(top_ids[head, rank], q_draft=None, q_token=top_p[head, rank], tree=tree)

    def tree(self, budget: int, device: torch.device | str = "cpu") -> tuple[Tree, torch.Tensor, torch.Tensor]:
        """(tree, rank (N,), head (N,)) of the best `budget` choices; node i = rank[i]-th guess of head[i]. rank and
        head on `device`, kept there (a copy from the host each step would wait for the GPU)."""
        n = min(budget, len(self.choices))
        if (n, str(device)) not in self._trees:
            tree, rank = Tree.from_choices(self.choices[:n], keep_order=True)
            self._trees[n, str(device)] = (tree, rank.to(device), (tree.depth - 1).to(device))
        return self._trees[n, str(device)]

    def top_k(self, feature: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's k likeliest tokens after `feature` (D,) and their probabilities: (K, k) each. On a GPU the
        heads' twenty-odd kernels are recorded once per k as a CUDA graph and replayed (one launch, not twenty)."""
        def picks(x):                                                           # (D,) in the heads' dtype
            return self.heads(x).float().softmax(-1).topk(k, dim=-1)
        if feature.device.type != "cuda":
            return picks(feature.to(self.heads.dtype))
        if k not in self._graphs:
            buffer = feature.to(self.heads.dtype).clone()                                  # (D,)
            graph, out = capture_graph(lambda: picks(buffer))
            self._graphs[k] = (buffer, graph, out)
        buffer, graph, (top_p, top_ids) = self._graphs[k]
        buffer.copy_(feature)
        graph.replay()
        return top_p, top_ids


# --- checkpoints -------------------------------------------------------------------------------------


