"""The speedup calculator: Leviathan's formula with this machine's verify cost, for chains and for trees.

Leviathan et al. price a speculative step at γ draft steps (c each, in units of one target step)
plus one verify forward, and take that verify to cost one target step:

    S(γ) = E[tokens per step] / (γ c + 1),   E[tokens per step] = (1 - α^(γ+1)) / (1 - α).

A forward over γ+1 tokens costs about one over 1 token only while the forward stays bandwidth-bound;
this machine's curve t(k)/t(1) (measured with `calibrate.time_forwards`) says how long that holds,
so the calculator also draws

    S(γ) = E[tokens per step] / (γ c + t(γ+1)/t(1)).

Trees (`tree_speedups`, `draw_trees`): a tree of n draft nodes is verified in one forward of n+1
tokens (the last committed token and the nodes). Under greedy verification the target's token at a
node is one token, so at most one child of a node can be accepted, and the expected accepted length
is the sum over nodes of P(every node on the way to it is right). The model: at depth d the target's
token is the drafter's r-th guess with probability p[d, r], independently of the other positions,
either the same at every depth (p_1 = α and measured shares of the further ranks, `draft_ranks`) or
per depth (Medusa's heads, each with its own top-k accuracy). The best tree of n nodes adds the
nodes of highest path probability one by one (`labkit.drafters.medusa.medusa_tree`: each prefix of
its list is the best tree of its size). A draft model or a feature head drafts a tree level by
level, one forward per level, so a step costs depth·c + t(n+1)/t(1); Medusa's heads all run once,
c + t(n+1)/t(1). A chain of γ tokens is the tree of n = γ nodes with depth γ.

    curve = measure_verify_curve(target.model)          # {k: t(k)/t(1)}
    calc = SpeedupCalculator(curve, alpha=0.8, gamma=4, c=0.4, points=points)
    calc                                               # sliders for α, γ, c and the two plots

The pure functions (`chain_speedup`, `tree_speedups`, `rank_probabilities`, `rank_shares`,
`pooled_accept_counts`, `iid_accept_distribution`) are tested in tests/test_calculator.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from matplotlib.ticker import MaxNLocator

from ..core.adaptive import VerifyCurve, expected_tokens
from ..core.trace import Trace
from ..drafters.medusa import medusa_tree
from .plots import accept_length_counts

# every k up to 11 (chains up to γ = 10), then enough points to follow the curve to a 32-node tree
CURVE_TOKENS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 17, 21, 25, 33)
MAX_GAMMA = 10
MAX_NODES = 32
RANKS = 4                      # the draft's top-4 guesses: a tree node is one of them
COLOURS = {"ideal": "#bbbbbb", "machine": "#5b8fd6", "tree": "#6cc36a", "run": "#e07b39", "adaptive": "#9b6cc3",
           "bench": "#444444"}


# ---- the verify cost ----

def measure_verify_curve(model, context: int = 64, tokens: tuple[int, ...] = CURVE_TOKENS,
                         repeats: int = 3) -> dict[int, float]:
    """{k: t(k)/t(1)} on `model` (a forward over k new tokens after `context` cached ones, best of `repeats`)."""
    from ..models.calibrate import time_forwards
    if 1 not in tokens:
        raise ValueError(f"the curve is relative to t(1): tokens must include 1, got {tokens}")
    seconds = time_forwards(model, context, tuple(tokens), repeats, progress=False)
    return {k: seconds[k] / seconds[1] for k in sorted(seconds)}


FLAT = VerifyCurve(None)


# ---- chains ----

def chain_speedup(alpha: float, gamma: int, c: float, verify: VerifyCurve = FLAT) -> float:
    """Expected speedup of γ-token drafts: E[tokens per step] / (γ c + t(γ+1)/t(1)) (flat verify: Leviathan)."""
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    return expected_tokens(alpha, gamma) / (gamma * c + verify(gamma + 1))


def best_gamma(alpha: float, c: float, verify: VerifyCurve = FLAT, max_gamma: int = MAX_GAMMA) -> int:
    """The γ in 1..max_gamma with the highest `chain_speedup`."""
    return max(range(1, max_gamma + 1), key=lambda g: chain_speedup(alpha, g, c, verify))


# ---- trees ----

def rank_probabilities(alpha: float, shares) -> np.ndarray:
    """(p_1, p_2, ...): P(the target's token is the draft's r-th guess) = α, then (1 - α)·share_r."""
    shares = np.asarray(shares, dtype=float)
    if not 0 <= alpha <= 1 or (shares < 0).any() or shares.sum() > 1 + 1e-9:
        raise ValueError(f"need 0 <= alpha <= 1 and shares >= 0 summing to at most 1, got {alpha}, {shares}")
    return np.concatenate([[alpha], (1 - alpha) * shares])


def rank_shares(ranks, n_ranks: int = RANKS) -> np.ndarray:
    """Among the positions where the draft's first guess missed, the share at its 2nd, 3rd, ... guess.

    ranks: the target token's rank in the draft's distribution at each position (0: the first guess),
    as `draft_ranks` returns. Ranks n_ranks and beyond fall outside the tree and are not counted.
    """
    ranks = np.asarray(ranks)
    misses = int((ranks > 0).sum())
    if misses == 0:
        return np.zeros(n_ranks - 1)
    return np.array([(ranks == r).sum() / misses for r in range(1, n_ranks)])


@dataclass(frozen=True)
class TreeCurve:
    """For n = 1..max nodes: the best tree's expected tokens per step (accepted + the target's), depth, speedup."""
    nodes: np.ndarray
    tokens: np.ndarray
    depth: np.ndarray
    speedup: np.ndarray


def tree_speedups(probs, c: float, verify: VerifyCurve = FLAT, max_nodes: int = MAX_NODES,
                  per_level: bool = True) -> TreeCurve:
    """Best trees of 1..max_nodes nodes under the rank model `probs`, priced depth·c + t(n+1)/t(1) (per_level: one
    draft forward per level) or c + t(n+1)/t(1) (Medusa: every head once).

    probs: (ranks,) p_r, the same at every depth; or (depth, ranks), p[d, r] for each depth (no node deeper than
    its rows)."""
    probs = np.asarray(probs, dtype=float)
    if probs.ndim not in (1, 2) or probs.shape[-1] == 0 or (probs < 0).any() or (probs.sum(axis=-1) > 1 + 1e-9).any():
        raise ValueError(f"probs must be (ranks,) or (depth, ranks) probabilities summing to at most 1 per depth, "
                         f"got shape {probs.shape}")
    per_depth = probs if probs.ndim == 2 else np.broadcast_to(probs, (max_nodes, len(probs)))    # (depth, ranks)
    if (per_depth[0] <= 0).all():
        ones = np.arange(1, max_nodes + 1)
        return TreeCurve(ones, np.ones(max_nodes), ones,
                         np.array([1 / ((n if per_level else 1) * c + verify(n + 1)) for n in ones]))
    choices = medusa_tree(torch.tensor(np.cumsum(per_depth, axis=1)), max_nodes)   # each prefix: the best smaller tree
    values = [float(np.prod([per_depth[d, r] for d, r in enumerate(ch)])) for ch in choices]
    nodes = np.arange(1, len(choices) + 1)
    tokens = 1 + np.cumsum(values)
    depth = np.maximum.accumulate([len(ch) for ch in choices])
    speedup = np.array([t / ((d if per_level else 1) * c + verify(n + 1)) for n, t, d in zip(nodes, tokens, depth)])
    return TreeCurve(nodes, tokens, depth, speedup)


def chain_tokens(probs, n: int) -> float:
    """Expected tokens per step of the chain of the drafter's first guesses, n deep: 1 + Σ_d Π_{i<=d} p[i, 0]."""
    probs = np.asarray(probs, dtype=float)
    first = np.full(n, probs[0]) if probs.ndim == 1 else probs[:n, 0]
    if len(first) < n:
        raise ValueError(f"a chain of {n} needs {n} depths; probs has {len(first)}")
    return float(1 + np.cumprod(first).sum())


