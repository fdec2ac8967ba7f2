"""The numbers the notebook plots draw: the acceptance rule's two routes, acceptance counts, and the plots' bars."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from labkit.core.trace import (  # noqa: E402
    CacheLengths,  # noqa: E402
    Step,
    Trace,
)
from labkit.viz.plots import (  # noqa: E402
    accept_length_counts,
    acceptance_parts,
    per_position_acceptance,
    plot_cache_rollback,
    plot_distributions,
    plot_routes,
    plot_steps,
)


def make_trace(shape: list[tuple[int, int]]) -> Trace:
    """A trace from (γ, accepted) per step."""
    steps = [Step(list(range(g)), a, 0, a == g, 0.0, 0.0) for g, a in shape]
    return Trace("test", 3, steps, n_generated=sum(a + 1 for _, a in shape))


def test_acceptance_parts_recombine_to_the_target():
    g = torch.Generator().manual_seed(0)
    p, q = torch.rand(50, generator=g).softmax(0), torch.rand(50, generator=g).pow(4).softmax(0)
    parts = acceptance_parts(p, q)
    torch.testing.assert_close(parts.output, p.double())
    assert parts.beta == pytest.approx(float(torch.minimum(p, q).sum()))
    assert float(parts.residual.sum()) == pytest.approx(1.0)
    assert torch.all(parts.residual[q >= p] == 0)         # only tokens the draft under-proposes are resampled


def test_acceptance_parts_equal_distributions_and_bad_shapes():
    p = torch.tensor([0.5, 0.3, 0.2])
    parts = acceptance_parts(p, p.clone())
    assert parts.beta == pytest.approx(1.0)
    torch.testing.assert_close(parts.output, p.double())
    with pytest.raises(ValueError, match="two \\(V,\\) distributions"):
        acceptance_parts(p, torch.tensor([0.5, 0.5]))


def test_accept_length_counts_and_positions():
    trace = make_trace([(4, 4), (4, 0), (4, 2), (4, 2), (2, 1)])
    assert accept_length_counts(trace).tolist() == [1, 1, 2, 0, 1]
    assert accept_length_counts(trace, gamma=6).tolist() == [1, 1, 2, 0, 1, 0, 0]
    reached, accepted = per_position_acceptance(trace)
    # position 0: all 5 steps judged it, 4 kept it; 1: judged by all but (4,0), kept by (4,4) and (4,2)x2;
    # 2: judged by (4,4) and (4,2)x2, kept by (4,4) only; 3: judged and kept by (4,4)
    assert reached.tolist() == [5, 4, 3, 1]
    assert accepted.tolist() == [4, 3, 1, 1]


def test_plot_steps_bars():
    trace = make_trace([(4, 4), (4, 1), (3, 0)])
    fig, ax = plt.subplots()
    plot_steps(trace, ax)
    heights = [p.get_height() for p in ax.patches]
    assert heights == [4, 1, 0, 1, 1, 1, 0, 3, 3]           # accepted, target's token, rejected
    plt.close(fig)


def test_plot_cache_rollback_and_routes():
    fig, (a1, a2, a3) = plt.subplots(1, 3)
    plot_cache_rollback([CacheLengths(9, 15, 13), CacheLengths(14, 20, 20)], a1)
    assert [b.get_height() for b in a1.patches] == [13, 20, 2, 0]   # lengths after, then the rolled-back slots
    assert [b.get_y() for b in a1.patches[2:]] == [13, 20]
    p, q = torch.tensor([0.6, 0.3, 0.1]), torch.tensor([0.2, 0.6, 0.2])
    parts = acceptance_parts(p, q)
    plot_routes(parts, [0, 1, 2], ["a", "b", "c"], a2)
    stacked = np.array([b.get_height() for b in a2.patches]).reshape(2, 3).sum(0)
    np.testing.assert_allclose(stacked, p.numpy(), rtol=1e-6)   # the two routes stack up to p_target
    plot_distributions(p, q, [0, 1, 2], ["a", "b", "c"], a3)
    assert [round(b.get_height(), 6) for b in a3.patches] == [0.6, 0.3, 0.1, 0.2, 0.6, 0.2]
    plt.close(fig)


def test_pieces_can_keep_a_wide_drafts_answer_readable():
    from conftest import chatml_tokenizer

    from labkit.viz.render import pieces
    tok = chatml_tokenizer()
    ids = tok("abcdef", add_special_tokens=False)["input_ids"]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    # a tree step: root -> a (accepted) -> b (rejected, best-ranked child) -> <|im_end|> -> c; target then says "d"
    step = Step([ids[0], ids[1], end, ids[2]], 1, ids[3], False, 0.0, 0.0, parents=[-1, 0, 1, 2], path=[0])
    trace = Trace("test", 3, [step], n_generated=2)
    kinds = lambda ps: [(p.kind, p.text) for p in ps]                          # noqa: E731
    assert kinds(pieces(trace, ids[4:], tok)) == [("accepted", "a"), ("rejected", "b"), ("rejected", "<|im_end|>"),
                                                  ("rejected", "c"), ("correction", "d")]
    assert kinds(pieces(trace, ids[4:], tok, hide_control=True)) == [("accepted", "a"), ("rejected", "b"),
                                                                     ("correction", "d")]
    assert kinds(pieces(trace, ids[4:], tok, max_rejected=0)) == [("accepted", "a"), ("correction", "d")]
    with pytest.raises(ValueError, match="max_rejected must be >= 0"):
        pieces(trace, ids[4:], tok, max_rejected=-1)
