"""The data curve: each draft head's held-out tokens per forward against the training tokens it has seen.

    python -m labkit.training.data_curve --features DIR --points 32,64,128,256 --out data/bench/data_curve

For every head in `--heads` it trains on the first `points[0]` training rows of a self-distilled
feature set (features.py --distilled), then resumes on the next slice, and so on (train_eagle /
train_medusa `--resume --rows A:B`): each point is one more run on new data, the way a shipped head
grows. After every run the training script replays a greedy chain on the held-out conversations,
code and chat apart (replay.py), and records it with the run in the head's config.json; this
module reads those records back, fits tokens per forward against log10(training tokens) for each
head, and writes curve.json, curve.md and curve.png.

Heads: `eagle` (EAGLE-1: final feature, feature regression), `eagle3` (fused blocks, tokens only,
no training-time test), `eagle3-ttt` (the same unrolled `--ttt-steps` K steps), `medusa`
(Medusa-1, whose chain is as deep as its 4 heads). Each run trains `--epochs` passes over its new rows.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from ..models.hub import cache_dir
from .features import row_range

# head -> (training module, its arguments); {k} is the training-time-test depth
HEADS = {
    "eagle": ("train_eagle", ["--kind", "eagle", "--cls-weight", "0.5"]),
    "eagle3": ("train_eagle", ["--kind", "eagle3", "--ttt-steps", "1"]),
    "eagle3-ttt": ("train_eagle", ["--kind", "eagle3", "--ttt-steps", "{k}"]),
    "medusa": ("train_medusa", []),
}
LABELS = {"eagle": "EAGLE-1 (feature regression)", "eagle3": "EAGLE-3, no training-time test",
          "eagle3-ttt": "EAGLE-3 + training-time test", "medusa": "Medusa-1"}


def run_commands(head: str, features: Path, points: list[int], out: Path, epochs: float | list[float], ttt_steps: int,
                 lr: float, extra: list[str] = ()) -> list[list[str]]:
    """The training commands of one head's curve: the first slice fresh, every later one resumed; epochs: passes
    over each run's new rows (one number, or one per point: small first slices need more passes to converge)."""
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}: choose from {sorted(HEADS)}")
    if sorted(set(points)) != list(points) or points[0] < 1:
        raise ValueError(f"points must be increasing row counts >= 1, got {points}")
    epochs = list(epochs) if isinstance(epochs, (list, tuple)) else [epochs] * len(points)
    if len(epochs) != len(points):
        raise ValueError(f"give one epochs value, or one per point ({len(points)}), got {epochs}")
    module, args = HEADS[head]
    args = [a.format(k=ttt_steps) for a in args]
    cmds, start = [], 0
    for end, ep in zip(points, epochs):
        budget = ["--epochs", str(ep), "--minutes", "1000", "--lr", str(lr)] if module == "train_eagle" else \
            ["--steps", str(max(1, round(ep * (end - start) * 255 / 256))), "--minutes", "1000"]
        cmds.append([sys.executable, "-m", f"labkit.training.{module}", "--features", str(features), "--out", str(out),
                     "--rows", f"{start}:{end}", *budget, *args, *extra] + (["--resume"] if start else []))
        start = end
    return cmds


def tokens_seen(runs: list[dict]) -> int:
    """Distinct training tokens over a head's runs: a run over rows of the same features that an earlier run
    trained on adds none (a run without a row record counts whole)."""
    seen: dict[str, set[int]] = {}
    total = 0
    for run in runs:
        corpus = run.get("features") or {}
        n_train = corpus.get("train_sequences") if isinstance(corpus, dict) else None
        part = row_range(run.get("rows"))
        if part.stop is None and n_train is None:                                      # rows unknown: all new
            total += run["training_tokens"]
            continue
        rows = range(part.start or 0, n_train if part.stop is None else min(part.stop, n_train or part.stop))
        if not rows:
            continue
        per_row = run["training_tokens"] / len(rows)
        key = json.dumps(corpus, sort_keys=True)
        new = set(rows) - seen.setdefault(key, set())
        total += round(per_row * len(new))
        seen[key] |= new
    return total


def read_curve(head_dir: Path) -> list[dict]:
    """[{tokens_seen, source: tokens per forward, ...}] after each run recorded in a head's config.json."""
    config = json.loads((Path(head_dir) / "config.json").read_text())
    rows, runs = [], config.get("runs", [])
    for i, run in enumerate(runs):
        rows.append({"tokens_seen": tokens_seen(runs[:i + 1]), "seconds": run["seconds"], "ttt_steps": run.get("ttt_steps"),
                     **{src: r["tokens_per_forward"] for src, r in (run.get("replay") or {}).items()},
                     "step_acceptance": {src: r["step_acceptance"] for src, r in (run.get("replay") or {}).items()}})
    return rows