@torch.no_grad()
def draft_ranks(draft_model, prompt_ids: torch.Tensor, tokens: list[int], n_ranks: int = RANKS) -> np.ndarray:
    """The rank of each of `tokens` (a greedy answer to prompt_ids) in the draft's distribution there.

    One draft forward over prompt + answer. Rank 0 is the draft's first guess (a greedy draft
    token the target keeps); ranks >= n_ranks come back as n_ranks. While a greedy draft is
    accepted it sees exactly the target's tokens, so these are the ranks a draft step meets.
    """
    ids = torch.tensor(prompt_ids.tolist() + list(tokens))
    logits = draft_model(ids[None, :-1], draft_model.new_cache(max_len=len(ids)))[0, len(prompt_ids) - 1:]  # (N, V)
    top = logits.float().topk(n_ranks, dim=-1).indices                                                    # (N, k)
    hit = top == torch.tensor(tokens)[:, None]                                                          # (N, k)
    return np.where(hit.any(-1), hit.float().argmax(-1), n_ranks).astype(int)


# ---- the runs ----

def pooled_accept_counts(traces: list[Trace]) -> np.ndarray:
    """counts[n] = drafting steps (γ >= 1) that accepted n draft tokens, over every trace."""
    longest = max((s.gamma for t in traces for s in t.steps), default=0)
    return sum((accept_length_counts(t, longest) for t in traces), np.zeros(longest + 1, int))


