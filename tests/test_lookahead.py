"""Lookahead decoding: Jacobi converges, the window's cells see their trajectories, and decoding stays exact."""

import pytest
import torch

from labkit import (
    SamplingConfig,
    autoregressive_generate,
    speculative_generate,
    tree_generate,
)
from labkit.decoding.jacobi import jacobi_decode
from labkit.drafters.lookahead import LookaheadDrafter, NGramPool

PROMPTS = [torch.tensor([3, 7, 3, 7, 3, 7, 3]), torch.tensor([1, 4, 2, 1, 4, 7, 1, 4]),
           torch.tensor([5, 17, 33, 2, 9, 17, 33, 2])]


def test_jacobi_fixes_one_more_token_each_pass_and_ends_at_the_greedy_continuation(tiny_target):
    prompt, n = PROMPTS[2], 8
    greedy = torch.tensor(autoregressive_generate(tiny_target, prompt, n).tokens)         # (n,) new tokens
    block = jacobi_decode(tiny_target, prompt, n)
    rows = block.rows
    assert block.tokens == greedy.tolist() and block.trace.n_target_forwards == rows.shape[0] - 1
    assert [s.n_accepted for s in block.trace.steps][-1] == n or block.trace.stop_reason == "max_iterations"
    assert torch.equal(rows[-1], greedy)
    for i, row in enumerate(rows):
        assert torch.equal(row[:i], greedy[:i]), f"after pass {i} the first {i} tokens must be right"
    assert torch.equal(rows[-1], rows[-2]) or rows.shape[0] == n + 1     # stopped at the fixed point or after n


def test_pool_keeps_the_latest_n_grams_of_each_first_token():
    pool = NGramPool(per_key=2)
    for rest in [(1, 2), (3, 4), (1, 2), (5, 6)]:
        pool.add(9, rest)
    assert pool.get(9) == [(5, 6), (1, 2)] and pool.get(8) == [] and len(pool) == 2


def test_window_cells_sit_on_their_jacobi_trajectories():
    W, N = 4, 4
    drafter = LookaheadDrafter(window=W, ngram=N, max_verify=0)
    drafter.start(torch.arange(10, 30))
    window = drafter.window.clone()                                       # (N-1, W)
    proposal = drafter.propose(torch.arange(10, 30), 64, SamplingConfig())
    tree = proposal.as_tree()
    assert proposal.k == (N - 1) * W
    for j in range(N - 1):
        for i in range(W):
            node = int(drafter.cells[j, i])
            seen = proposal.tokens[tree.paths_to(node)].tolist()
            assert seen == window[0, : i + 1].tolist() + window[1: j + 1, i].tolist()
            assert int(tree.depth[node]) == 1 + i + j                     # RoPE position root + 1 + i + j


def test_the_update_harvests_each_column_and_shifts_the_levels():
    drafter = LookaheadDrafter(window=3, ngram=3, max_verify=2)
    drafter.start(torch.arange(40, 60))
    window = drafter.window.clone()                                       # (2, 3)
    proposal = drafter.propose(torch.arange(40, 60), 64, SamplingConfig())
    verdict = torch.arange(100, 101 + proposal.k)                         # a distinct "target token" after every node
    drafter.iterate(verdict)
    new = verdict[1 + drafter.cells[-1]]                                  # (3,)
    for i in range(3):
        assert (window[1, i].item(), new[i].item()) in drafter.pool.get(window[0, i].item())
    assert torch.equal(drafter.window, torch.stack([window[1], new]))
    drafter.commit(19 + 3)                                                # root moved 3 places: 1 level + 2 columns
    assert torch.equal(drafter.window[:, :1], torch.stack([window[1], new])[:, 2:])


def test_the_window_waits_when_it_does_not_fit_the_budget():
    drafter = LookaheadDrafter(window=4, ngram=3)
    drafter.start(torch.arange(20))
    assert drafter.propose(torch.arange(20), 7, SamplingConfig()).k == 0     # 8 window nodes > 7
    assert drafter.cells is None
    drafter.iterate(torch.zeros(1, dtype=torch.long))                        # nothing to update
    window = drafter.window.clone()
    drafter.commit(19 + 1)                                                   # one token, no level shift: 1 column
    assert torch.equal(drafter.window[:, :3], window[:, 1:])


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("from_prompt", [False, True], ids=["pure", "pool-from-prompt"])
def test_greedy_lookahead_decoding_equals_autoregressive(tiny_target, prompt, from_prompt):
    ref = autoregressive_generate(tiny_target, prompt, 40)
    drafter = LookaheadDrafter(window=4, ngram=3, max_verify=3, pool_from_prompt=from_prompt)
    out = tree_generate(tiny_target, drafter, prompt, 40, budget=32)
    assert out.tokens == ref.tokens
    assert out.trace.n_target_forwards < ref.trace.n_target_forwards     # tiny models repeat: n-grams are accepted
    assert len(drafter.pool) > 0


def test_jacobi_guesses_alone_are_accepted(tiny_target):
    """No pool verified (G=0): only the window's level-0 chain is a candidate, and it is still accepted."""
    ref = autoregressive_generate(tiny_target, PROMPTS[2], 40)
    out = tree_generate(tiny_target, LookaheadDrafter(window=5, ngram=3, max_verify=0), PROMPTS[2], 40, budget=32)
    assert out.tokens == ref.tokens
    assert sum(s.n_accepted for s in out.trace.steps) > 0


def test_lookahead_refuses_bad_settings_and_the_chain_loop(tiny_target):
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        LookaheadDrafter(window=0)
    with pytest.raises(ValueError, match="ngram must be an integer >= 2"):
        LookaheadDrafter(ngram=1)
    with pytest.raises(ValueError, match="larger|more than the target's context"):
        tree_generate(tiny_target, LookaheadDrafter(window=tiny_target.max_seq_len), PROMPTS[0], 4)
    with pytest.raises(ValueError, match="only the tree loop"):
        speculative_generate(tiny_target, LookaheadDrafter(), PROMPTS[0], 4)
    with pytest.raises(ValueError, match="call start"):
        LookaheadDrafter().propose(torch.tensor([1, 2]), 8, SamplingConfig())
    with pytest.raises(ValueError, match="n \\(tokens in the Jacobi block\\)"):
        jacobi_decode(tiny_target, PROMPTS[0], 0)
