"""Sampling with heads keeps the target's distribution: self-speculative decoding with multi-token heads
(Gloeckle heads, DeepSeek modules), EAGLE tree decoding and the model-free tree drafters (suffix decoding,
lookahead), each checked like the chain in test_sampling.py.

The joint distribution of the first two generated tokens over many seeds is compared by Pearson's chi-square
with the exact one, enumerated from the target's own next-token distribution (head 1 for a multi-token model).
The models have an 8-token vocabulary so that the 64 cells are well filled and drafts are often, but not always,
accepted: both the accept path and the residual path of the rule are exercised. The same test, run on a decoder
whose acceptance rule is broken (monkeypatched in the decoder's module), rejects: it has power.
"""
import sys

import numpy as np
import pytest
import torch
from conftest import tiny_model
from scipy.stats import chisquare

from labkit import SamplingConfig, SpeculativeDecoder, TreeDecoder
from labkit.core.acceptance import Acceptance, speculative_accept
from labkit.core.sampling import probs_from_logits, sample
from labkit.core.tree_acceptance import TreeAcceptance
from labkit.drafters.eagle import EagleDrafter
from labkit.drafters.lookahead import LookaheadDrafter
from labkit.drafters.mtp import self_speculative
from labkit.drafters.suffix import SuffixDrafter
from labkit.models.eagle_heads import Eagle3Head, EagleConfig, EagleHead
from labkit.models.mtp import MTPConfig, MTPModel

V, N_RUNS = 8, 2000
PROMPT = torch.tensor([1, 4, 2, 7, 3])
T1 = SamplingConfig(temperature=1.0)
WARPED = SamplingConfig(temperature=0.8, top_k=5, top_p=0.9)
pytestmark = pytest.mark.usefixtures("one_thread")


def small_mtp(kind: str, n: int = 3, seed: int = 0, scale: float = 2.0) -> MTPModel:
    """conftest's tiny_mtp with an 8-token vocabulary; scale 2 gives spread distributions whose heads half agree."""
    torch.manual_seed(seed)
    model = MTPModel(MTPConfig(kind=kind, n_future=n, vocab_size=V, dim=64, n_heads=4, hidden_dim=96, n_trunk=2,
                               max_seq_len=32))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model.eval().requires_grad_(False)


def eagle_pair(seed: int = 0, kind: str = "eagle"):
    """A tiny target (8 tokens) and a random EAGLE (or EAGLE-3) head on it: its drafts are often accepted."""
    if kind == "eagle3":                                        # three blocks to fuse
        target = tiny_model(seed=3, vocab_size=V, std=0.2, n_layers=3)
        torch.manual_seed(seed)
        cfg = EagleConfig.for_target(target, hidden_dim=96, layers=(0, 1, 2))
        head = Eagle3Head(cfg, V, target.max_seq_len)
        head.init_lm_head(target.lm_head.weight)                # its LM head starts as the target's, as in training
        return target, head.eval().requires_grad_(False)
    target = tiny_model(seed=3, vocab_size=V, std=0.2)
    torch.manual_seed(seed)
    head = EagleHead(EagleConfig.for_target(target, hidden_dim=96), V, target.max_seq_len).eval().requires_grad_(False)
    return target, head


def exact_joint(model, cfg: SamplingConfig, prompt: torch.Tensor = PROMPT) -> np.ndarray:
    """P(first two new tokens = (a, b)) under the model's own sampling, (V, V): p(a | prompt) p(b | prompt, a)."""
    def dist(extra):
        tokens = torch.tensor([prompt.tolist() + extra])
        logits = model(tokens, model.new_cache(), num_logits=1)[0, -1]                  # (V,) head 1's
        return probs_from_logits(logits, cfg).double().numpy()
    first = dist([])
    return np.stack([first[a] * dist([a]) for a in range(V)])