def iid_accept_distribution(alpha: float, gammas: list[int]) -> np.ndarray:
    """P(n accepted) for steps drafting `gammas` (one γ per step) under the i.i.d. model, averaged over the steps.

    A step of γ accepts n < γ with probability α^n (1 - α) and all γ with α^γ.
    """
    gammas = [g for g in gammas if g > 0]
    out = np.zeros(max(gammas, default=0) + 1)
    for g in gammas:
        out[:g] += [alpha ** n * (1 - alpha) for n in range(g)]
        out[g] += alpha ** g
    return out / max(1, len(gammas))


def judged_acceptance(traces: list[Trace]) -> float:
    """α = accepted draft tokens / draft tokens the target judged (those after a rejection are never judged)."""
    judged = sum(s.n_judged for t in traces for s in t.steps)
    accepted = sum(s.n_accepted for t in traces for s in t.steps)
    return accepted / judged if judged else float("nan")


@dataclass(frozen=True)
class RunPoint:
    """One measured run (or several pooled) placed on the chain plot: at its γ (the mean γ when it adapts)."""
    label: str
    alpha: float
    gamma: float
    speedup: float
    fixed: bool = True
    source: str = "run"        # "run": this notebook's; "bench": a committed benchmark's


def run_point(label: str, traces: list[Trace], plain_traces: list[Trace], fixed: bool = True) -> RunPoint:
    """The point of runs `traces` (one per prompt) against plain runs of the same prompts: pooled tokens per second.

    A fixed-γ run sits at its γ (the largest draft: a last step may be cut short by the answer's end),
    an adaptive one at the mean γ of its steps.
    """
    steps = [s for t in traces for s in t.steps]
    rate = sum(t.n_generated for t in traces) / sum(t.total_time for t in traces)
    plain = sum(t.n_generated for t in plain_traces) / sum(t.total_time for t in plain_traces)
    gamma = max(s.gamma for s in steps) if fixed else float(np.mean([s.gamma for s in steps]))
    return RunPoint(label, judged_acceptance(traces), float(gamma), rate / plain, fixed)


