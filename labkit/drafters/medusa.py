"""Medusa-1 heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads"): K small heads on the frozen target's last hidden state, each guessing
one token further ahead; their top-k guesses fill a static tree that the target verifies at once.

Head k (0-based) reads the final normed hidden state h_t at position t (the one the target's LM
head turns into token t+1) and predicts token t+2+k:
    h_k = h_t + SiLU(W1_k h_t + b1_k)                 a residual block, W1_k (D, D) zero-initialised
    logits_k = lm_head(h_k)                            the target's LM head, frozen and shared
At initialisation every head therefore says exactly what the LM head says (the token at t+1),
a sane start that training moves one step further per head.

Why W2 is shared: Medusa gives each head its own (V, D) output matrix, initialised from the LM
head. For Qwen2.5-Coder-1.5B that is 151936 x 1536 = 233M parameters (467 MB in bf16) per head:
too big to ship and untrainable in the ~15 CPU minutes this lab spends. Medusa's own code offers
the same shortcut (its heads can reuse the base model's lm_head); only the (D, D) blocks train.

The tree: `medusa_tree` picks the static tree greedily from the heads' measured top-k accuracy,
as Medusa builds its sparse trees, and `MedusaDrafter` fills it with the heads' top-k tokens.
"""
from __future__ import annotations

import heapq
import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.sampling import SamplingConfig
from ..core.shipped import shipped
from ..core.tree import Tree
from ..core.tree_acceptance import TreeAcceptance
from ..core.typical import DELTA, EPSILON, typical_accept
from ..models.backends import swap_modules, weight_dtype
from .base import Drafter, Proposal


class ResBlock(nn.Module):
    """h + SiLU(W h + b), zero-initialised: the identity until trained."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.silu(self.linear(h))


class MedusaHeads(nn.Module):
    """K residual blocks over the target's hidden state, read out by the target's frozen LM head."""

    def __init__(self, lm_head: nn.Linear, n_heads: int = 4):
        super().__init__()
        if n_heads < 1:
            raise ValueError(f"n_heads must be >= 1, got {n_heads}")
        self.dim, self.dtype = lm_head.in_features, weight_dtype(lm_head)
        self.blocks = nn.ModuleList(ResBlock(self.dim) for _ in range(n_heads))
        # the target's own module, on whatever forward path it runs: held outside the module tree
        # (not a submodule, so not saved with the heads and not moved or converted with them)
        self.lm_head = (lm_head,)
        self.blocks.to(self.dtype)

    @property
    def n_heads(self) -> int:
        return len(self.blocks)

    def head_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """(K, *, D): each head's state h_k for hidden (*, D)."""
        return torch.stack([block(hidden) for block in self.blocks])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(K, *, V) logits: head k at position t scores token t+2+k."""
        return self.lm_head[0](self.head_states(hidden))


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
        self.best_first = _prefix_ordered(choices)
        if not self.best_first:
            choices = sorted(set(choices), key=lambda c: (len(c), c))
        Tree.from_choices(choices)                  # validates: non-empty, prefix-closed
        if max(len(c) for c in choices) > heads.n_heads:
            raise ValueError(f"the choices reach depth {max(len(c) for c in choices)} but there are only "
                             f"{heads.n_heads} heads: drop the deeper paths or load more heads")
        self.heads, self.choices = heads, choices
        self.name = f"medusa{heads.n_heads}"
        self.reads_features = True
        self.last_feature: torch.Tensor | None = None        # (D,) feature of the last cached position
        self._trees: dict[int, tuple[Tree, torch.Tensor, torch.Tensor]] = {}

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        self.last_feature = features[-1] if features is not None and features.shape[0] else None

    def commit(self, n_cached: int, features: torch.Tensor | None = None) -> None:
        if features is not None and features.shape[0]:
            self.last_feature = features[-1]

    def tree(self, budget: int) -> tuple[Tree, torch.Tensor, torch.Tensor]:
        """(tree, rank (N,), head (N,)) of the best `budget` choices; node i = rank[i]-th guess of head[i]."""
        n = min(budget, len(self.choices))
        if n not in self._trees:
            tree, rank = Tree.from_choices(self.choices[:n], keep_order=True)
            self._trees[n] = (tree, rank, tree.depth - 1)
        return self._trees[n]

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, budget: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> Proposal:
        """The static tree filled with the heads' top-k tokens; deterministic nodes (q_draft None)."""
        if self.last_feature is None or budget < 1:     # a one-token prompt: no cached position yet
            return Proposal.empty(tokens)
        tree, rank, head = self.tree(budget)
        feature = self.last_feature.to(self.heads.dtype)
        logits = self.heads(feature).float()                                 # (K, V)
        top_p, top_ids = logits.softmax(-1).topk(int(rank.max()) + 1, dim=-1)  # (K, k) each
        return Proposal(top_ids[head, rank].to(tokens.device), q_draft=None, q_token=top_p[head, rank], tree=tree)


