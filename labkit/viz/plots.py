"""The plots the notebooks draw from traces and distributions (matplotlib), and the numbers behind them.

Each `plot_*` draws on an axes it is given and returns it; the counting and the probability
decomposition they draw are plain functions, tested on their own.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from matplotlib.ticker import MaxNLocator

from ..core.trace import CacheLengths, Trace

COLOURS = {"accepted": "#6cc36a", "rejected": "#e57373", "target": "#5b8fd6", "draft": "#f0a030",
           "residual": "#9b6cc3", "kept": "#bbbbbb"}


# ---- one position: what the acceptance rule does with p_target and q_draft ----

@dataclass(frozen=True)
class AcceptanceParts:
    """P(output = x) = min(p, q)(x) + (1 - β) · residual(x) = p_target(x), split in its two routes."""
    accepted: torch.Tensor     # (V,) min(p_target, q_draft): drafted x and kept
    residual: torch.Tensor     # (V,) norm(max(0, p_target - q_draft)): drawn after a rejection
    beta: float                # acceptance probability of one draft token: sum of min(p, q)

    @property
    def output(self) -> torch.Tensor:
        """(V,) the distribution of the committed token; equals p_target (Leviathan et al., Theorem 1)."""
        return self.accepted + (1 - self.beta) * self.residual


def acceptance_parts(p_target: torch.Tensor, q_draft: torch.Tensor) -> AcceptanceParts:
    """Split speculative sampling's output at one position (p_target, q_draft: (V,)) into its two routes."""
    if p_target.shape != q_draft.shape or p_target.dim() != 1:
        raise ValueError(f"p_target and q_draft must be two (V,) distributions, got {tuple(p_target.shape)} "
                         f"and {tuple(q_draft.shape)}")
    p, q = p_target.double(), q_draft.double()
    accepted = torch.minimum(p, q)                                          # (V,)
    beta = float(accepted.sum())
    left = (p - q).clamp(min=0)                                             # (V,)
    residual = left / left.sum() if left.sum() > 0 else p
    return AcceptanceParts(accepted, residual, beta)


def plot_distributions(p_target: torch.Tensor, q_draft: torch.Tensor, token_ids: list[int], labels: list[str], ax):
    """p_target beside q_draft (both (V,)) at the tokens `token_ids`, named by `labels`."""
    x, idx = np.arange(len(labels)), torch.tensor(token_ids)
    ax.bar(x - 0.2, p_target[idx].numpy(), 0.4, color=COLOURS["target"], label="p_target")
    ax.bar(x + 0.2, q_draft[idx].numpy(), 0.4, color=COLOURS["draft"], label="q_draft")
    ax.set_xticks(x, labels, rotation=60, fontsize="small")
    ax.set_ylabel("probability")
    ax.set_title("the two distributions")
    ax.set_ylim(0, 1.15 * float(max(p_target[idx].max(), q_draft[idx].max())))
    ax.legend(fontsize="small", frameon=False)
    return ax


def plot_routes(parts: AcceptanceParts, token_ids: list[int], labels: list[str], ax):
    """p_target(x) as two stacked bars: min(p, q) (drafted and accepted) + (1-β)·residual (resampled)."""
    x = np.arange(len(labels))
    idx = torch.tensor(token_ids)
    kept, resampled = parts.accepted[idx].numpy(), ((1 - parts.beta) * parts.residual[idx]).numpy()
    ax.bar(x, kept, color=COLOURS["accepted"], label="min(p, q): drafted and kept")
    ax.bar(x, resampled, bottom=kept, color=COLOURS["residual"], label="(1-β)·residual: resampled")
    ax.set_xticks(x, labels, rotation=60, fontsize="small")
    ax.set_ylabel("probability")
    ax.set_title(f"where the output comes from (β = {parts.beta:.2f})")
    ax.set_ylim(0, 1.15 * float((kept + resampled).max()))           # the tallest bar inside the frame
    ax.legend(fontsize="small", frameon=False)
    return ax


# ---- a run: steps, acceptance lengths, positions ----

