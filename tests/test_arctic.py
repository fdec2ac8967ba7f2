"""Arctic Inference's suffix cache as a peer of labkit's suffix drafter (labkit/bench/arctic.py).

The tree helpers and the refusal run everywhere; the rest runs where `make arctic` built arctic-inference's suffix
tree (its own C++ and SuffixDecodingCache), never in CI."""
import pytest
import torch

from labkit import SamplingConfig, autoregressive_generate, tree_generate
from labkit.bench import arctic
from labkit.drafters.suffix import SuffixDrafter

built = pytest.mark.skipif(not arctic.available(), reason="arctic-inference's suffix tree is not built (make arctic)")


def test_trees_compare_as_sets_of_paths_and_accept_their_longest_matching_path():
    a = arctic.paths([5, 6, 7, 8], [-1, 0, 0, 1])               # 5 -> 6 -> 8, 5 -> 7
    b = arctic.paths([5, 7, 6, 8], [-1, 0, 0, 2])               # the same tree, its nodes in another order
    assert a == b == {(5,), (5, 6), (5, 7), (5, 6, 8)}
    assert arctic.paths([5, 6], [-1, -1]) != arctic.paths([5, 6], [-1, 0])
    assert arctic.accepted(a, [5, 6, 8, 9]) == 3 and arctic.accepted(a, [5, 7, 1]) == 2
    assert arctic.accepted(a, [4]) == 0 and arctic.accepted(frozenset(), [5]) == 0


def test_the_bench_method_says_how_to_build_the_peer(tmp_path, monkeypatch):
    from labkit.bench.methods import check_methods, default_methods
    monkeypatch.setenv("LABKIT_ARCTIC", str(tmp_path / "none"))
    assert "arctic-suffix" not in default_methods("qwen2.5-coder-1.5b-instruct")
    with pytest.raises(ValueError, match="make arctic"):
        check_methods(["arctic-suffix"])


@built
def test_arctic_cache_drafts_the_tree_labkit_drafts_on_a_plain_repeat():
    prompt = torch.tensor([9, 1, 4, 2, 8, 3, 1, 4, 2])          # "1 4 2" was followed by 8 3 once
    ours, theirs = SuffixDrafter(), arctic.ArcticSuffixDrafter()
    for d in (ours, theirs):
        d.start(prompt)
    a, b = (d.propose(prompt, 8, SamplingConfig()) for d in (ours, theirs))
    assert b.k > 0 and b.tokens[0] == 8
    assert arctic.proposal_paths(a) == arctic.proposal_paths(b)


@built
@pytest.mark.parametrize("prompt", [torch.tensor([3, 7, 3, 7, 3, 7, 3]), torch.tensor([1, 4, 2, 1, 4, 7, 1, 4])])
def test_greedy_decoding_with_arctic_trees_equals_autoregressive(tiny_target, prompt):
    ref = autoregressive_generate(tiny_target, prompt, 40)
    out = tree_generate(tiny_target, arctic.ArcticSuffixDrafter(), prompt, 40, budget=16)
    assert out.tokens == ref.tokens
    assert out.trace.n_target_forwards < ref.trace.n_target_forwards


@built
def test_replay_counts_the_same_steps_for_both(tiny_target):
    prompt = [3, 7, 3, 7, 3, 7, 3]
    output = autoregressive_generate(tiny_target, torch.tensor(prompt), 30).tokens
    r = arctic.replay([(prompt, output)], budget=16)
    assert r["new_tokens"] == 30 and 0 <= r["same_tree"] <= 1 and r["steps_compared"] <= 30
    assert all(1 <= v <= 17 for v in r["tokens_per_forward"].values())
