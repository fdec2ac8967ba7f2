"""Suffix decoding: the trie counts what it saw, the tree follows the counts, and decoding stays exact."""

import pytest
import torch

from labkit import SamplingConfig, autoregressive_generate, tree_generate
from labkit.drafters.suffix import SuffixDrafter, SuffixTrie, speculate


def test_trie_counts_every_substring_up_to_its_depth():
    trie = SuffixTrie(max_len=3)
    seq = trie.new_sequence()
    trie.extend(seq, [5, 6, 7])
    trie.extend(seq, [5, 6])                               # a sequence grows across calls
    assert trie.find([5]).count == 2 and trie.find([5, 6]).count == 2 and trie.find([6, 7, 5]).count == 1
    assert set(trie.find([5, 6]).children) == {7}
    assert trie.find([5, 6, 7, 5]) is None                 # longer than max_len: not indexed
    assert trie.find([7, 7]) is None and trie.n_tokens == 5
    again = SuffixTrie(max_len=3)
    again.extend(again.new_sequence(), [5, 6, 7, 5, 6])    # the same counts in one call
    for pattern in ([5], [6], [7], [5, 6], [6, 7], [7, 5], [5, 6, 7], [6, 7, 5], [7, 5, 6]):
        assert again.find(pattern).count == trie.find(pattern).count, pattern


def test_match_is_the_longest_suffix_that_was_continued_before():
    trie = SuffixTrie(max_len=8)
    context = [1, 2, 3, 9, 2, 3, 4, 8, 2, 3]
    trie.extend(trie.new_sequence(), context)
    node, p = trie.match(context, max_pattern=5)
    assert p == 2 and set(node.children) == {9, 4}        # "2 3" was followed by 9 and by 4; "8 2 3" never before
    assert trie.match([7], max_pattern=5) == (None, 0)


def test_speculate_grows_the_likeliest_paths_first():
    trie = SuffixTrie(max_len=8)
    trie.extend(trie.new_sequence(), [0, 1, 2, 0, 1, 2, 0, 1, 3, 0, 5])
    tokens, parents, scores = speculate(trie.find([0]), max_nodes=10, max_depth=3, min_prob=0.1)
    # after 0: 1 three times in four, 5 once; after "0 1": 2 twice, 3 once; after "0 1 2": 0 twice
    assert tokens[:3] == [1, 2, 0] and parents[:3] == [-1, 0, 1]
    assert scores[0] == pytest.approx(0.75) and scores[1] == pytest.approx(0.5)
    assert all(p < i for i, p in enumerate(parents)) and scores == sorted(scores, reverse=True)
    assert set(zip(tokens, parents)) >= {(5, -1), (3, 0)}
    few, _, _ = speculate(trie.find([0]), max_nodes=2, max_depth=3, min_prob=0.1)
    assert few == [1, 2]
    sure, _, _ = speculate(trie.find([0]), max_nodes=10, max_depth=3, min_prob=0.6)
    assert sure == [1]                                    # 0.75; "1 2" is 0.5 < 0.6
    shallow, _, _ = speculate(trie.find([0]), max_nodes=10, max_depth=1, min_prob=0.0)
    assert sorted(shallow) == [1, 5]


def test_drafter_proposes_a_tree_whose_size_follows_the_match_length():
    prompt = torch.tensor([4, 2, 1, 4, 2, 7, 1, 4, 2])     # "1 4 2" matched (3 tokens); then 1 or 7 followed
    drafter = SuffixDrafter(spec_factor=1.0, min_prob=0.0)
    drafter.start(prompt)
    proposal = drafter.propose(prompt, 16, SamplingConfig())
    assert proposal.k == 3 and proposal.tree is not None
    assert proposal.tokens[:2].tolist() in ([7, 1], [1, 4]) and proposal.tree.parents[0] == -1
    assert drafter.propose(prompt, 1, SamplingConfig()).k == 1          # the decoder's budget caps it
    lone = torch.tensor([1, 2, 3])
    drafter.start(lone)
    assert drafter.propose(lone, 8, SamplingConfig()).k == 0            # nothing repeats: no proposal


def test_earlier_outputs_are_remembered_across_requests():
    drafter = SuffixDrafter(remember=True)
    first = torch.tensor([1, 2, 3, 10, 11, 12, 13, 14, 15])
    drafter.start(first[:3])
    drafter.propose(first, 4, SamplingConfig())                         # sees the output 10..15
    second = torch.tensor([9, 9, 10, 11, 12])
    drafter.start(second)                                               # the first output joins the index
    assert drafter.propose(second, 4, SamplingConfig()).tokens.tolist()[:2] == [13, 14]
    plain = SuffixDrafter()
    plain.observe([20, 21, 22, 23])
    plain.start(torch.tensor([5, 21, 22]))
    assert plain.propose(torch.tensor([5, 21, 22]), 4, SamplingConfig()).tokens.tolist()[:1] == [23]


PROMPTS = [torch.tensor([3, 7, 3, 7, 3, 7, 3]), torch.tensor([1, 4, 2, 1, 4, 7, 1, 4]),
           torch.tensor([5, 17, 33, 2, 9, 17, 33, 2])]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_suffix_decoding_equals_autoregressive(tiny_target, prompt):
    ref = autoregressive_generate(tiny_target, prompt, 40)
    out = tree_generate(tiny_target, SuffixDrafter(), prompt, 40, budget=16)
    assert out.tokens == ref.tokens
    assert out.trace.n_target_forwards < ref.trace.n_target_forwards   # tiny models repeat: drafts are accepted


def test_suffix_trees_branch_on_a_real_step(tiny_target):
    out = tree_generate(tiny_target, SuffixDrafter(min_prob=0.0, spec_factor=4.0), PROMPTS[1], 30, budget=16)
    branching = [s for s in out.trace.steps if s.parents and len(s.parents) != len(set(s.parents))]
    assert branching, "some step should propose two continuations of one node"


def test_suffix_drafter_refuses_bad_settings():
    with pytest.raises(ValueError, match="max_pattern must be an integer >= 1"):
        SuffixDrafter(max_pattern=0)
    with pytest.raises(ValueError, match="spec_factor"):
        SuffixDrafter(spec_factor=0)
    with pytest.raises(ValueError, match="min_prob"):
        SuffixDrafter(min_prob=1.0)
    with pytest.raises(ValueError, match="call start"):
        SuffixDrafter().propose(torch.tensor([1, 2]), 4, SamplingConfig())