def bench_points(folder: str | Path, cpu: str, target: str, draft: str, draft_precision: str,
                 method: str = "draft") -> tuple[list[RunPoint], str]:
    """The committed benchmark's draft-model runs in `folder` (bench.json, results.jsonl), if measured like this.

    Only a run of the same CPU, target, draft and draft precision is comparable with this machine's
    curve; otherwise no points and the reason. The method's runs are pooled over the questions: α
    from the steps, γ the mean drafted length, speedup its tokens per second over autoregressive's.
    """
    folder = Path(folder)
    try:
        meta = json.loads((folder / "bench.json").read_text())["meta"]
        records = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError, KeyError):
        return [], f"no readable benchmark in {folder.name}"
    ran = meta.get("ran_on", {})
    theirs = (ran.get("cpu"), meta.get("target"), meta.get("draft"), ran.get("draft_path", {}).get("precision"))
    if theirs != (cpu, target, draft, draft_precision):
        return [], (f"{folder.name} ran {theirs[1]} with {theirs[2]} ({theirs[3]} draft) on {theirs[0]}: "
                    "another setup, not drawn")
    rows = [r for r in records if "steps" in r and "method" in r]
    ar = [r for r in rows if r["method"] == "ar"]
    points = []
    for m in sorted({r["method"] for r in rows if r["method"].startswith(method)}):
        mine = [r for r in rows if r["method"] == m]
        steps = [s for r in mine for s in r["steps"]]          # [γ, accepted, committed, draft s, verify s]
        judged = sum(min(s[0], s[1] + 1) for s in steps)
        if not judged or not ar:
            continue
        speed = sum(r["new_tokens"] for r in mine) / sum(sum(s[3] + s[4] for s in r["steps"]) for r in mine)
        base = sum(r["new_tokens"] for r in ar) / sum(sum(s[3] + s[4] for s in r["steps"]) for r in ar)
        label = meta.get("labels", {}).get(m, m).removeprefix("labkit ")
        points.append(RunPoint(f"benchmark: {label}", sum(s[1] for s in steps) / judged,
                               float(np.mean([s[0] for s in steps])), speed / base, m == method, "bench"))
    return points, "" if points else f"{folder.name} has no {method} runs"


# ---- the plots ----

def draw(axes, alpha: float, gamma: int, c: float, curve: dict[int, float], points: list[RunPoint] = (),
         max_gamma: int = MAX_GAMMA) -> dict:
    """The verify curve and the chains' speedup against γ, on two axes; the numbers drawn, as a dict."""
    ax_cost, ax_chain = axes
    here = VerifyCurve(curve)
    # 1. what a verify pass costs
    ks = np.array(sorted(curve))
    ax_cost.plot(ks, [curve[k] for k in ks], "o-", ms=3, color=COLOURS["machine"], label="this machine")
    ax_cost.axhline(1, ls="--", color=COLOURS["ideal"], lw=2, label="assumed flat: 1")
    ax_cost.axvline(gamma + 1, ls=":", color="grey", lw=1, label="k = γ + 1")
    ax_cost.set_xlabel("tokens in one forward k")
    ax_cost.set_ylabel("t(k) / t(1)")
    ax_cost.set_title("verify cost", fontsize="medium")
    ax_cost.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_cost.legend(fontsize="small", frameon=False)
    # 2. chains
    grid = np.arange(1, max_gamma + 1)
    ideal = [chain_speedup(alpha, g, c) for g in grid]
    machine = [chain_speedup(alpha, g, c, here) for g in grid]
    ax_chain.plot(grid, ideal, "--", color=COLOURS["ideal"], lw=2, label="Leviathan, flat verify")
    ax_chain.plot(grid, machine, "-", color=COLOURS["machine"], lw=2, label="with this machine's t(γ+1)/t(1)")
    ax_chain.plot([gamma], [chain_speedup(alpha, gamma, c, here)], "o", color=COLOURS["machine"], ms=9, mfc="none",
                  label="the slider's γ")
    adaptive_markers = iter("s^vPD*")
    for k, p in enumerate(sorted(points, key=lambda p: p.gamma)):
        colour = COLOURS["bench" if p.source == "bench" else "run" if p.fixed else "adaptive"]
        if not p.fixed:                     # named in the legend, with its α: no label to collide with the others
            ax_chain.plot([p.gamma], [p.speedup], next(adaptive_markers), color=colour, ls="",
                          label=f"{p.label} (mean γ), α={p.alpha:.2f}")
            continue
        ax_chain.plot([p.gamma], [p.speedup], "D" if p.source == "bench" else "o", color=colour)
        name = f"{p.label.removeprefix('fixed ')}, " if p.source == "bench" else ""      # γ is on the axis
        above = k % 2 == 0                  # neighbours alternate above and below their marker
        ax_chain.annotate(f"{name}α={p.alpha:.2f}", (p.gamma, p.speedup), textcoords="offset points",
                          xytext=(0, 8 if above else -8), ha="center", va="bottom" if above else "top", fontsize=10,
                          color=colour, bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.8))
        if p.fixed and p.source == "run":       # the formula at this run's own α, on this machine
            ax_chain.plot([p.gamma], [chain_speedup(p.alpha, int(round(p.gamma)), c, here)], "x", color=colour)
    ax_chain.axhline(1, ls=":", color="grey", lw=1, label="1: plain decoding's speed")
    ax_chain.set_xlabel("γ (draft tokens per step)")
    ax_chain.set_ylabel("speedup over plain decoding")
    ax_chain.set_ylim(0, None)
    ax_chain.set_title(f"chains: α = {alpha:.2f}, c = {c:.2f}", fontsize="medium")
    ax_chain.xaxis.set_major_locator(MaxNLocator(integer=True))
    handles = ax_chain.get_legend_handles_labels()[0]
    if any(p.fixed for p in points):
        from matplotlib.lines import Line2D
        handles[3:3] = [Line2D([], [], ls="", marker="o", color=COLOURS["run"], label="measured, fixed γ"),
                        Line2D([], [], ls="", marker="x", color=COLOURS["run"], label="formula at that run's α")]
    ax_chain.legend(handles=handles, fontsize=9, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1))
    best_g = best_gamma(alpha, c, here, max_gamma)
    return {"ideal": chain_speedup(alpha, gamma, c), "machine": chain_speedup(alpha, gamma, c, here),
            "verify": here(gamma + 1), "tokens": expected_tokens(alpha, gamma),
            "best_gamma_ideal": best_gamma(alpha, c, FLAT, max_gamma), "best_gamma_machine": best_g,
            "best_chain_speedup": chain_speedup(alpha, best_g, c, here)}


