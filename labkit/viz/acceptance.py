"""The acceptance views of a run: accept lengths against the i.i.d. model, and acceptance per draft position.

They read DraftCounts, so a labkit run (Trace.draft_counts), a benchmark record and a vLLM server's metrics
(labkit.bench.vllm_metrics) are drawn alike.
"""
from __future__ import annotations

import numpy as np
from matplotlib.ticker import MaxNLocator

from ..core.engine_counts import DraftCounts
from .calculator import iid_accept_distribution


def conditional_rates(counts: DraftCounts) -> np.ndarray:
    """[i]: drafts that kept token i among those that kept tokens 0..i-1 (the i.i.d. model's α at every i)."""
    reached = np.array((counts.drafts, *counts.accepted_per_position[:-1]), float)       # (γ,)
    kept = np.array(counts.accepted_per_position, float)                                 # (γ,)
    return np.divide(kept, reached, out=np.full(counts.gamma, np.nan), where=reached > 0)


def plot_acceptance(counts: DraftCounts, axes, label: str = "measured") -> dict:
    """Two panels: the share of drafts accepting n tokens beside the i.i.d. model at the judged α; per position the
    engines' unconditional rate and the conditional one. Returns the numbers drawn."""
    if not counts.drafts:
        raise ValueError("these counts hold no draft: nothing to draw (was speculative decoding on?)")
    ax_len, ax_pos = axes
    alpha, observed, conditional = counts.judged_alpha, counts.accept_length_counts, conditional_rates(counts)
    model = iid_accept_distribution(alpha, [counts.gamma])                                # (γ + 1,)
    n = np.arange(counts.gamma + 1)
    ax_len.bar(n - 0.2, observed / counts.drafts, 0.4, color="#6cc36a", label=f"{label}, {counts.drafts:,} drafts")
    ax_len.bar(n + 0.2, model, 0.4, color="#bbbbbb", label=f"i.i.d. model, α = {alpha:.2f}")
    ax_len.set_xlabel("draft tokens accepted in a step")
    ax_len.set_ylabel("share of drafts")
    ax_len.set_title(f"mean acceptance length {counts.mean_acceptance_length:.2f}", fontsize="medium")
    ax_len.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_len.legend(fontsize="small", frameon=False)
    pos = np.arange(1, counts.gamma + 1)
    ax_pos.plot(pos, counts.per_position_rate, "o-", color="#5b8fd6", label="per-position rate (vLLM's)")
    ax_pos.plot(pos, conditional, "s--", color="#e08a3c", label="given the earlier ones kept")
    ax_pos.plot(pos, alpha ** pos, ":", color="grey", label=f"α^i, α = {alpha:.2f}")
    ax_pos.set_xlabel("draft position i")
    ax_pos.set_ylabel("acceptance")
    ax_pos.set_ylim(0, 1.05)
    ax_pos.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_pos.legend(fontsize="small", frameon=False, loc="lower left")
    return {"alpha": alpha, "gamma": counts.gamma, "mean_acceptance_length": counts.mean_acceptance_length,
            "shares": (observed / counts.drafts).tolist(), "iid": model.tolist(),
            "per_position": counts.per_position_rate.tolist(), "conditional": conditional.tolist()}
