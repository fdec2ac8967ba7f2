"""Acceptance in the serving engines' words: labkit's counts from its traces and benchmark records, and a vLLM
server's /metrics page written the way vLLM writes it (its metric names and labels, through prometheus_client,
the library vLLM exports them with), read into the same counts and views."""
import json
import random

import matplotlib
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from labkit.bench.report import aggregate, summarise
from labkit.bench.vllm_metrics import parse_vllm_metrics, read_vllm_metrics
from labkit.cli import main
from labkit.core.engine_counts import DraftCounts, count_drafts
from labkit.core.trace import Step, Trace
from labkit.viz.calculator import iid_accept_distribution, pooled_accept_counts

matplotlib.use("Agg")


def vllm_page(drafts_per_engine: dict[str, list[tuple[int, int]]], num_spec_tokens: int,
              model_name: str = "Qwen/Qwen2.5-Coder-1.5B-Instruct") -> str:
    """The /metrics text of a vLLM server whose engines verified these (draft tokens, accepted) drafts.

    As vLLM's SpecDecodingProm: four counters labelled [model_name, engine], the last also by position, one
    child per position 0..num_spec_tokens-1; SpecDecodingStats.observe_draft adds 1 at positions 0..accepted-1.
    """
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels, registry=registry)
    tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels, registry=registry)
    accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", labels,
                       registry=registry)
    per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                      labels + ["position"], registry=registry)
    for engine, observed in drafts_per_engine.items():
        children = [per_pos.labels(model_name, engine, str(p)) for p in range(num_spec_tokens)]
        for k, n in observed:
            drafts.labels(model_name, engine).inc(1)
            tokens.labels(model_name, engine).inc(k)
            accepted.labels(model_name, engine).inc(n)
            for p in range(n):
                children[p].inc(1)
    return generate_latest(registry).decode()


