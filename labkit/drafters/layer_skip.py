"""Layer-skip self-speculation: the target drafts for itself with some of its layers skipped.

Draft & Verify (Zhang et al. 2024) and SWIFT (Xia et al. 2025): one model in memory, which suits
a small machine. The draft is `LayerSkipModel(target, skip)` (labkit.models.layer_skip), the same
weights minus some blocks, drafting a chain like any draft model; the target verifies it, so
greedy output is the target's own and sampling keeps its distribution.

Which layers to skip is found on this machine (labkit.models.layer_skip.search_skip_layers): a greedy search over
a calibration text, as Draft & Verify does offline (they use Bayesian optimisation; SWIFT
searches on the fly while decoding). Each round skips the one more layer that keeps the skipped
model's teacher-forced top-1 agreement with the target highest; then each depth's one-token
forward is timed, its cost ratio c measured against the target's, and Leviathan's formula
(with the measured verify cost of γ+1 tokens) picks the depth and γ with the best predicted
speedup. Agreement stands in for the acceptance rate α: under greedy decoding a draft token is
accepted exactly when it is the target's argmax.
"""
from __future__ import annotations

from ..models.layer_skip import LayerSkipModel
from ..models.transformer import Transformer
from .draft_model import DraftModelDrafter


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