def draw_trees(ax, probs, c: float, curve: dict[int, float] | None, max_nodes: int = MAX_NODES,
               per_level: bool = True, title: str = "") -> dict:
    """Best tree of n nodes against the chain of n, with the verify cost `curve` (None: flat, Leviathan's); the
    numbers drawn, as a dict."""
    verify = FLAT if curve is None else VerifyCurve(curve)
    trees = tree_speedups(probs, c, verify, max_nodes, per_level)
    depths = len(trees.nodes) if np.ndim(probs) == 1 else min(len(trees.nodes), np.shape(probs)[0])
    chain_n = np.arange(1, depths + 1)
    chain = [chain_tokens(probs, int(n)) / ((n if per_level else 1) * c + verify(n + 1)) for n in chain_n]
    ax.plot(chain_n, chain, "o-" if depths < 8 else "-", ms=4, color=COLOURS["machine"], lw=2,
            label="chain of n (the first guesses)")
    ax.plot(trees.nodes, trees.speedup, "-", color=COLOURS["tree"], lw=2, label="best tree of n nodes")
    best_n = int(trees.nodes[int(np.argmax(trees.speedup))])
    ax.plot([best_n], [trees.speedup[best_n - 1]], "o", ms=9, mfc="none", color=COLOURS["tree"],
            label=f"the best tree: {best_n} nodes")
    ax.axhline(1, ls=":", color="grey", lw=1, label="1: plain decoding's speed")
    ax.set_xlabel("draft nodes verified per step n")
    ax.set_ylabel("expected speedup")
    ax.set_ylim(0, max(1.2, 1.1 * max(max(chain), float(trees.speedup.max()))))
    ax.set_title(title or ("trees, flat verify" if curve is None else "trees, this machine's verify cost"),
                 fontsize="medium")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=9, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1))
    best_chain = int(chain_n[int(np.argmax(chain))])
    return {"best_nodes": best_n, "best_tree_speedup": float(trees.speedup[best_n - 1]),
            "best_tree_tokens": float(trees.tokens[best_n - 1]), "best_tree_depth": int(trees.depth[best_n - 1]),
            "verify": verify(best_n + 1), "best_chain": best_chain, "best_chain_speedup": float(max(chain))}