def random_drafts(n: int, gamma: int, alpha: float, seed: int) -> list[tuple[int, int]]:
    """n chains of γ draft tokens, each token kept with probability α while the ones before it were."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        kept = 0
        while kept < gamma and rng.random() < alpha:
            kept += 1
        out.append((gamma, kept))
    return out


def test_a_vllm_page_reads_as_vllm_counts_it_and_as_labkit_counts_the_same_drafts():
    engines = {"0": random_drafts(400, 3, 0.7, seed=1), "1": random_drafts(250, 3, 0.7, seed=2)}
    page = vllm_page(engines, num_spec_tokens=3)
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total{" in page and "_created" in page
    counts = parse_vllm_metrics(page)
    everything = engines["0"] + engines["1"]
    assert counts == count_drafts(everything)              # the engine's counters and labkit's, one set of drafts
    assert counts.drafts == 650 and counts.draft_tokens == 1950 and counts.gamma == 3
    accepted = sum(n for _, n in everything)
    # vLLM's own formulas (SpecDecodingLogging.log): 1 + accepted / drafts; per position sum / drafts
    assert counts.mean_acceptance_length == pytest.approx(1 + accepted / 650)
    assert counts.per_position_rate.tolist() == pytest.approx(
        [sum(n > p for _, n in everything) / 650 for p in range(3)])
    assert counts.draft_acceptance_rate == pytest.approx(accepted / 1950)
    # every draft had γ = 3 tokens: judged = accepted + one rejection per draft that stopped short
    assert counts.judged_alpha == pytest.approx(accepted / (accepted + sum(n < 3 for _, n in everything)))
    assert counts.judged_alpha == pytest.approx(0.7, abs=0.04)
    assert counts.accept_length_counts.tolist() == np.bincount([n for _, n in everything], minlength=4).tolist()


def test_one_model_of_several_and_the_interval_between_two_pages():
    a = random_drafts(100, 4, 0.6, seed=3)
    b = random_drafts(30, 2, 0.9, seed=4)
    page = vllm_page({"0": a}, 4, "model-a") + vllm_page({"0": b}, 2, "model-b")
    with pytest.raises(ValueError, match="counts 2 models"):
        parse_vllm_metrics(page)
    assert parse_vllm_metrics(page, "model-a") == count_drafts(a)
    assert parse_vllm_metrics(page, "model-b").gamma == 2
    more = random_drafts(50, 4, 0.6, seed=5)
    later = parse_vllm_metrics(vllm_page({"0": a + more}, 4, "model-a"))
    assert later - parse_vllm_metrics(page, "model-a") == count_drafts(more)
    assert count_drafts(a) + count_drafts(more) == later


def test_a_trace_and_a_benchmark_record_count_alike():
    steps = [Step([5, 6, 7], 3, 8, True, 0.0, 0.0), Step([1, 2, 3], 1, 4, False, 0.0, 0.0),
             Step([], 0, 9, True, 0.0, 0.0, asked=0), Step([4, 4], 0, 2, False, 0.0, 0.0)]
    trace = Trace("draft", prompt_len=3, steps=steps, n_generated=8)
    counts = trace.draft_counts
    assert counts == DraftCounts(3, 8, 4, (2, 1, 1))       # the plain step is no draft
    assert counts.mean_acceptance_length == pytest.approx(1 + 4 / 3)
    assert trace.tokens_per_forward == 2.0                 # the plain step counted: lower than the engines' number
    summary = trace.summary()
    assert summary["mean_acceptance_length"] == pytest.approx(7 / 3)
    assert summary["acceptance_per_position"] == [round(2 / 3, 4), round(1 / 3, 4), round(1 / 3, 4)]
    assert counts.accept_length_counts.tolist() == pooled_accept_counts([trace]).tolist()
    tree = Trace("eagle", 3, [Step([1, 2, 3, 4, 5], 2, 7, False, 0.0, 0.0, parents=[-1, 0, 0, 1, 2], path=[0, 3])])
    assert tree.draft_counts == DraftCounts(1, 5, 2, (1, 1))   # a tree's positions: the accepted depth


def test_the_bench_report_gives_the_engines_numbers():
    def rec(q, method, tokens, forwards, steps):
        return {"run": "k", "question_id": q, "question_sha": "s", "category": "c", "method": method,
                "reference": "ar", "exact": True, "prompt_tokens": 5, "new_tokens": len(tokens), "tokens": tokens,
                "seconds": 1.0, "target_forwards": forwards, "draft_time": 0.1, "verify_time": 0.5, "steps": steps}
    ar = [[0, 0, 1, 0.0, 0.1]] * 6
    draft = [[3, 3, 1, 0.03, 0.1], [3, 1, 0, 0.03, 0.1], [0, 0, 1, 0.0, 0.1]]         # the last: plain
    rows, _ = aggregate([rec("q1", "ar", [1] * 6, 6, ar), rec("q1", "draft", [1] * 7, 3, draft)])
    row = next(r for r in rows if r.method == "draft" and r.category == "all")
    assert row.mean_acceptance_length == pytest.approx(1 + 4 / 2)
    assert row.acceptance_per_position == [1.0, 0.5, 0.5]
    assert next(r for r in rows if r.method == "ar").mean_acceptance_length is None
    md = summarise({"questions": "q.jsonl", "date": "d", "machine": "m", "target": "t", "draft": "d",
                    "dtype": "bf16", "max_new_tokens": 8, "gamma": 3}, rows, [])
    assert "| acc. len |" in md and "| draft | 3.00 | 1.00 | 0.50 | 0.50 |" in md
    assert "mean acceptance length as vLLM" in md


def test_the_views_draw_a_production_run(tmp_path):
    import matplotlib.pyplot as plt

    from labkit.viz.acceptance import conditional_rates, plot_acceptance
    counts = parse_vllm_metrics(vllm_page({"0": random_drafts(2000, 5, 0.8, seed=6)}, 5))
    fig, axes = plt.subplots(1, 2)
    numbers = plot_acceptance(counts, axes)
    plt.close(fig)
    assert sum(numbers["shares"]) == pytest.approx(1) and sum(numbers["iid"]) == pytest.approx(1)
    assert numbers["iid"] == pytest.approx(iid_accept_distribution(counts.judged_alpha, [5]).tolist())
    assert numbers["shares"] == pytest.approx(numbers["iid"], abs=0.03)     # these drafts are i.i.d.
    assert conditional_rates(counts) == pytest.approx([0.8] * 5, abs=0.04)
    assert numbers["per_position"] == pytest.approx([0.8 ** (i + 1) for i in range(5)], abs=0.04)
    with pytest.raises(ValueError, match="hold no draft"):
        plot_acceptance(DraftCounts(0, 0, 0, ()), axes)


def test_the_acceptance_command(tmp_path, capsys):
    first = random_drafts(300, 3, 0.75, seed=7)
    more = random_drafts(200, 3, 0.5, seed=8)
    (tmp_path / "early.txt").write_text(vllm_page({"0": first}, 3))
    (tmp_path / "late.txt").write_text(vllm_page({"0": first + more}, 3))
    assert main(["acceptance", str(tmp_path / "late.txt"), "--since", str(tmp_path / "early.txt"), "--json",
                 "--draft-cost", "0.1", "--plot", str(tmp_path / "a.png")]) == 0
    out = json.loads(capsys.readouterr().out)
    counts = count_drafts(more)
    assert out["drafts"] == 200 and out["mean_acceptance_length"] == pytest.approx(counts.mean_acceptance_length)
    assert out["judged_alpha"] == pytest.approx(counts.judged_alpha)
    assert out["best_gamma"] == int(max(out["expected_speedup"], key=lambda g: out["expected_speedup"][g]))
    assert (tmp_path / "a.png").stat().st_size > 10_000
    assert main(["acceptance", str(tmp_path / "early.txt")]) == 0
    text = capsys.readouterr().out
    assert f"mean acceptance length {count_drafts(first).mean_acceptance_length:.2f}" in text
    assert "per-position acceptance [" in text and "300 drafts of up to 3 tokens" in text
    assert read_vllm_metrics(tmp_path / "early.txt") == count_drafts(first)