def first_two_counts(make_decoder, prompt: torch.Tensor = PROMPT) -> tuple[np.ndarray, int]:
    """Counts (V, V) of the first two generated tokens over N_RUNS seeds, and how many draft tokens were accepted."""
    counts, accepted = np.zeros((V, V)), 0
    for seed in range(N_RUNS):
        dec = make_decoder(seed)
        while len(dec.tokens) < prompt.numel() + 2:
            accepted += dec.step().n_accepted
        a, b = dec.tokens[prompt.numel():prompt.numel() + 2]
        counts[a, b] += 1
    return counts, accepted


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test over the V*V cells; the rarest cells share one bin until it expects >= 5."""
    p, c = probs.ravel(), counts.ravel()
    assert p.sum() == pytest.approx(1.0) and c.sum() == N_RUNS
    order = np.argsort(p)                                                             # rarest first
    exp, obs = p[order] * N_RUNS, c[order]
    n_rare = max(1, int(np.searchsorted(np.cumsum(exp), 5.0)) + 1)
    exp = np.append(exp[:n_rare].sum(), exp[n_rare:])
    obs = np.append(obs[:n_rare].sum(), obs[n_rare:])
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def mtp_counts(model, cfg):
    return first_two_counts(lambda seed: SpeculativeDecoder(*self_speculative(model), PROMPT, 8, gamma=2,
                                                            sampling=cfg, seed=seed))


def eagle_counts(target, head, cfg):
    return first_two_counts(lambda seed: TreeDecoder(target, EagleDrafter(head, target, top_k=3, depth=3), PROMPT, 8,
                                                     budget=8, sampling=cfg, seed=seed))


# --- the distribution is the target's -------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [T1, WARPED], ids=["t1", "t0.8-topk5-topp0.9"])
@pytest.mark.parametrize("kind", ["gloeckle", "deepseek"])
def test_sampled_self_speculative_matches_the_models_own_sampling(kind, cfg):
    model = small_mtp(kind)
    counts, accepted = mtp_counts(model, cfg)
    assert accepted > N_RUNS // 4, "the heads' drafts should often be accepted, or the test checks only resampling"
    assert chi2_pvalue(counts, exact_joint(model, cfg)) > 1e-3


@pytest.mark.parametrize("cfg", [T1, WARPED], ids=["t1", "t0.8-topk5-topp0.9"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_sampled_eagle_tree_decoding_matches_the_targets_sampling(cfg, kind):
    target, head = eagle_pair(seed=0 if kind == "eagle" else 1, kind=kind)     # heads whose drafts are often kept
    counts, accepted = eagle_counts(target, head, cfg)
    assert accepted > N_RUNS // 4, "the tree's nodes should often be accepted, or the test checks only resampling"
    assert chi2_pvalue(counts, exact_joint(target, cfg)) > 1e-3


# --- and the same test catches a broken acceptance rule ---------------------------------------------------------

def chain_always_accepts(draft_tokens, q_draft, p_target, generator=None) -> Acceptance:
    """Broken: every draft token is kept, as if the draft were the target."""
    K = draft_tokens.shape[0]
    return Acceptance(K, int(sample(p_target[K], generator)), bonus=True)


def chain_resamples_from_p(draft_tokens, q_draft, p_target, generator=None) -> Acceptance:
    """Broken, subtly: after a rejection the token is drawn from p_target instead of the residual max(0, p - q)."""
    acc = speculative_accept(draft_tokens, q_draft, p_target, generator)
    if acc.bonus:
        return acc
    return Acceptance(acc.n_accepted, int(sample(p_target[acc.n_accepted], generator)), bonus=False)


def tree_always_accepts(tree, node_tokens, q_draft, p_target, generator=None) -> TreeAcceptance:
    """Broken: the first child is kept at every level down to a leaf."""
    path, children = [], tree.children(-1)
    while children.numel():
        path.append(int(children[0]))
        children = tree.children(path[-1])
    last = path[-1] + 1 if path else 0
    return TreeAcceptance(path, int(sample(p_target[last], generator)), bonus=bool(path))


def tree_keeps_rejected_mass(tree, node_tokens, q_draft, p_target, generator=None) -> TreeAcceptance:
    """Broken, subtly: a rejected sibling's token keeps its mass (p is not replaced by the residual)."""
    path, node = [], -1
    while True:
        p, children = p_target[node + 1], tree.children(node)
        accepted = next((c for c in children.tolist()
                         if float(torch.rand((), generator=generator)) < float(p[int(node_tokens[c])])), None)
        if accepted is None:
            return TreeAcceptance(path, int(sample(p, generator)), bonus=children.numel() == 0 and node >= 0)
        path.append(accepted)
        node = accepted