def plot_steps(trace: Trace, ax):
    """Per target forward: accepted draft tokens, the target's own token, and the rejected ones above."""
    steps = trace.steps
    x = np.arange(1, len(steps) + 1)
    acc = np.array([s.n_accepted for s in steps])
    rej = np.array([s.gamma - s.n_accepted for s in steps])
    ax.bar(x, acc, color=COLOURS["accepted"], label="accepted")
    ax.bar(x, np.ones(len(steps)), bottom=acc, color=COLOURS["target"], label="target's token")
    ax.bar(x, rej, bottom=acc + 1, color=COLOURS["rejected"], alpha=0.6, hatch="//", label="rejected")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step (target forward)")
    ax.set_ylabel("tokens")
    ax.legend(fontsize="small", frameon=False, ncol=3, loc="upper left")
    ax.set_ylim(0, max([s.gamma for s in steps] + [1]) + 2.5)
    return ax


def plot_cache_rollback(lengths: list[CacheLengths], ax, name: str = "target"):
    """A cache's length after each step (blue) with the slots the step wrote and rolled back on top (red)."""
    x = np.arange(1, len(lengths) + 1)
    after = np.array([c.after for c in lengths])
    ax.bar(x, after, color=COLOURS["target"], label=f"{name} cache after the step")
    ax.bar(x, [c.dropped for c in lengths], bottom=after, color=COLOURS["rejected"], label="written, then rolled back")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    low, peak = min((c.before for c in lengths), default=0), max((c.peak for c in lengths), default=1)
    ax.set_ylim(max(0, low - 3), peak + 0.25 * (peak - low) + 2)         # room for the legend
    ax.set_xlabel("step (target forward)")
    ax.set_ylabel("cache length (tokens)")
    ax.legend(fontsize="small", frameon=False, loc="upper left")
    return ax


def accept_length_counts(trace: Trace, gamma: int | None = None) -> np.ndarray:
    """counts[n] = steps that accepted exactly n draft tokens, n = 0..γ (γ: the trace's largest draft)."""
    drafted = [s for s in trace.steps if s.gamma > 0]
    gamma = max((s.gamma for s in drafted), default=0) if gamma is None else gamma
    return np.bincount([s.n_accepted for s in drafted], minlength=gamma + 1)[: gamma + 1]


def per_position_acceptance(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """(reached, accepted) per draft position i: steps whose verdict got to token i, and those that kept it.

    accepted / reached is the acceptance rate at position i given that tokens before it were kept.
    """
    gamma = max((s.gamma for s in trace.steps), default=0)
    reached, accepted = np.zeros(gamma, int), np.zeros(gamma, int)
    for s in trace.steps:
        reached[: s.n_judged] += 1
        accepted[: s.n_accepted] += 1
    return reached, accepted


# ---- a run's summary read from data/bench: the draft's window ----

def plot_window_curve(summary: list[dict], ax_accept, ax_speed, drafter: str = "draft"):
    """Acceptance, and speed over plain decoding (over all the questions, and the slowest question), against
    the drafter's window; `summary`: scripts/draft_window.py's rows, {"window", "acceptance", "speedup",
    "worst_question"}."""
    labels = [str(r["window"]) for r in summary]
    ax_accept.bar(labels, [r["acceptance"] for r in summary], color=COLOURS["draft"])
    ax_accept.set(xlabel=f"{drafter} window (tokens read besides the first 4)", ylabel="acceptance rate",
                  ylim=(0, 1), title=f"how often the {drafter} is right")
    ax_speed.plot(labels, [r["speedup"] for r in summary], "o-", color=COLOURS["target"],
                  label="all questions (prefill included)")
    ax_speed.plot(labels, [r["worst_question"] for r in summary], "s--", color=COLOURS["rejected"],
                  label="the slowest question")
    ax_speed.axhline(1, color="grey", lw=0.8)
    ax_speed.annotate("plain decoding", (len(labels) - 1, 1.0), xytext=(0, 3), textcoords="offset points",
                      ha="right", fontsize=9, color="grey")
    top = max(max(r["speedup"], r["worst_question"]) for r in summary)
    ax_speed.set(xlabel=f"{drafter} window", ylabel="× plain decoding", ylim=(0, 1.25 * max(top, 1.0)), title="speed")
    ax_speed.legend(fontsize=9, loc="lower left")
    return ax_speed
