"""Batched decoding is exact per row: each row equals its own greedy autoregressive decoding."""
from functools import lru_cache

import pytest
import torch

from labkit import autoregressive_generate
from labkit.core.sampling import SamplingConfig
from labkit.decoding.batched import (
    RaggedCache,
    batched_autoregressive_generate,
    batched_speculative_generate,
    left_pad,
)

PROMPTS = [torch.tensor([5, 17, 33, 2, 9]), torch.tensor([1]), torch.tensor([7, 8, 9, 7, 8, 9, 7, 8]),
           torch.tensor([40, 41]), torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]), torch.tensor([60, 2, 60])]


def single(model, prompt, n):
    return _single(model, tuple(prompt.tolist()), n)


@lru_cache(maxsize=None)
def _single(model, prompt: tuple, n: int) -> list[int]:
    """Each row's own greedy decoding, computed once per (model, prompt, n)."""
    return autoregressive_generate(model, torch.tensor(prompt), max_new_tokens=n).tokens


def test_left_pad_right_aligns_rows():
    tokens, n_real = left_pad([[1, 2, 3], [4]])
    assert tokens.tolist() == [[1, 2, 3], [0, 0, 4]] and n_real.tolist() == [3, 1]


def test_ragged_cache_rows_roll_back_independently(tiny_target):
    """Feed, roll rows back by different amounts, feed again: logits as if each row were decoded alone."""
    rows = [[5, 17, 33, 2, 9], [7, 8]]
    cache = RaggedCache(tiny_target, 2, 64)
    cache.feed(*left_pad(rows))
    cache.feed(torch.tensor([[11, 12, 13], [21, 22, 23]]), torch.tensor([3, 3]))
    cache.truncate_rows(torch.tensor([6, 3]))              # row 0 keeps 11, row 1 keeps 21
    logits = cache.feed(torch.tensor([[40], [41]]), torch.tensor([1, 1]))[:, -1]
    for b, seq in enumerate([[5, 17, 33, 2, 9, 11, 40], [7, 8, 21, 41]]):
        alone = tiny_target(torch.tensor([seq]), tiny_target.new_cache(max_len=16))[0, -1]
        torch.testing.assert_close(logits[b], alone, rtol=1e-4, atol=1e-4)
    assert cache.length.tolist() == [7, 4]
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate_rows(torch.tensor([9, 1]))


@pytest.mark.parametrize("batch", [1, 3, 6])
def test_batched_autoregressive_equals_each_row_alone(tiny_target, batch):
    out = batched_autoregressive_generate(tiny_target, PROMPTS[:batch], max_new_tokens=20)
    assert out.tokens == [single(tiny_target, p, 20) for p in PROMPTS[:batch]]


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("batch", [1, 2, 6])
def test_batched_speculative_greedy_equals_each_row_alone(tiny_target, tiny_draft, batch, gamma):
    out = batched_speculative_generate(tiny_target, tiny_draft, PROMPTS[:batch], max_new_tokens=20, gamma=gamma)
    assert out.tokens == [single(tiny_target, p, 20) for p in PROMPTS[:batch]]
    if batch > 1:   # rows really accepted different lengths in the same step
        assert any(len({n for n in step if n is not None}) > 1 for step in out.n_accepted)


def test_batched_speculative_with_a_perfect_draft_accepts_everything(tiny_target):
    out = batched_speculative_generate(tiny_target, tiny_target, PROMPTS[:4], max_new_tokens=20, gamma=4)
    assert out.acceptance_rate == 1.0 and out.n_forwards == 4     # 5 tokens a step: 4 + the bonus
    assert out.tokens == [single(tiny_target, p, 20) for p in PROMPTS[:4]]


def test_batched_speculative_stops_each_row_at_eos(tiny_target, tiny_draft):
    ref = [single(tiny_target, p, 20) for p in PROMPTS[:3]]
    eos = ref[0][6]
    out = batched_speculative_generate(tiny_target, tiny_draft, PROMPTS[:3], 20, gamma=3, eos_token_ids=(eos,))
    for got, want in zip(out.tokens, ref):
        assert got == (want[: want.index(eos) + 1] if eos in want else want)


def test_batched_speculative_sampling_runs_and_a_perfect_draft_is_always_accepted(tiny_target):
    cfg = SamplingConfig(temperature=0.8, top_k=20)
    out = batched_speculative_generate(tiny_target, tiny_target, PROMPTS[:3], 15, gamma=3, sampling=cfg, seed=0)
    assert out.acceptance_rate == 1.0 and all(len(t) == 15 for t in out.tokens)
    again = batched_speculative_generate(tiny_target, tiny_target, PROMPTS[:3], 15, gamma=3, sampling=cfg, seed=0)
    assert again.tokens == out.tokens


def test_batched_refuses_bad_requests(tiny_target):
    with pytest.raises(ValueError, match="non-empty list"):
        batched_speculative_generate(tiny_target, tiny_target, [], 5)
    with pytest.raises(ValueError, match="gamma"):
        batched_speculative_generate(tiny_target, tiny_target, PROMPTS[:1], 5, gamma=0)
    with pytest.raises(ValueError, match="empty"):
        batched_autoregressive_generate(tiny_target, [torch.tensor([], dtype=torch.long)], 5)


def test_batched_speculative_sampling_draws_from_the_target_distribution(tiny_target, tiny_draft):
    """2000 rows of one prompt are 2000 independent runs: their first token follows p_target, not q_draft."""
    cfg = SamplingConfig(temperature=0.8, top_k=12)
    prompt = PROMPTS[0]
    with torch.no_grad():
        logits = tiny_target(prompt[None], tiny_target.new_cache(max_len=16))[0, -1]
        q_logits = tiny_draft(prompt[None], tiny_draft.new_cache(max_len=16))[0, -1]
    from labkit.core.sampling import probs_from_logits
    p_target, q_draft = probs_from_logits(logits, cfg), probs_from_logits(q_logits, cfg)
    n = 2000
    out = batched_speculative_generate(tiny_target, tiny_draft, [prompt] * n, 2, gamma=2, sampling=cfg, seed=0)
    empirical = torch.bincount(torch.tensor([t[0] for t in out.tokens]), minlength=p_target.numel()).float() / n
    tv = 0.5 * (empirical - p_target).abs().sum()
    assert tv < 0.05, f"total variation {tv:.3f} from p_target"
    assert 0.5 * (q_draft - p_target).abs().sum() > 0.15       # the draft alone would have failed this
    assert 0 < out.acceptance_rate < 1
