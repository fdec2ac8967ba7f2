"""Layer-skip self-speculation: the skipped model is the target minus blocks, and decoding stays exact."""
import copy
import dataclasses
import sys

import pytest
import torch
from conftest import tiny_model
from test_sampling_heads import (
    T1,
    WARPED,
    chain_always_accepts,
    chi2_pvalue,
    exact_joint,
    first_two_counts,
)

from labkit import SpeculativeDecoder, autoregressive_generate, speculative_generate
from labkit.decoding.batched import batched_speculative_generate
from labkit.drafters.layer_skip import LayerSkipDrafter
from labkit.models.layer_skip import LayerSkipModel, agreement, search_skip_layers

PROMPTS = [torch.tensor([5, 17, 33, 2, 9]), torch.tensor([1]), torch.tensor([7, 8, 9, 7, 8, 9, 7, 8])]


QUIET = 2       # the block of `deep` that barely writes to the residual stream


@pytest.fixture(scope="module")
def deep():
    """Four layers, one of which (QUIET) adds almost nothing: skipping it should cost little agreement."""
    model = tiny_model(seed=2, n_layers=4)
    with torch.no_grad():
        model.layers[QUIET].self_attn.o_proj.weight.mul_(0.05)
        model.layers[QUIET].mlp.down_proj.weight.mul_(0.05)
    return model


def without(model, skip):
    """The reference: a real copy of the model with those blocks deleted."""
    cut = copy.deepcopy(model)
    cut.layers = torch.nn.ModuleList(b for i, b in enumerate(cut.layers) if i not in skip)
    cut.args = dataclasses.replace(cut.args, n_layers=len(cut.layers))
    return cut


@pytest.mark.parametrize("skip", [(), (1,), (0, 3), (1, 2, 3)])
def test_skipped_model_is_the_target_without_those_blocks(deep, skip):
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    skipped = LayerSkipModel(deep, skip)
    got = skipped(ids, skipped.new_cache(max_len=16))
    cut = without(deep, skip)
    torch.testing.assert_close(got, cut(ids, cut.new_cache(max_len=16)))
    if skip:
        assert not torch.allclose(got, deep(ids, deep.new_cache(max_len=16)))
    # one token at a time through the cache gives the same last logits
    cache = skipped.new_cache(max_len=16)
    skipped(ids[:, :-1], cache)
    torch.testing.assert_close(skipped(ids[:, -1:], cache)[0, -1], got[0, -1], rtol=1e-4, atol=1e-4)
    assert skipped.layer_fraction == (4 - len(skip)) / 4 and cache.k.shape[0] == 4 - len(skip)


def test_skipped_model_shares_the_targets_weights(deep):
    """No copy: changing a kept block of the target changes the skipped model; changing a skipped one does not."""
    target = copy.deepcopy(deep)
    skipped, ids = LayerSkipModel(target, (1,)), torch.tensor([[3, 1, 4, 1, 5]])
    before = skipped(ids, skipped.new_cache(max_len=8))
    with torch.no_grad():
        target.layers[1].mlp.down_proj.weight.mul_(3.0)                      # skipped
    torch.testing.assert_close(skipped(ids, skipped.new_cache(max_len=8)), before)
    with torch.no_grad():
        target.layers[2].mlp.down_proj.weight.mul_(3.0)                      # kept
    assert not torch.allclose(skipped(ids, skipped.new_cache(max_len=8)), before)


@pytest.mark.parametrize("skip", [(0,), (1,)])
def test_greedy_layer_skip_decoding_equals_autoregressive(tiny_target, skip):
    for prompt in PROMPTS:
        ref = autoregressive_generate(tiny_target, prompt, 24)
        out = speculative_generate(tiny_target, LayerSkipDrafter(tiny_target, skip), prompt, 24, gamma=3)
        assert out.tokens == ref.tokens


def test_layer_skip_drafts_are_accepted_and_batch(deep):
    out = speculative_generate(deep, LayerSkipDrafter(deep, (QUIET,)), PROMPTS[0], 32, gamma=3)
    assert out.trace.acceptance_rate > 0.6 and out.trace.tokens_per_forward > 2.5
    rows = batched_speculative_generate(deep, LayerSkipDrafter(deep, (QUIET,)), PROMPTS, 16, gamma=3)
    assert [g.tokens for g in rows] == [autoregressive_generate(deep, p, 16).tokens for p in PROMPTS]


@pytest.mark.serial                 # asserts a bound on measured time
def test_search_skips_the_layer_that_keeps_agreement_highest(deep):
    ids = torch.randint(0, 96, (48,), generator=torch.Generator().manual_seed(0))
    search = search_skip_layers(deep, ids, max_skip=2, gammas=(1, 3), repeats=1, progress=False)
    reference = deep(ids[None], deep.new_cache(max_len=48))[0].argmax(-1)
    singles = {i: agreement(LayerSkipModel(deep, [i]), ids, reference) for i in range(4)}
    assert search.order[0] == QUIET and search.agreement[0] == max(singles.values()) > 0.9
    assert len(set(search.order)) == 2 and len(search.cost) == 2 and set(search.verify_cost) == {1, 3}
    n, gamma = search.best
    assert search.predicted[n - 1][gamma] == max(v for row in search.predicted for v in row.values())
    assert search.skip == tuple(sorted(search.order[:n])) and search.to_dict()["chosen"]["gamma"] == gamma
    assert all(0 < c < 1.5 for c in search.cost)


def skip_counts(target, cfg):
    return first_two_counts(lambda seed: SpeculativeDecoder(target, LayerSkipDrafter(target, (1,)), torch.tensor(
        [1, 4, 2, 7, 3]), 8, gamma=2, sampling=cfg, seed=seed))


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("cfg", [T1, WARPED], ids=["t1", "t0.8-topk5-topp0.9"])
def test_sampled_layer_skip_decoding_matches_the_targets_sampling(cfg):
    target = tiny_model(seed=3, vocab_size=8, std=0.2, n_layers=3)
    counts, accepted = skip_counts(target, cfg)
    assert accepted > 500, "the skipped model's drafts should often be accepted, or the test checks only resampling"
    assert chi2_pvalue(counts, exact_joint(target, cfg)) > 1e-3


@pytest.mark.usefixtures("one_thread")
def test_a_broken_chain_rule_fails_the_layer_skip_test(monkeypatch):
    monkeypatch.setattr(sys.modules[SpeculativeDecoder.__module__], "speculative_accept", chain_always_accepts)
    target = tiny_model(seed=3, vocab_size=8, std=0.2, n_layers=3)
    counts, _ = skip_counts(target, T1)
    assert chi2_pvalue(counts, exact_joint(target, T1)) < 1e-6


def test_layer_skip_refuses_what_it_cannot_do(deep, tiny_target):
    with pytest.raises(ValueError, match=r"must lie in \[0, 4\)"):
        LayerSkipModel(deep, (4,))
    with pytest.raises(ValueError, match="keep at least one"):
        LayerSkipModel(deep, (0, 1, 2, 3))
    with pytest.raises(ValueError, match="drafts for the model it was built from"):
        speculative_generate(tiny_target, LayerSkipDrafter(deep, (1,)), PROMPTS[0], 4)
    with pytest.raises(ValueError, match="max_skip"):
        search_skip_layers(deep, torch.arange(32), max_skip=4)
    with pytest.raises(ValueError, match="at least 16 tokens"):
        search_skip_layers(deep, torch.arange(8))
