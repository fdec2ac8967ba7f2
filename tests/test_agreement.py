"""compare_decodes: where two greedy decodes part, and whether the target's tie there explains it."""
import torch

from labkit.models.transformer import ModelArgs, Transformer
from labkit.viz.agreement import NEAR_TIE, compare_decodes


def model():
    return Transformer(ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64)).init_random()


def test_identical_decodes():
    a = compare_decodes(model(), torch.tensor([1, 2, 3]), [5, 6, 7], [5, 6, 7, 8])
    assert a.identical and a.n_same == 3 and a.n == 3
    assert a.sentence() == "same tokens as plain decoding: all 3"


def test_the_gap_is_the_targets_top2_where_they_part():
    m = model()
    prompt = torch.tensor([1, 2, 3])
    a = compare_decodes(m, prompt, [5, 6, 7], [5, 9, 7])
    assert a.n_same == 1 and not a.identical
    logits = m(torch.tensor([[1, 2, 3, 5]]), m.new_cache(max_len=4))[0, -1]
    top2 = logits.topk(2).values
    assert abs(a.gap - float(top2[0] - top2[1])) < 1e-5
    assert a.near_tie == (a.gap < NEAR_TIE)
    assert ("near-tie" in a.sentence()) == a.near_tie and ("bug" in a.sentence()) == (not a.near_tie)
