"""The speedup calculator's math (labkit/viz/calculator.py), without a model or a browser."""
from __future__ import annotations

import json

import numpy as np
import pytest

from labkit.core.adaptive import expected_speedup, expected_tokens
from labkit.core.trace import Step, Trace
from labkit.viz.calculator import (
    FLAT,
    VerifyCurve,
    bench_points,
    best_gamma,
    chain_speedup,
    chain_tokens,
    draw,
    draw_trees,
    iid_accept_distribution,
    judged_acceptance,
    pooled_accept_counts,
    rank_probabilities,
    rank_shares,
    run_point,
    tree_speedups,
)


def test_flat_verify_is_leviathans_formula():
    for alpha in (0.0, 0.5, 0.8, 0.95):
        for gamma in range(1, 9):
            for c in (0.0, 0.1, 0.4):
                assert chain_speedup(alpha, gamma, c) == pytest.approx(expected_speedup(alpha, gamma, c, 1.0))
                assert chain_speedup(alpha, gamma, c) == pytest.approx(
                    (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1)))


def test_measured_verify_cost_divides_the_tokens():
    curve = {1: 1.0, 2: 1.0, 5: 1.3, 9: 2.0}
    cost = VerifyCurve(curve)
    assert cost(1) == 1.0 and cost(9) == 2.0
    assert cost(3) == pytest.approx(1.1)                  # linear between measured points
    assert cost(13) == pytest.approx(2.7)                 # the last segment's slope beyond them
    assert chain_speedup(0.8, 4, 0.2, cost) == pytest.approx(expected_tokens(0.8, 4) / (4 * 0.2 + 1.3))
    assert FLAT(100) == 1.0


def test_a_dear_verify_moves_the_best_gamma_down():
    steep = VerifyCurve({1: 1.0, 2: 1.3, 3: 1.6, 4: 1.9, 5: 2.2, 6: 2.5, 11: 4.0})
    assert best_gamma(0.9, 0.05) == 10                    # flat verify, cheap draft: draft as far as allowed
    assert best_gamma(0.9, 0.05, steep) < best_gamma(0.9, 0.05)


def test_tree_of_one_rank_is_the_chain():
    curve = VerifyCurve({1: 1.0, 33: 2.0})
    trees = tree_speedups(rank_probabilities(0.7, [0.0, 0.0, 0.0]), 0.3, curve, max_nodes=8)
    for n, tokens, depth, speedup in zip(trees.nodes, trees.tokens, trees.depth, trees.speedup):
        assert depth == n
        assert tokens == pytest.approx(expected_tokens(0.7, int(n)))
        assert speedup == pytest.approx(chain_speedup(0.7, int(n), 0.3, curve))


def test_tree_expected_length_by_hand():
    # p = (0.6, 0.2): the best nodes in turn are the first guess (0.6), its first guess (0.36), that one's
    # first guess (0.216), then the second guess at depth 1 (0.2 > 0.6^4 = 0.1296 > 0.6 * 0.2 = 0.12)
    trees = tree_speedups([0.6, 0.2], c=0.5, max_nodes=4)
    assert trees.tokens.tolist() == pytest.approx([1.6, 1.96, 2.176, 2.376])
    assert trees.depth.tolist() == [1, 2, 3, 3]
    assert trees.speedup.tolist() == pytest.approx([1.6 / 1.5, 1.96 / 2.0, 2.176 / 2.5, 2.376 / 2.5])


def test_a_tree_never_loses_to_the_chain_of_its_size():
    cost = VerifyCurve({1: 1.0, 9: 1.2, 33: 2.5})
    trees = tree_speedups(rank_probabilities(0.6, [0.4, 0.2, 0.1]), 0.4, cost, max_nodes=32)
    chains = [chain_speedup(0.6, int(n), 0.4, cost) for n in trees.nodes]
    assert (trees.speedup >= np.array(chains) - 1e-12).all()
    assert (np.diff(trees.tokens) >= 0).all()


def test_per_depth_probabilities_price_medusa_and_feature_heads():
    # Medusa's heads: depth 1 is right 0.5 / 0.2 at ranks 1 / 2, depth 2 0.3 / 0.1; no node deeper than 2
    probs = [[0.5, 0.2], [0.3, 0.1]]
    trees = tree_speedups(probs, c=0.1, max_nodes=4, per_level=False)
    # best nodes in turn: (0) 0.5, (1) 0.2, (0, 0) 0.15, then (1, 0) 0.06 before (0, 1) 0.05
    assert trees.tokens.tolist() == pytest.approx([1.5, 1.7, 1.85, 1.91])
    assert trees.depth.tolist() == [1, 1, 2, 2]
    assert trees.speedup.tolist() == pytest.approx([t / 1.1 for t in trees.tokens])        # every head once: c
    level = tree_speedups(probs, c=0.1, max_nodes=4)                                       # one forward per level
    assert level.speedup.tolist() == pytest.approx([1.5 / 1.1, 1.7 / 1.1, 1.85 / 1.2, 1.91 / 1.2])
    # the same probabilities at every depth, given once or per depth, are the same trees
    same = tree_speedups([0.6, 0.2], 0.5, max_nodes=4)
    assert tree_speedups([[0.6, 0.2]] * 4, 0.5, max_nodes=4).tokens.tolist() == pytest.approx(same.tokens.tolist())
    assert chain_tokens(probs, 2) == pytest.approx(1 + 0.5 + 0.15)
    assert chain_tokens([0.7, 0.1], 3) == pytest.approx(expected_tokens(0.7, 3))
    with pytest.raises(ValueError, match="needs 3 depths"):
        chain_tokens(probs, 3)
    with pytest.raises(ValueError, match="summing to at most 1"):
        tree_speedups([[0.9, 0.3]], 0.1)


