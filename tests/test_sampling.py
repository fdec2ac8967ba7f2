"""Speculative sampling preserves the target distribution (chi-square per position), and the
same test catches a deliberately broken acceptance rule."""
import itertools

import numpy as np
import pytest
import torch
from conftest import tiny_model
from scipy.stats import chisquare

import labkit.decoding.speculative as spec
from labkit import (
    DraftModelDrafter,
    PromptLookupDrafter,
    SamplingConfig,
    speculative_generate,
)
from labkit.core.acceptance import Acceptance, speculative_accept
from labkit.core.sampling import argmax, probs_from_logits, sample

V, N_POS, N_RUNS = 8, 3, 3000
PROMPT = torch.tensor([1, 4, 2])


def exact_marginals(model, cfg: SamplingConfig) -> np.ndarray:
    """P(token at position t) under the target, by enumerating every prefix: (N_POS, V)."""
    def dist(prefix):
        logits = model(torch.tensor([PROMPT.tolist() + list(prefix)]), model.new_cache(), num_logits=1)[0, -1]
        return probs_from_logits(logits, cfg).double().numpy()
    out = np.zeros((N_POS, V))
    for t in range(N_POS):
        for prefix in itertools.product(range(V), repeat=t):
            weight = np.prod([dist(prefix[:i])[prefix[i]] for i in range(t)]) if t else 1.0
            out[t] += weight * dist(prefix)
    return out


def sampled_counts(target, drafter, cfg: SamplingConfig, gamma: int) -> np.ndarray:
    counts = np.zeros((N_POS, V))
    for seed in range(N_RUNS):
        out = speculative_generate(target, drafter, PROMPT, N_POS, gamma=gamma, sampling=cfg, seed=seed)
        counts[np.arange(N_POS), out.tokens] += 1
    return counts


def chi2_pvalues(counts: np.ndarray, probs: np.ndarray) -> list[float]:
    """Pearson's test per position; tokens expected fewer than 5 times share one bin (>= 5 expected)."""
    pvals = []
    for c, p in zip(counts, probs):
        order = np.argsort(p)                                    # rarest first
        exp, obs = p[order] * N_RUNS, c[order]
        n_rare = max(1, int(np.searchsorted(np.cumsum(exp), 5.0)) + 1)  # smallest prefix with >= 5 expected
        exp = np.append(exp[:n_rare].sum(), exp[n_rare:])
        obs = np.append(obs[:n_rare].sum(), obs[n_rare:])
        pvals.append(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)
    return pvals


@pytest.fixture(scope="module")
def pair():
    return tiny_model(seed=3, vocab_size=V, std=0.4), tiny_model(seed=4, vocab_size=V, std=0.4)


CONFIGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["t1", "t0.7-topk5-topp0.9"])
def test_speculative_sampling_matches_target_distribution(pair, cfg):
    target, draft = pair
    expected = exact_marginals(target, cfg)
    counts = sampled_counts(target, DraftModelDrafter(draft), cfg, gamma=2)
    assert min(chi2_pvalues(counts, expected)) > 1e-3


def test_speculative_sampling_on_a_4bit_target_matches_its_own_distribution(pair):
    """A quantized target is a model of its own: sampling from it speculatively gives its distribution."""
    import copy

    from labkit.models.backends import apply_path, check_path
    try:
        check_path("packed", "int4")
    except ValueError as e:
        pytest.skip(str(e))
    target, draft = (apply_path(copy.deepcopy(m), "packed", "int4") for m in pair)
    cfg = CONFIGS[0]
    counts = sampled_counts(target, DraftModelDrafter(draft), cfg, gamma=2)
    assert min(chi2_pvalues(counts, exact_marginals(target, cfg))) > 1e-3


def test_deterministic_drafter_sampling_matches_target(pair):
    target, _ = pair
    cfg = CONFIGS[0]
    counts = sampled_counts(target, PromptLookupDrafter(max_ngram=1), cfg, gamma=3)
    assert min(chi2_pvalues(counts, exact_marginals(target, cfg))) > 1e-3


def broken_accept(draft_tokens, q_draft, p_target, generator=None) -> Acceptance:
    """A classic bug: on rejection resample from p_target instead of the residual max(0, p - q)."""
    acc = speculative_accept(draft_tokens, q_draft, p_target, generator)
    if acc.bonus:
        return acc
    return Acceptance(acc.n_accepted, int(sample(p_target[acc.n_accepted], generator)), bonus=False)


def test_broken_rule_fails_the_same_test(pair, monkeypatch):
    target, draft = pair
    cfg = CONFIGS[0]
    monkeypatch.setattr(spec, "speculative_accept", broken_accept)
    counts = sampled_counts(target, DraftModelDrafter(draft), cfg, gamma=2)
    assert min(chi2_pvalues(counts, exact_marginals(target, cfg))) < 1e-6


def test_accept_rule_single_step_is_exact():
    """The rule alone, with fixed p and q: the first output token is distributed as p_target[0]."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.1, 0.2, 0.6]])
    counts = np.zeros(4)
    for _ in range(20000):
        x = torch.multinomial(q[0], 1, generator=g)
        acc = speculative_accept(x, q, p, g)
        counts[acc.tokens(x)[0]] += 1
    assert counts[3] == 0                                          # p_target(3) = 0 is never emitted
    assert chisquare(counts[:3], p[0, :3].numpy() * 20000).pvalue > 1e-3


def test_token_probs_normalise_only_the_rows_asked_for_and_match_the_full_softmax():
    from labkit.core.sampling import token_probs
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 50, generator=g) * 3
    rows, tokens = torch.tensor([0, 0, 3, 8, 3]), torch.tensor([1, 7, 7, 49, 0])
    want = logits.softmax(-1)[rows, tokens]
    assert torch.allclose(torch.tensor(token_probs(logits, rows, tokens)), want, rtol=1e-6, atol=0)
    assert token_probs(logits, rows[:0], tokens[:0]) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_argmax_is_torchs_first_index_of_the_largest_value(dtype):
    """The loops' argmax (numpy on a CPU): torch's on random rows, on ties (the first index), on a NaN (it wins,
    as in torch), on a single row and on a batch of rows, in every float dtype a model's logits come in."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(5, 1000, generator=g).to(dtype)
    tied = torch.zeros(3, 7, dtype=dtype)
    tied[:, 2] = tied[:, 5] = 1.0
    nan = torch.randn(2, 9, generator=g).to(dtype)
    nan[1, 4] = float("nan")
    for logits in (rows, rows[2], tied, nan, rows[:, ::3]):
        got = argmax(logits)
        assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(-1))
    assert argmax(tied).tolist() == [2, 2, 2] and int(argmax(nan[1])) == 4