def typical_accept_rule(epsilon: float = EPSILON, delta: float = DELTA, temperature: float = 1.0):
    """Medusa's typical acceptance (labkit/core/typical.py) as the tree decoder's accept_rule.

    The rule gets the verify logits (1+N, V) and judges the nodes against softmax(logits / temperature).
    """
    if temperature <= 0:
        raise ValueError(f"typical acceptance needs a temperature > 0 (its entropy is of softmax(logits / T)), "
                         f"got {temperature}")

    def rule(tree: Tree, node_tokens: torch.Tensor, target_logits: torch.Tensor) -> TreeAcceptance:
        p_target = (target_logits.float() / temperature).softmax(-1)                # (1+N, V)
        return typical_accept(p_target, tree, node_tokens, epsilon, delta)
    return rule


# --- checkpoints -------------------------------------------------------------------------------------
# <dir>/model.safetensors: blocks.{k}.linear.weight (D, D), .bias (D,), bf16 (~19 MB for 4 heads of D=1536);
# <dir>/config.json: n_heads, dim, base_model, topk_accuracy, choices, training record; <dir>/PROVENANCE.md
REPO_HEADS = shipped("heads", must_exist=False)     # the shipped heads (core/shipped.py)
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def save_medusa(heads: MedusaHeads, out_dir: str | Path, meta: dict, provenance: str | None = None,
                dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the blocks' weights (in `dtype`), config.json (meta + n_heads, dim) and PROVENANCE.md."""
    from safetensors.torch import save_file
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in heads.state_dict().items()}
    save_file(state, str(out_dir / WEIGHTS), metadata={"format": "pt"})
    config = {"n_heads": heads.n_heads, "dim": heads.dim, **meta}
    (out_dir / CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    if provenance is not None:
        (out_dir / "PROVENANCE.md").write_text(provenance)
    return out_dir


def load_medusa(path: str | Path, target) -> tuple[MedusaHeads, dict]:
    """(heads on `target`'s LM head, config) from a directory written by save_medusa."""
    from safetensors.torch import load_file
    path = Path(path)
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise FileNotFoundError(f"{path} has no {CONFIG} + {WEIGHTS}: point at a directory written by save_medusa "
                                "(the shipped heads: data/heads/medusa-qwen2.5-coder-1.5b)")
    config = json.loads((path / CONFIG).read_text())
    D = target.args.dim
    if config["dim"] != D:
        raise ValueError(f"heads in {path} were trained for hidden size {config['dim']}, but this target has {D}: "
                         f"they belong to {config.get('base_model', 'another model')}")
    heads = MedusaHeads(target.lm_head, config["n_heads"])
    state = load_file(str(path / WEIGHTS))
    heads.load_state_dict({k: v.to(heads.dtype) for k, v in state.items()})
    heads = heads.to(target.device).eval().requires_grad_(False)
    swap_modules(heads.blocks, target.path)          # the residual blocks on the target's forward path
    return heads, config