@pytest.mark.parametrize("broken", [chain_always_accepts, chain_resamples_from_p], ids=["always-accept", "resample-p"])
def test_broken_chain_rule_fails_the_same_test(broken, monkeypatch):
    """Patched where SpeculativeDecoder looks the rule up; raising=True: a renamed rule fails loudly, not silently."""
    monkeypatch.setattr(sys.modules[SpeculativeDecoder.__module__], "speculative_accept", broken)
    model = small_mtp("gloeckle")
    counts, _ = mtp_counts(model, T1)
    assert chi2_pvalue(counts, exact_joint(model, T1)) < 1e-6


@pytest.mark.parametrize("broken", [tree_always_accepts, tree_keeps_rejected_mass],
                         ids=["always-accept", "keeps-rejected-mass"])
def test_broken_tree_rule_fails_the_same_test(broken, monkeypatch):
    monkeypatch.setattr(sys.modules[TreeDecoder.__module__], "tree_speculative_accept", broken)
    target, head = eagle_pair()
    counts, _ = eagle_counts(target, head, T1)
    assert chi2_pvalue(counts, exact_joint(target, T1)) < 1e-6


# --- model-free tree drafters: deterministic nodes (one-hot drafts), trees from the context --------------------

MODEL_FREE_PROMPT = torch.tensor([1, 4, 6, 1, 4, 0, 1, 4])                # "1 4" was followed by 6 and by 0
MODEL_FREE = {"suffix": (lambda: SuffixDrafter(min_prob=0.0, spec_factor=4.0), 8),
              "lookahead": (lambda: LookaheadDrafter(window=2, ngram=3, max_verify=3, pool_from_prompt=True), 16)}


def model_free_counts(name: str, target, cfg: SamplingConfig):
    make, budget = MODEL_FREE[name]
    return first_two_counts(lambda seed: TreeDecoder(target, make(), MODEL_FREE_PROMPT, 8, budget=budget, sampling=cfg,
                                                     seed=seed), MODEL_FREE_PROMPT)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", list(MODEL_FREE))
@pytest.mark.parametrize("cfg", [T1, WARPED], ids=["t1", "t0.8-topk5-topp0.9"])
def test_sampled_model_free_tree_drafting_matches_the_targets_sampling(name, cfg):
    target = tiny_model(seed=3, vocab_size=8, std=0.2)
    counts, accepted = model_free_counts(name, target, cfg)
    assert accepted > 300, "the tree's nodes should often be accepted, or the test checks only resampling"
    assert chi2_pvalue(counts, exact_joint(target, cfg, MODEL_FREE_PROMPT)) > 1e-3


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", list(MODEL_FREE))
def test_a_broken_tree_rule_fails_the_model_free_test(name, monkeypatch):
    monkeypatch.setattr(sys.modules[TreeDecoder.__module__], "tree_speculative_accept", tree_keeps_rejected_mass)
    target = tiny_model(seed=3, vocab_size=8, std=0.2)
    counts, _ = model_free_counts(name, target, T1)
    assert chi2_pvalue(counts, exact_joint(target, T1, MODEL_FREE_PROMPT)) < 1e-6