def test_the_drawn_numbers_are_the_formulas():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    curve = {1: 1.0, 2: 1.05, 5: 1.3, 9: 2.0, 33: 5.0}
    fig, axes = plt.subplots(1, 3)
    n = draw(axes[:2], 0.7, 4, 0.2, curve)
    assert n["machine"] == pytest.approx(chain_speedup(0.7, 4, 0.2, VerifyCurve(curve)))
    assert n["best_gamma_machine"] == best_gamma(0.7, 0.2, VerifyCurve(curve)) < n["best_gamma_ideal"]
    t = draw_trees(axes[2], rank_probabilities(0.7, [0.5, 0.2, 0.1]), 0.2, curve, max_nodes=16)
    trees = tree_speedups(rank_probabilities(0.7, [0.5, 0.2, 0.1]), 0.2, VerifyCurve(curve), 16)
    assert t["best_tree_speedup"] == pytest.approx(trees.speedup.max()) and t["best_nodes"] == trees.speedup.argmax() + 1
    assert t["best_chain_speedup"] == pytest.approx(max(chain_speedup(0.7, g, 0.2, VerifyCurve(curve))
                                                        for g in range(1, 17)))
    assert draw_trees(axes[2], [0.7, 0.2], 0.2, None, max_nodes=8)["verify"] == 1.0          # flat: Leviathan's
    plt.close(fig)


def test_rank_model():
    assert rank_probabilities(0.8, [0.5, 0.25]).tolist() == pytest.approx([0.8, 0.1, 0.05])
    with pytest.raises(ValueError):
        rank_probabilities(0.8, [0.9, 0.2])
    assert rank_shares([0, 0, 1, 1, 2, 4], n_ranks=4).tolist() == pytest.approx([0.5, 0.25, 0.0])
    assert rank_shares([0, 0]).tolist() == [0.0, 0.0, 0.0]


def step(gamma, accepted):
    return Step(list(range(gamma)), accepted, 0, accepted == gamma, 0.01 * gamma, 0.1)


def test_pooled_counts_and_iid_mixture():
    a = Trace("x", 3, [step(2, 0), step(2, 2), step(0, 0)], total_time=1.0, n_generated=4)
    b = Trace("y", 3, [step(4, 1), step(4, 4)], total_time=1.0, n_generated=7)
    assert pooled_accept_counts([a, b]).tolist() == [1, 1, 1, 0, 1]          # the γ = 0 step is left out
    p = iid_accept_distribution(0.5, [2, 4])
    assert p.sum() == pytest.approx(1)
    assert p.tolist() == pytest.approx([0.5, (0.25 + 0.25) / 2, (0.25 + 0.125) / 2, 0.0625 / 2, 0.0625 / 2])
    # judged: step (2,0) 1, (2,2) 2, (4,1) 2, (4,4) 4 -> 9 judged, 7 accepted
    assert judged_acceptance([a, b]) == pytest.approx(7 / 9)
    plain = Trace("ar", 3, [step(0, 0)] * 4, total_time=2.0, n_generated=4)
    point = run_point("x", [a, b], [plain, plain], fixed=False)
    assert point.speedup == pytest.approx((11 / 2) / (8 / 4))
    assert point.gamma == pytest.approx(12 / 5) and not point.fixed
    assert run_point("x", [a, b], [plain]).gamma == 4                       # a fixed run sits at its γ


def test_bench_points_only_from_the_same_setup(tmp_path):
    meta = {"target": "t", "draft": "d", "labels": {"draft": "labkit draft model, γ=4"},
            "ran_on": {"cpu": "CPU A", "draft_path": {"precision": "bf16"}}}
    (tmp_path / "bench.json").write_text(json.dumps({"meta": meta, "rows": []}))
    rows = [{"method": "ar", "new_tokens": 4, "steps": [[0, 0, 1, 0.0, 0.5]] * 4},
            {"method": "draft", "new_tokens": 4, "steps": [[4, 3, 4, 0.2, 0.3]]}]
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in [{"run": "r", "meta": meta}] + rows))
    points, why = bench_points(tmp_path, "CPU A", "t", "d", "bf16")
    assert why == "" and len(points) == 1
    assert points[0].speedup == pytest.approx((4 / 0.5) / (4 / 2.0))
    assert points[0].alpha == pytest.approx(3 / 4) and points[0].gamma == 4 and points[0].source == "bench"
    assert bench_points(tmp_path, "CPU B", "t", "d", "bf16")[0] == []
    assert bench_points(tmp_path, "CPU A", "t", "d", "int4")[0] == []