def fit_log(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(a, b) of the least-squares line y = a + b log10(x)."""
    if len(xs) < 2:
        raise ValueError("a trend needs at least two points")
    lx = [math.log10(x) for x in xs]
    mx, my = sum(lx) / len(lx), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(lx, ys)) / sum((x - mx) ** 2 for x in lx)
    return my - b * mx, b


def tokens_for(tau: float, a: float, b: float) -> float:
    """Training tokens at which the fitted line y = a + b log10(x) reaches tau (inf where it never rises)."""
    return 10 ** ((tau - a) / b) if b > 0 else math.inf


def plot(curves: dict[str, list[dict]], sources: list[str], goal: float | None = None):
    """The curve of every head, one panel per held-out source, with its log fit extended 8x (a matplotlib figure)."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(sources), figsize=(5.5 * len(sources), 4), sharey=True, squeeze=False)
    for ax, src in zip(axes[0], sources):
        for i, (head, rows) in enumerate(curves.items()):
            xs, ys = [r["tokens_seen"] for r in rows], [r[src] for r in rows]
            line, = ax.plot(xs, ys, "o-", color=f"C{i}", label=LABELS.get(head, head))
            if len(xs) >= 2:
                a, b = fit_log(xs, ys)
                x_end = max(xs) * 8
                ax.plot([min(xs), x_end], [a + b * math.log10(min(xs)), a + b * math.log10(x_end)], ":",
                        color=line.get_color(), alpha=0.7)
        if goal:
            ax.axhline(goal, color="grey", lw=0.8, ls="--", label=f"{goal:g} tokens per forward: a goal")
        ax.set_xscale("log")
        ax.set_title(f"held-out {'code' if src == 'stdlib' else 'chat' if src == 'sharegpt' else src} conversations")
        ax.set_xlabel("training tokens seen (log scale)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("tokens per target forward (greedy chain,\n6 deep, Medusa 4 heads deep; replayed)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Draft heads on the target's own answers: acceptance against training data (dotted: log fit)")
    fig.tight_layout()
    return fig


def report(curves: dict[str, list[dict]], sources: list[str], taus: tuple[float, ...], facts: dict) -> tuple[dict, str]:
    """(curve.json's content, curve.md's text): every point, the fitted line and the tokens it needs to reach taus."""
    fits = {}
    for head, rows in curves.items():
        for src in sources:
            if len(rows) >= 2:
                a, b = fit_log([r["tokens_seen"] for r in rows], [r[src] for r in rows])
                fits.setdefault(head, {})[src] = {"a": round(a, 4), "b_per_decade": round(b, 4),
                                                  "tokens_for": {str(t): tokens_for(t, a, b) if math.isfinite(tokens_for(t, a, b))
                                                                 else None for t in taus}}   # None: never
    lines = ["# Data curve: held-out tokens per forward against training tokens", "",
             f"{facts['machine']}. Features: {facts['features']}.", "",
             *[f"Re-run on {u['date']}: {', '.join(LABELS.get(h, h) for h in u['heads'])}, on {u['machine']}.\n"
               for u in facts.get("updated", [])],
             "Tokens per target forward of a greedy chain (6 deep; Medusa's 4 heads deep), replayed at every root of the "
             "held-out conversations (labkit/training/replay.py: what chain decoding measures, no target forward "
             "needed; "
             "sharegpt: chat, stdlib: code). Each point after the first resumes the head on new rows. Training-time "
             f"test: {facts.get('ttt_steps')} steps.", "",
             "| head | training tokens seen | " + " | ".join(f"{s} tok/fwd" for s in sources) + " | run seconds |",
             "|---|---|" + "---|" * len(sources) + "---|"]
    for head, rows in curves.items():
        for r in rows:
            lines.append(f"| {LABELS.get(head, head)} | {r['tokens_seen']:,} | "
                         + " | ".join(f"{r[s]:.3f}" for s in sources) + f" | {r['seconds']:.0f} |")
    lines += ["", "Fitted trend, tokens per forward = a + b log10(training tokens), and the training tokens at which "
              "the line reaches a target:", "",
              "| head | held out | b per decade | " + " | ".join(f"tokens for {t}" for t in taus) + " |",
              "|---|---|---|" + "---|" * len(taus)]
    for head, per in fits.items():
        for src, f in per.items():
            lines.append(f"| {LABELS.get(head, head)} | {src} | {f['b_per_decade']:+.3f} | "
                         + " | ".join("never" if v is None else f"{v:.2g}" for v in f["tokens_for"].values()) + " |")
    data = {"facts": facts, "sources": sources, "curves": curves, "fits": fits}
    return data, "\n".join(lines) + "\n"


def updated(earlier: dict[str, list[dict]], rerun: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """An earlier report's curves with the re-run heads' in their place (in the earlier order; new heads last)."""
    return {h: rerun.get(h, rows) for h, rows in earlier.items()} | {h: r for h, r in rerun.items() if h not in earlier}


def main(argv: list[str] | None = None) -> None:
    from ..models.calibrate import isa_label, load_average, machine
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--features", required=True, help="a self-distilled feature set with tapped blocks")
    ap.add_argument("--points", default="32,64,128,256", help="cumulative training rows after each run")
    ap.add_argument("--heads", default="eagle3-ttt,eagle3,eagle,medusa")
    ap.add_argument("--epochs", default="4,2,1,1", help="passes over each run's new rows: one value or one per point")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast in training (CPUs with bf16 dot products)")
    ap.add_argument("--ttt-steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--work", default=None, help="where the heads grow (default: <cache>/data_curve)")
    ap.add_argument("--out", default="data/bench/data_curve")
    ap.add_argument("--taus", default="2.0,2.5,3.0")
    ap.add_argument("--report-only", action="store_true", help="redraw from the heads already in --work")
    ap.add_argument("--update", action="store_true",
                    help="re-run only --heads and keep the other heads' curves of --out's curve.json as they are")
    args = ap.parse_args(argv)
    if args.update and args.report_only:
        raise SystemExit("--update re-runs --heads and --report-only runs nothing: give one of them")
    points = [int(p) for p in args.points.split(",")]
    epochs = [float(e) for e in args.epochs.split(",")]
    epochs = epochs[0] if len(epochs) == 1 else epochs
    work = Path(args.work or cache_dir() / "data_curve")
    heads = [h.strip() for h in args.heads.split(",") if h.strip()]
    load_before = load_average()
    t0 = time.perf_counter()
    if not args.report_only:
        for head in heads:
            for cmd in run_commands(head, Path(args.features), points, work / head, epochs, args.ttt_steps,
                                    args.lr, ["--bf16"] if args.bf16 else []):
                print("$", " ".join(cmd[1:]), flush=True)
                subprocess.run(cmd, check=True)
    curves = {h: read_curve(work / h) for h in heads}
    out = Path(args.out)
    earlier = json.loads((out / "curve.json").read_text()) if (out / "curve.json").is_file() else None
    if args.update:
        if earlier is None:
            raise SystemExit(f"--update keeps the other heads of {out / 'curve.json'}, which does not exist: run "
                             "without --update")
        curves = updated(earlier["curves"], curves)
    sources = sorted({k for rows in curves.values() for r in rows for k in r}
                     - {"tokens_seen", "seconds", "ttt_steps", "step_acceptance"})
    m = machine()
    features_meta = json.loads((Path(args.features) / "meta.json").read_text())
    kept = earlier["facts"] if args.report_only and earlier else None   # a redrawn report keeps its run's facts
    facts = kept or {"machine": f"{m['cpu']} ({isa_label(m)}), {m.get('threads', 2)} threads, training in {'bf16 autocast' if args.bf16 else 'fp32'}; load average "
                        f"{load_before[0]} before, {load_average()[0]} after",
             "features": f"{features_meta.get('model')}, {features_meta.get('corpus')}, blocks "
                         f"{features_meta.get('layers')}, computed in {features_meta.get('dtype')}",
             "epochs_per_run": epochs, "ttt_steps": args.ttt_steps, "points_rows": points,
             "seconds": round(time.perf_counter() - t0, 1)}
    if args.update:                                          # the first run's facts, and what this one re-ran
        facts = {**earlier["facts"], "updated": earlier["facts"].get("updated", []) + [
            {"heads": heads, "machine": facts["machine"], "date": time.strftime("%Y-%m-%d"),
             "seconds": facts["seconds"]}]}
    out.mkdir(parents=True, exist_ok=True)
    data, md = report(curves, sources, tuple(float(t) for t in args.taus.split(",")), facts)
    (out / "curve.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "curve.md").write_text(md)
    import matplotlib
    matplotlib.use("Agg")
    fig = plot(curves, sources, goal=2.5)
    fig.savefig(out / "curve.png", dpi=120)
    print(md)


if __name__ == "__main__":
    main()
