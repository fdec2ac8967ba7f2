"""Batched decoding is exact per row: each row equals its own greedy autoregressive decoding."""
from functools import lru_cache

import pytest
import torch

from labkit import autoregressive_generate
from labkit.core.sampling import SamplingConfig, probs_from_logits
from labkit.decoding.batched import (
    accept_rows,
    batch_summary,
    batched_autoregressive_generate,
    batched_speculative_generate,
)
from labkit.drafters import DraftModelDrafter, PromptLookupDrafter
from labkit.models.ragged_cache import RaggedCache, left_pad, unpad

PROMPTS = [torch.tensor([5, 17, 33, 2, 9]), torch.tensor([1]), torch.tensor([7, 8, 9, 7, 8, 9, 7, 8]),
           torch.tensor([40, 41]), torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]), torch.tensor([60, 2, 60])]


def single(model, prompt, n):
    return _single(model, tuple(prompt.tolist()), n)


@lru_cache(maxsize=None)
def _single(model, prompt: tuple, n: int) -> list[int]:
    """Each row's own greedy decoding, computed once per (model, prompt, n)."""
    return autoregressive_generate(model, torch.tensor(prompt), max_new_tokens=n).tokens


def test_left_pad_right_aligns_rows_and_unpad_left_aligns_them():
    tokens, n_real = left_pad([[1, 2, 3], [4], []])
    assert tokens.tolist() == [[1, 2, 3], [0, 0, 4], [0, 0, 0]] and n_real.tolist() == [3, 1, 0]
    assert unpad(tokens, n_real)[:, :1].tolist() == [[1], [4], [0]]
    assert unpad(tokens, n_real)[0].tolist() == [1, 2, 3]


def tokens(gens):
    return [g.tokens for g in gens]


def n_accepted(gens):
    """Per batch forward, each row's accepted count (None once the row has finished)."""
    steps = max(len(g.trace.steps) for g in gens)
    return [[g.trace.steps[i].n_accepted if i < len(g.trace.steps) else None for g in gens] for i in range(steps)]


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
    assert tokens(out) == [single(tiny_target, p, 20) for p in PROMPTS[:batch]]
    assert all(g.trace.n_generated == 20 and g.trace.stop_reason == "max_new_tokens" for g in out)


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("batch", [1, 2, 6])
def test_batched_speculative_greedy_equals_each_row_alone(tiny_target, tiny_draft, batch, gamma):
    out = batched_speculative_generate(tiny_target, DraftModelDrafter(tiny_draft), PROMPTS[:batch], max_new_tokens=20,
                                       gamma=gamma)
    assert tokens(out) == [single(tiny_target, p, 20) for p in PROMPTS[:batch]]
    if batch > 1:   # rows really accepted different lengths in the same step
        assert any(len({n for n in step if n is not None}) > 1 for step in n_accepted(out))


@pytest.mark.parametrize("batch", [2, 6])
def test_batched_prompt_lookup_greedy_equals_each_row_alone(tiny_target, batch):
    """Any chain drafter batches: prompt lookup proposes a different length per row (often none)."""
    out = batched_speculative_generate(tiny_target, PromptLookupDrafter(), PROMPTS[:batch], max_new_tokens=20, gamma=4)
    assert tokens(out) == [single(tiny_target, p, 20) for p in PROMPTS[:batch]]
    lengths = {len(s.proposed) for g in out for s in g.trace.steps}
    assert 0 in lengths and max(lengths) > 0


def test_batched_draft_model_drafts_as_one_row_would(tiny_target, tiny_draft):
    """The draft model's batched proposals (one forward for all rows) equal its one-row proposals."""
    drafter, alone = DraftModelDrafter(tiny_draft), DraftModelDrafter(tiny_draft)
    batched = drafter.rows(PROMPTS[:4], max_len=64).propose(PROMPTS[:4], [3, 0, 5, 1], SamplingConfig())
    for prompt, k, got in zip(PROMPTS[:4], [3, 0, 5, 1], batched):
        alone.start(prompt)
        want = alone.propose(prompt, k, SamplingConfig()) if k else None
        assert got.tokens.tolist() == ([] if want is None else want.tokens.tolist())
        if want is not None:
            torch.testing.assert_close(got.q_token, want.q_token, rtol=1e-4, atol=1e-5)


def test_batched_speculative_with_a_perfect_draft_accepts_everything(tiny_target):
    out = batched_speculative_generate(tiny_target, DraftModelDrafter(tiny_target), PROMPTS[:4], max_new_tokens=20,
                                       gamma=4)
    summary = batch_summary(out)
    assert summary["acceptance_rate"] == 1.0 and summary["target_forwards"] == 4     # 5 tokens a step: 4 + the bonus
    assert tokens(out) == [single(tiny_target, p, 20) for p in PROMPTS[:4]]
    assert summary["new_tokens"] == 80 and summary["decode_time"] > 0


def test_batched_speculative_stops_each_row_at_eos(tiny_target, tiny_draft):
    ref = [single(tiny_target, p, 20) for p in PROMPTS[:3]]
    eos = ref[0][6]
    out = batched_speculative_generate(tiny_target, DraftModelDrafter(tiny_draft), PROMPTS[:3], 20, gamma=3,
                                       eos_token_ids=(eos,))
    for got, want in zip(out, ref):
        assert got.tokens == (want[: want.index(eos) + 1] if eos in want else want)
        assert got.trace.stop_reason == ("eos" if eos in want else "max_new_tokens")


