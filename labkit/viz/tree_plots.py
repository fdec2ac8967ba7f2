"""Pictures of a token tree: the tree itself with its accepted path, and its attention mask."""
from __future__ import annotations

import re

import torch
from matplotlib.ticker import MaxNLocator

from ..core.tree import Tree
from .plots import COLOURS

WHITESPACE = (("␣", "space"), ("↵", "newline"), ("→", "tab"))        # the glyphs of widgets.token_text


def tree_layout(tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) (N,) each: y = depth, x = leaf order (a parent sits over the middle of its children)."""
    N = tree.n_nodes
    x = torch.zeros(N)
    next_leaf = 0.0
    order = _depth_first(tree)
    for i in order:                                                          # leaves left to right
        if tree.is_leaf[i]:
            x[i], next_leaf = next_leaf, next_leaf + 1
    for i in reversed(range(N)):                                             # children before parents
        kids = tree.children(i)
        if kids.numel():
            x[i] = x[kids].mean()
    return x, tree.depth.float()


def _depth_first(tree: Tree) -> list[int]:
    out, stack = [], tree.children(-1).tolist()[::-1]
    while stack:
        i = stack.pop()
        out.append(i)
        stack += tree.children(i).tolist()[::-1]
    return out


def tree_label(text: str, width: int = 5) -> str:
    """A node's label: a run of a whitespace glyph (␣ ↵ →, see widgets.token_text) as the glyph and a count (␣×4), at
    most `width` characters (a cut label ends in …), so labels stay short enough to sit level under their nodes."""
    if width < 2:
        raise ValueError(f"width must be >= 2 (a character and the …), got {width}")
    text = re.sub(r"([␣↵→])\1+", lambda m: f"{m.group(1)}×{len(m.group())}", text)
    return text if len(text) <= width else text[: width - 1] + "…"


def draw_tree(ax, tree: Tree, labels: list[str], path: list[int] | None = None, title: str = ""):
    """The tree root at the top; nodes on the accepted `path` green, the others grey; labels level, under each node."""
    x, y = tree_layout(tree)
    on_path = set(path or [])
    root_x = float(x[tree.children(-1)].mean()) if tree.n_nodes else 0.0
    for i in range(tree.n_nodes):
        px, py = (root_x, 0.0) if tree.parents[i] < 0 else (float(x[tree.parents[i]]), float(y[tree.parents[i]]))
        ax.plot([px, float(x[i])], [py, float(y[i])], color="#999", lw=0.8, zorder=1)
    ax.scatter([root_x], [0], s=60, color=COLOURS["target"], zorder=2)
    ax.annotate("root", (root_x, 0), textcoords="offset points", xytext=(6, 4), fontsize=10)
    for i in range(tree.n_nodes):
        colour = COLOURS["accepted"] if i in on_path else COLOURS["kept"]
        ax.scatter([float(x[i])], [float(y[i])], s=40, color=colour, zorder=2)
        ax.annotate(labels[i], (float(x[i]), float(y[i])), textcoords="offset points", xytext=(0, -8),
                    ha="center", va="top", fontsize=10 if tree.n_nodes <= 12 else 9, zorder=3,
                    bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.85))   # over the edges
    used = [f"{g} {name}" for g, name in WHITESPACE if any(g in label for label in labels)]
    if used:                                                # the legend of the glyphs, once, under the tree
        counted = any(re.search(r"[␣↵→]×", label) for label in labels)
        ax.text(0.0, -0.02, ", ".join(used) + ("; ␣×4: four spaces" if counted else ""),
                transform=ax.transAxes, va="top", fontsize=9, color="#555")
    ax.invert_yaxis()
    ax.margins(y=0.25)                                      # room for the labels under the deepest nodes
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("depth")
    ax.set_xticks([])
    ax.set_title(title or f"{tree.n_nodes} nodes, accepted path of {len(on_path)}")
    return ax


def draw_mask(ax, tree: Tree, n_cached: int = 0, title: str = ""):
    """The verify pass's attention mask (rows: root + nodes, columns: cache + root + nodes)."""
    m = tree.verify_mask(n_cached)
    ax.imshow(m.numpy(), cmap="Greens", vmin=0, vmax=1.4, interpolation="nearest")
    ax.set_xlabel("key slot (cache, root, nodes)")
    ax.set_ylabel("query (root, nodes)")
    ax.set_title(title or f"tree attention mask, {tree.n_nodes} nodes after {n_cached} cached")
    return ax
