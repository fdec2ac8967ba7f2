"""The two plots of a benchmark run: speedup by category, and tokens committed per target forward."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .methods import BASELINE  # noqa: E402


def plot_speedups(rows, path: Path) -> Path:
    """Grouped bars: for each category, each method's speedup over labkit autoregressive (1 = no gain)."""
    cats = list(dict.fromkeys(r.category for r in rows))
    methods = [m for m in dict.fromkeys(r.method for r in rows) if m != BASELINE]
    labels = {r.method: r.label for r in rows}
    speed = {(r.category, r.method): r.speedup for r in rows}
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(cats)), 5))
    for i, m in enumerate(methods):
        xs = [c + (i - (len(methods) - 1) / 2) * width for c in range(len(cats))]
        ax.bar(xs, [speed.get((c, m), 0) for c in cats], width, label=labels[m])
    ax.axhline(1, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(cats)), cats)
    ax.set_ylabel("speedup over labkit autoregressive (×)")
    ax.set_title("Speedup by category (greedy; same run, same questions)")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_accept_lengths(records: list[dict], labels: dict[str, str], path: Path) -> Path:
    """For each labkit method that drafts: how often a target forward committed 1, 2, ... tokens."""
    counts = {}
    for r in records:
        drafted = [s for s in r["steps"] or [] if s[0] > 0]
        if drafted:
            counts.setdefault(r["method"], Counter()).update(s[1] + 1 for s in drafted)
    fig, axes = plt.subplots(1, max(1, len(counts)), figsize=(3.2 * max(1, len(counts)), 3.2), sharey=True,
                             squeeze=False)
    for ax, (m, c) in zip(axes[0], counts.items()):
        n = sum(c.values())
        ks = range(1, max(c) + 1)
        ax.bar(ks, [c[k] / n for k in ks])
        ax.set_title(labels.get(m, m), fontsize=8)
        ax.set_xlabel("tokens committed per target forward")
    axes[0][0].set_ylabel("share of drafting forwards")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