def test_batched_speculative_sampling_runs_and_a_perfect_draft_is_always_accepted(tiny_target):
    cfg = SamplingConfig(temperature=0.8, top_k=20)
    run = lambda: batched_speculative_generate(tiny_target, DraftModelDrafter(tiny_target), PROMPTS[:3], 15,  # noqa: E731
                                               gamma=3, sampling=cfg, seed=0)
    out = run()
    assert batch_summary(out)["acceptance_rate"] == 1.0 and all(len(t) == 15 for t in tokens(out))
    assert tokens(run()) == tokens(out)


def test_batched_refuses_bad_requests(tiny_target):
    with pytest.raises(ValueError, match="non-empty list"):
        batched_speculative_generate(tiny_target, DraftModelDrafter(tiny_target), [], 5)
    with pytest.raises(ValueError, match="gamma"):
        batched_speculative_generate(tiny_target, DraftModelDrafter(tiny_target), PROMPTS[:1], 5, gamma=0)
    with pytest.raises(ValueError, match="DraftModelDrafter"):
        batched_speculative_generate(tiny_target, tiny_target, PROMPTS[:1], 5)
    with pytest.raises(ValueError, match="empty"):
        batched_autoregressive_generate(tiny_target, [torch.tensor([], dtype=torch.long)], 5)


def test_batched_speculative_sampling_draws_from_the_target_distribution(tiny_target, tiny_draft):
    """2000 rows of one prompt are 2000 independent runs: their first token follows p_target, not q_draft."""
    cfg = SamplingConfig(temperature=0.8, top_k=12)
    prompt = PROMPTS[0]
    with torch.no_grad():
        logits = tiny_target(prompt[None], tiny_target.new_cache(max_len=16))[0, -1]
        q_logits = tiny_draft(prompt[None], tiny_draft.new_cache(max_len=16))[0, -1]
    p_target, q_draft = probs_from_logits(logits, cfg), probs_from_logits(q_logits, cfg)
    n = 2000
    out = batched_speculative_generate(tiny_target, DraftModelDrafter(tiny_draft), [prompt] * n, 2, gamma=2,
                                       sampling=cfg, seed=0)
    empirical = torch.bincount(torch.tensor([t[0] for t in tokens(out)]), minlength=p_target.numel()).float() / n
    tv = 0.5 * (empirical - p_target).abs().sum()
    assert tv < 0.05, f"total variation {tv:.3f} from p_target"
    assert 0.5 * (q_draft - p_target).abs().sum() > 0.15       # the draft alone would have failed this
    assert 0 < batch_summary(out)["acceptance_rate"] < 1


def test_accept_rows_caps_each_row_at_its_own_proposal_greedy():
    """Padding that happens to match the target's argmax is not accepted; the next token is the argmax after
    the row's own proposal."""
    logits = torch.zeros(2, 4, 5)
    logits[:, :, 0] = 1.0                                          # the target wants token 0 everywhere...
    logits[:, 3, 4] = 2.0                                          # ... but 4 after three tokens
    draft = torch.zeros(2, 3, dtype=torch.long)                    # row 0 proposes [0, 0], row 1 nothing; 0-padded
    n, nxt = accept_rows(draft, torch.tensor([2, 0]), logits, None, SamplingConfig())
    assert n.tolist() == [2, 0] and nxt.tolist() == [0, 0]


def test_accept_rows_sampled_bonus_comes_from_p_after_the_row_s_proposal():
    """A row that proposed 1 of K=3 slots: when its token is kept, the next token follows p_target[1]
    (not the distribution at the end of the padding)."""
    g = torch.Generator().manual_seed(0)
    V, B = 6, 4000
    p = torch.tensor([[0.5, 0.1, 0.1, 0.1, 0.1, 0.1],              # p_target[0]: token 0 half the time
                      [0.0, 0.7, 0.1, 0.1, 0.1, 0.0],              # p_target[1]: the bonus distribution
                      [0.2, 0.2, 0.2, 0.2, 0.2, 0.0],
                      [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])             # at the padding's end: a wrong answer
    logits = p.clamp(min=1e-12).log().expand(B, 4, V).clone()
    draft = torch.zeros(B, 3, dtype=torch.long)                    # proposes token 0 (deterministic)
    q = torch.zeros(B, 3, V)
    q[:, 0, 0] = 1.0                                               # one-hot; zero past the proposal
    n, nxt = accept_rows(draft, torch.ones(B, dtype=torch.long), logits, q, SamplingConfig(temperature=1.0), g)
    joint = torch.zeros(2, V)
    joint.index_put_((n, nxt), torch.ones(B), accumulate=True)
    want = torch.stack([torch.cat([torch.zeros(1), p[0, 1:]]),     # rejected: the residual of p0 without token 0
                        p[0, 0] * p[1]])                           # kept: p0(0) times the bonus distribution
    assert 0.5 * (joint / B - want).abs().sum() < 0.03


def test_a_batch_steps_like_any_decoder_one_forward_for_every_live_row(tiny_target):
    from labkit.decoding.batched import BatchedSpeculativeDecoder
    sampling = SamplingConfig(temperature=0.8)
    dec = BatchedSpeculativeDecoder(tiny_target, PromptLookupDrafter(), PROMPTS, 10, gamma=3, sampling=sampling, seed=5)
    steps = 0
    while not dec.done:
        dec.step()
        steps += 1
    stepped = dec.result()
    whole = batched_speculative_generate(tiny_target, PromptLookupDrafter(), PROMPTS, 10, 3, sampling, seed=5)
    assert tokens(stepped) == tokens(whole) and all(len(g.tokens) == 10 for g in stepped)
    assert steps == max(g.trace.n_target_forwards for g in stepped), "each step is one forward of the batch"
