"""Tree drafting from Gloeckle heads: greedy tree decoding equals the model's own greedy decoding, the cache of
every head after tree steps equals the cache recomputed, and the shipped model's trees beat its chains."""
import json

import pytest
import torch
from conftest import require_shipped, tiny_mtp
from test_mtp import DATA, PROMPTS, top_k_of_head1

from labkit import SamplingConfig, autoregressive_generate, speculative_generate
from labkit.decoding.tree import TreeDecoder, tree_generate
from labkit.drafters.mtp import self_speculative
from labkit.drafters.mtp_tree import mtp_tree_drafter
from labkit.models.adapters import MTPTreeTarget
from labkit.models.mtp import head_topk_accuracy, mtp_window_targets
from labkit.training.mtp_data import fixed_windows
from labkit.training.train_mtp import WINDOW_EXTRA, load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def made_up_accuracy(n: int, k: int = 3) -> torch.Tensor:
    """(n, k) cumulative top-k accuracies that give a bushy tree (the heads of a random model have none)."""
    first = torch.linspace(0.6, 0.2, n)[:, None]                                   # (n, 1)
    return (first * torch.tensor([1.0, 1.4, 1.6])[:k]).clamp(max=1.0)              # (n, k)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["plain", "one-token", "repetitive"])
def test_random_model_greedy_tree_equals_autoregressive(n, prompt):
    model = tiny_mtp("gloeckle", n).eval().requires_grad_(False)
    ref = autoregressive_generate(model, prompt, max_new_tokens=50)
    for budget in (1, 5, 16):
        out = tree_generate(MTPTreeTarget(model), mtp_tree_drafter(model, made_up_accuracy(n), budget), prompt,
                            max_new_tokens=50, budget=budget)
        assert out.tokens == ref.tokens


def shipped_with_accuracy(name: str = "gloeckle4_w01_600"):
    """A shipped Gloeckle model and its heads' top-k accuracy on 32 held-out windows (what mtp_results measures)."""
    require_shipped(DATA / f"{name}.safetensors", "run `make train-mtp`")
    model, meta = load_checkpoint(DATA / name)
    T = meta["train"]["seq_len"]
    heldout = torch.frombuffer(bytearray((DATA / "heldout.txt").read_bytes()), dtype=torch.uint8)
    return model, head_topk_accuracy(model, fixed_windows(heldout, 32, T + WINDOW_EXTRA), T)


def heldout_prompts(n: int) -> list[torch.Tensor]:
    return [torch.tensor(list(text.encode("latin-1")))
            for text in json.loads((DATA / "results.json").read_text())["prompts"][:n]]


def test_cache_of_every_head_after_tree_steps_equals_cache_recomputed():
    """Trunk and head blocks share one cache; compaction must keep exactly the accepted path in all of them."""
    model, acc = shipped_with_accuracy()
    dec = TreeDecoder(MTPTreeTarget(model), mtp_tree_drafter(model, acc, 16), heldout_prompts(1)[0],
                      max_new_tokens=60, budget=16)
    for _ in range(12):
        dec.step()
    moved = [s.path for s in dec.trace.steps if len(s.path) >= 2 and s.path != list(range(len(s.path)))]
    assert moved, "the test should exercise compaction: an accepted path of 2+ nodes that had to be moved"
    committed = torch.tensor(dec.tokens)
    fresh = model.new_cache()
    model.all_head_hidden(committed[None, :-1], fresh)
    L = dec.cache.length
    assert L == fresh.length == committed.numel() - 1 and dec.cache.k.shape[0] == model.cfg.n_trunk + 4
    torch.testing.assert_close(dec.cache.k[:, :, :, :L], fresh.k[:, :, :, :L], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(dec.cache.v[:, :, :, :L], fresh.v[:, :, :, :L], atol=1e-5, rtol=1e-4)


def test_head_topk_accuracy_counts_hits_per_head():
    model = tiny_mtp("gloeckle", 3, scale=1.0).eval().requires_grad_(False)
    windows = torch.randint(0, 256, (2, 20 + 3), generator=torch.Generator().manual_seed(0))
    acc = head_topk_accuracy(model, windows, 20, k=256)                             # (3, 256)
    logits = model.training_logits(windows, 20)
    for j in range(3):
        top1 = (logits[j].argmax(-1) == mtp_window_targets(windows, 20, j)).float().mean()
        assert float(acc[j, 0]) == pytest.approx(float(top1))
    assert (acc.diff(dim=1) >= 0).all() and torch.equal(acc[:, -1], torch.ones(3))   # top-V always hits


def test_tree_drafting_errors_say_what_to_do():
    with pytest.raises(ValueError, match="one after another"):
        MTPTreeTarget(tiny_mtp("deepseek", 3))
    model = tiny_mtp("gloeckle", 4)
    with pytest.raises(ValueError, match="head_topk_accuracy"):
        mtp_tree_drafter(model, made_up_accuracy(3), 8)


def test_sampled_tree_decoding_emits_only_what_head1_can_sample():
    """Top-20 sampling: the tree holds heads 2..n's top tokens, mostly outside head 1's top 20; such a node has
    p = 0 and must be rejected, so every committed token is in head 1's top 20 where it was emitted. Nodes do get
    accepted (the check covers them, not only head 1's own samples), and the seed fixes the output."""
    model = tiny_mtp("gloeckle", 4, scale=2.0).eval().requires_grad_(False)
    cfg = SamplingConfig(temperature=0.8, top_k=20)
    run = lambda: tree_generate(MTPTreeTarget(model), mtp_tree_drafter(model, made_up_accuracy(4), 8), PROMPTS[0], 40,
                                8, sampling=cfg, seed=0)
    out = run()
    assert len(out.tokens) == 40 and sum(s.n_accepted for s in out.trace.steps) >= 1
    allowed = top_k_of_head1(model, PROMPTS[0], out.tokens, 20)
    assert [t for t, top in zip(out.tokens, allowed) if t not in top] == []
    assert run().tokens == out.tokens


def test_sampled_tree_decoding_with_top_k_1_is_greedy_decoding():
    """Through the sampling path (multi-candidate rejection sampling): a one-token support gives greedy output."""
    model = tiny_mtp("gloeckle", 4).eval().requires_grad_(False)
    out = tree_generate(MTPTreeTarget(model), mtp_tree_drafter(model, made_up_accuracy(4), 8), PROMPTS[0], 40, 8,
                        sampling=SamplingConfig(temperature=0.8, top_k=1), seed=0)
    assert out.tokens == autoregressive_generate(model, PROMPTS[0], max_new_tokens=40).tokens


def test_shipped_model_tree_is_exact_and_accepts_more_than_its_chain():
    """gloeckle4_w01_600 (loss within 1% of next_600): a 16-node tree from its heads' measured accuracy."""
    model, acc = shipped_with_accuracy()
    chain_forwards = tree_forwards = 0
    for prompt in heldout_prompts(3):
        ref = autoregressive_generate(model, prompt, max_new_tokens=96)
        tree = tree_generate(MTPTreeTarget(model), mtp_tree_drafter(model, acc, 16), prompt, 96, budget=16)
        chain = speculative_generate(*self_speculative(model), prompt, max_new_tokens=96, gamma=3)
        assert tree.tokens == ref.tokens == chain.tokens
        chain_forwards += chain.trace.n_target_forwards
        tree_forwards += tree.trace.n_target_forwards
    assert 3 * 96 / tree_forwards > 1.8 and tree_forwards < 0.85 * chain_forwards