def summary(alpha: float, gamma: int, c: float, n: dict) -> str:
    """What the two plots say at these slider values, in Markdown."""
    return (f"At α = {alpha:.2f}, γ = {gamma}, c = {c:.2f}: a step commits {n['tokens']:.2f} tokens on average and "
            f"costs {gamma} × {c:.2f} draft + {n['verify']:.2f} verify = {gamma * c + n['verify']:.2f} target steps "
            f"here (Leviathan's flat verify: {gamma * c + 1:.2f}). Expected speedup **{n['machine']:.2f}x** on this "
            f"machine, {n['ideal']:.2f}x with a flat verify. Best γ: {n['best_gamma_machine']} here, "
            f"{n['best_gamma_ideal']} with a flat verify.")


def tree_summary(n: dict) -> str:
    """What `draw_trees` drew, in Markdown: the best tree against the best chain."""
    return (f"Best tree: **{n['best_nodes']} nodes** (depth {n['best_tree_depth']}, {n['best_tree_tokens']:.2f} "
            f"tokens per step, a verify of {n['verify']:.2f} plain steps), **{n['best_tree_speedup']:.2f}x**; "
            f"best chain: {n['best_chain']} deep, {n['best_chain_speedup']:.2f}x.")


class SpeedupCalculator:
    """Sliders for α, γ and c over `draw`; the plots redraw live (ipywidgets.interactive_output).

    The first drawing is made when the calculator is built, inside an Output widget. Without a kernel
    the sliders do nothing: `figure` draws any setting, for a grid of them that plays without one
    (`labkit.viz.replay.figure_grid`).
    """

    def __init__(self, curve: dict[int, float], alpha: float, gamma: int, c: float, points: list[RunPoint] = (),
                 max_gamma: int = MAX_GAMMA):
        import ipywidgets as w
        self.curve, self.points, self.max_gamma = curve, list(points), max_gamma
        style, layout = {"description_width": "initial"}, w.Layout(width="32%")
        self.alpha = w.FloatSlider(value=round(min(0.99, max(0.0, alpha)), 2), min=0.0, max=0.99, step=0.01,
                                   description="α (acceptance)", continuous_update=False, style=style, layout=layout)
        self.gamma = w.IntSlider(value=int(gamma), min=1, max=max_gamma, description="γ (draft length)",
                                 continuous_update=False, style=style, layout=layout)
        self.c = w.FloatSlider(value=round(min(1.5, max(0.0, c)), 2), min=0.0, max=1.5, step=0.01,
                               description="c (draft step / target step)", continuous_update=False, style=style,
                               layout=layout)
        self.out = w.interactive_output(self.show, {"alpha": self.alpha, "gamma": self.gamma, "c": self.c})
        self.widget = w.VBox([w.HBox([self.alpha, self.gamma, self.c]), self.out])

    def figure(self, alpha: float, gamma: int, c: float):
        """(figure, Markdown summary) at one setting of the sliders; the numbers drawn are kept as `numbers`."""
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(15, 4), gridspec_kw={"width_ratios": [1, 1.5]})
        self.numbers = draw(axes, alpha, gamma, c, self.curve, self.points, self.max_gamma)
        fig.tight_layout()
        return fig, summary(alpha, gamma, c, self.numbers)

    def show(self, alpha: float, gamma: int, c: float) -> dict:
        import matplotlib.pyplot as plt
        from IPython.display import Markdown, display
        fig, text = self.figure(alpha, gamma, c)
        display(fig)
        plt.close(fig)
        display(Markdown(text))
        return self.numbers

    def _ipython_display_(self) -> None:
        from IPython.display import display
        display(self.widget)
