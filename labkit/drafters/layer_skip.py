"""Layer-skip self-speculation: the target drafts for itself with some of its layers skipped.

Draft & Verify (Zhang et al. 2024) and SWIFT (Xia et al. 2025): one model in memory, which suits
a small machine. The draft is `LayerSkipModel(target, skip)` (labkit.models.layer_skip), the same
weights minus some blocks, drafting a chain like any draft model; the target verifies it, so
greedy output is the target's own and sampling keeps its distribution.

Which layers to skip is found here, on this machine (`search_skip_layers`): a greedy search over
a calibration text, as Draft & Verify does offline (they use Bayesian optimisation; SWIFT
searches on the fly while decoding). Each round skips the one more layer that keeps the skipped
model's teacher-forced top-1 agreement with the target highest; then each depth's one-token
forward is timed, its cost ratio c measured against the target's, and Leviathan's formula
(with the measured verify cost of γ+1 tokens) picks the depth and γ with the best predicted
speedup. Agreement stands in for the acceptance rate α: under greedy decoding a draft token is
accepted exactly when it is the target's argmax.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from ..core.adaptive import expected_speedup
from ..models.calibrate import time_forwards
from ..models.layer_skip import LayerSkipModel
from ..models.transformer import Transformer
from .draft_model import DraftModelDrafter

GAMMAS = (1, 2, 3, 4, 6, 8)


@dataclass
class SkipSearch:
    """What the search found: the skip order, and per depth the agreement, the cost and the predicted speedup."""
    order: list[int]                 # layers in the order the search skipped them
    agreement: list[float]           # [i]: top-1 agreement with the target with order[:i+1] skipped
    cost: list[float]                # [i]: one-token forward with order[:i+1] skipped / the target's
    verify_cost: dict[int, float]    # γ -> a (γ+1)-token target forward / a one-token one
    predicted: list[dict[int, float]] = field(default_factory=list)   # [i]: γ -> Leviathan's speedup
    calibration_tokens: int = 0

    def __post_init__(self):
        if not self.predicted:
            self.predicted = [{g: expected_speedup(min(a, 0.999), g, c, self.verify_cost[g]) for g in self.verify_cost}
                              for a, c in zip(self.agreement, self.cost)]

    @property
    def best(self) -> tuple[int, int]:
        """(layers skipped, γ) with the highest predicted speedup."""
        return max(((i + 1, g) for i, row in enumerate(self.predicted) for g in row),
                   key=lambda ig: self.predicted[ig[0] - 1][ig[1]])

    @property
    def skip(self) -> tuple[int, ...]:
        return tuple(sorted(self.order[: self.best[0]]))

    @property
    def gamma(self) -> int:
        return self.best[1]

    def to_dict(self) -> dict:
        n, g = self.best
        return {**asdict(self), "chosen": {"skip": list(self.skip), "n_skipped": n, "gamma": g,
                                           "agreement": self.agreement[n - 1], "cost": self.cost[n - 1],
                                           "predicted_speedup": self.predicted[n - 1][g]}}


@torch.no_grad()
def agreement(model, ids: torch.Tensor, reference: torch.Tensor) -> float:
    """Teacher-forced top-1 agreement of `model`'s next-token argmax with `reference` (T,) over ids (T,)."""
    cache = model.new_cache(max_len=ids.numel())
    guess = model(ids[None].to(model.device), cache)[0].argmax(-1).cpu()                 # (T,)
    return float((guess == reference).float().mean())


@torch.no_grad()
def search_skip_layers(target: Transformer, calibration_ids: torch.Tensor, max_skip: int | None = None,
                       gammas: tuple[int, ...] = GAMMAS, repeats: int = 3, progress: bool = True) -> SkipSearch:
    """Greedy layer-skip search on this machine: which layers, how many, and γ (see the module docstring).

    calibration_ids: (T,) token ids the target reads teacher-forced (a few hundred are enough);
    max_skip: the deepest skip tried (default: half the layers).
    """
    n = target.args.n_layers
    max_skip = n // 2 if max_skip is None else max_skip
    if not 1 <= max_skip < n:
        raise ValueError(f"max_skip must be in [1, {n - 1}] for a {n}-layer target, got {max_skip}")
    ids = torch.as_tensor(calibration_ids).long().flatten()
    if ids.numel() < 16:
        raise ValueError(f"calibrate on at least 16 tokens, got {ids.numel()}: pass a longer text")
    reference = target(ids[None].to(target.device), target.new_cache(max_len=ids.numel()))[0].argmax(-1).cpu()
    order, agree = [], []
    for _ in tqdm(range(max_skip), desc="layer-skip search", disable=not progress):
        scores = {layer: agreement(LayerSkipModel(target, order + [layer]), ids, reference)
                  for layer in range(n) if layer not in order}
        layer = max(scores, key=lambda i: (scores[i], -i))                 # ties: the lower layer
        order.append(layer)
        agree.append(scores[layer])
    context = min(256, target.max_seq_len // 2)
    full = time_forwards(target, context, tuple(sorted({1, *(g + 1 for g in gammas)})), repeats, progress=False)
    cost = [time_forwards(LayerSkipModel(target, order[: i + 1]), context, (1,), repeats, progress=False)[1] / full[1]
            for i in tqdm(range(max_skip), desc="timing the skipped models", disable=not progress)]
    return SkipSearch(order, agree, cost, {g: full[g + 1] / full[1] for g in gammas},
                      calibration_tokens=ids.numel())


def calibration_ids(tokenizer, n_tokens: int = 256) -> torch.Tensor:
    """Calibration text on every machine: Python's own `textwrap.py` (code, and English in its docstrings)."""
    import inspect
    import textwrap
    ids = tokenizer(inspect.getsource(textwrap), add_special_tokens=False)["input_ids"][:n_tokens]
    return torch.tensor(ids)


class LayerSkipDrafter(DraftModelDrafter):
    """The target minus the layers in `skip`, drafting a chain for the target it was cut from."""
    name = "layer-skip"

    def __init__(self, target: Transformer, skip: tuple[int, ...], stop_below: float | None = None,
                 eos_token_ids: tuple[int, ...] = ()):
        super().__init__(LayerSkipModel(target, skip), stop_below, eos_token_ids)

    def check_target(self, target) -> None:
        if target is not self.model.target:
            raise ValueError("a layer-skip drafter drafts for the model it was built from: build it with "
                             "LayerSkipDrafter(target, skip) for this target")
