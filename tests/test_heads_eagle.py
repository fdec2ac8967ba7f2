"""EAGLE: the head's cache, the dynamic tree, exact greedy decoding with it, and training that learns."""
import pytest
import torch
from conftest import tiny_model

from labkit import autoregressive_generate
from labkit.core.sampling import SamplingConfig
from labkit.decoding.tree import tree_generate
from labkit.drafters.eagle import EagleDrafter, _best_subtree
from labkit.models.eagle_heads import EagleConfig, EagleHead, load_eagle, save_eagle
from labkit.training.eagle_loss import eagle_loss, vocab_index


def tiny_head(target, seed=0):
    torch.manual_seed(seed)
    return EagleHead(EagleConfig.for_target(target, hidden_dim=96), target.vocab_size, target.max_seq_len).eval()


def test_head_cache_incremental_equals_full(tiny_target):
    head = tiny_head(tiny_target)
    f = torch.randn(1, 9, tiny_target.args.dim)
    e = torch.randn(1, 9, tiny_target.args.dim)
    with torch.no_grad():
        full = head(f, e, head.new_cache(32))
        cache = head.new_cache(32)
        parts = [head(f[:, :4], e[:, :4], cache), head(f[:, 4:5], e[:, 4:5], cache), head(f[:, 5:], e[:, 5:], cache)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-4)


def test_the_head_is_the_reference_layer_a_biased_fc_no_input_norm_and_no_final_norm(tiny_target, tmp_path):
    """EAGLE-1 as SafeAILab's cnets1.py builds it: g = fc(concat(e, f)) with a bias, u = g + Attn(g) (no input
    norm), out = u + MLP(post_attention_layernorm(u)) (no final norm); a head of labkit's earlier form (an input
    norm and a final norm) is refused with the command that retrains it."""
    head = tiny_head(tiny_target)
    assert head.fc.bias is not None and not hasattr(head.block, "input_layernorm") and not hasattr(head, "norm")
    f, e = torch.randn(1, 5, tiny_target.args.dim), torch.randn(1, 5, tiny_target.args.dim)
    with torch.no_grad():
        out = head(f, e, head.new_cache(16))
        g = head.fc(torch.cat([e, f], -1))
        plain = head.new_cache(16)
        from labkit.models.layers import rope_cos_sin
        from labkit.models.transformer import chain_mask
        cos, sin = rope_cos_sin(torch.arange(5)[None], head.args.head_dim, head.args.rope_theta, g.dtype)
        u = g + head.block.self_attn(g, cos, sin, plain, 0, chain_mask(0, 5))
        manual = u + head.block.mlp(head.block.post_attention_layernorm(u))
    torch.testing.assert_close(out, manual, atol=1e-5, rtol=1e-4)
    save_eagle(head, torch.arange(10), tmp_path, {})
    from safetensors.torch import load_file, save_file
    state = load_file(tmp_path / "model.safetensors")
    state["norm.weight"] = torch.ones(tiny_target.args.dim, dtype=torch.bfloat16)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="earlier layer.*train_eagle"):
        load_eagle(tmp_path, tiny_target)


def test_best_subtree_keeps_parents_and_the_best_scores():
    parents = torch.tensor([-1, -1, 0, 0, 1, 2, 2])
    scores = torch.tensor([-0.1, -0.5, -0.3, -2.0, -0.6, -0.35, -3.0])
    depth = torch.tensor([1, 1, 2, 2, 2, 3, 3])
    keep = _best_subtree(parents, depth, scores, 4)
    assert keep.tolist() == [0, 2, 5, 1]                   # best first: -0.1, -0.3, -0.35, -0.5
    for i in keep.tolist():
        assert parents[i] < 0 or int(parents[i]) in keep.tolist()


@pytest.mark.parametrize("top_k,depth,budget", [(1, 4, 4), (3, 3, 10), (4, 5, 24)])
def test_greedy_eagle_decoding_equals_autoregressive(tiny_target, top_k, depth, budget):
    """An untrained head drafts noise; verification keeps the output exactly the target's."""
    prompt = torch.tensor([5, 17, 33, 2, 9, 11])
    ref = autoregressive_generate(tiny_target, prompt, 30)
    drafter = EagleDrafter(tiny_head(tiny_target), tiny_target, top_k=top_k, depth=depth)
    out = tree_generate(tiny_target, drafter, prompt, 30, budget=budget)
    assert out.tokens == ref.tokens
    step = out.trace.steps[1]
    assert len(step.proposed) <= budget and max(torch.tensor(step.parents).tolist()) < len(step.proposed)


def test_a_windowed_head_reads_the_sinks_and_the_last_pairs_of_a_long_prompt(tiny_target):
    """window=W: the first proposal reads pairs 0..sinks-1 and the last W, each at its own position (what a head
    fed exactly those pairs computes); a short catch-up after it reads every pair; the output stays the target's."""
    torch.manual_seed(1)
    tokens = torch.randint(0, tiny_target.vocab_size, (41,))
    with torch.no_grad():
        feats = tiny_target.hidden(tokens[None, :40], tiny_target.new_cache())[0]              # (40, D)
    head = tiny_head(tiny_target)
    drafter = EagleDrafter(head, tiny_target, top_k=2, depth=3, window=8, sinks=2)
    drafter.start(tokens[:40], feats)
    proposal = drafter.propose(tokens, 6, SamplingConfig())
    assert proposal.tokens.numel() == 6
    assert drafter.cache.length == 2 + 8 + 2 * 2                        # the pairs read + two fed levels of top_k
    read = torch.cat([torch.arange(2), torch.arange(32, 40)])                                  # (10,) pair indices
    with torch.no_grad():
        ref = head(feats[read][None], tiny_target.embed_tokens(tokens[read + 1])[None], head.new_cache(64),
                   read[None])[0, -1]
    torch.testing.assert_close(drafter.f_next, ref)
    drafter.commit(41, feats[-1:])                                          # one more pair: read, not skipped
    drafter.propose(torch.cat([tokens, tokens[:1]]), 1, SamplingConfig())
    assert (drafter.skipped, drafter.cache.length) == (30, 11)
    prompt = tokens[:30]
    whole = EagleDrafter(tiny_head(tiny_target), tiny_target, top_k=3, depth=3)
    windowed = EagleDrafter(tiny_head(tiny_target), tiny_target, top_k=3, depth=3, window=6)
    ref_tokens = autoregressive_generate(tiny_target, prompt, 24).tokens
    for drafter in (whole, windowed):
        assert tree_generate(tiny_target, drafter, prompt, 24, budget=8).tokens == ref_tokens
    assert windowed.skipped == 30 - 1 - 4 - 6 and whole.skipped == 0
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        EagleDrafter(head, tiny_target, window=0)


def test_sampled_eagle_decoding_runs_and_stops(tiny_target):
    drafter = EagleDrafter(tiny_head(tiny_target), tiny_target, top_k=3, depth=3)
    out = tree_generate(tiny_target, drafter, torch.tensor([3, 4, 5]), 20, budget=8,
                        sampling=SamplingConfig(temperature=0.8), seed=0)
    assert out.trace.n_generated == 20


def test_training_learns_and_checkpoint_round_trips(tiny_target, tmp_path):
    """A few hundred steps on the tiny target's own features: the head's top-1 beats chance by far."""
    torch.manual_seed(0)
    tokens = torch.randint(0, tiny_target.vocab_size, (16, 24))
    with torch.no_grad():
        hidden = tiny_target.hidden(tokens, tiny_target.new_cache(batch_size=16, max_len=24))   # (16, 24, D)
        target_next = tiny_target.lm_head(hidden).argmax(-1)                                   # (16, 24)
    vocab = target_next.unique()
    vocab_map = vocab_index(vocab, tiny_target.vocab_size)
    head = tiny_head(tiny_target).float().train()
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    lm_rows = tiny_target.lm_head.weight[vocab]
    first = None
    for step in range(150):
        loss, reg, cls, correct, count = eagle_loss(head, tiny_target.embed_tokens, lm_rows, vocab_map,
                                                    tokens, hidden, target_next)
        first = first or (float(loss), correct / count)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss) < 0.5 * first[0]
    assert correct / count > max(0.8, first[1] + 0.3)
    save_eagle(head, vocab, tmp_path / "eagle", {"base_model": "tiny"})
    loaded, loaded_vocab, config = load_eagle(tmp_path / "eagle", tiny_target)
    assert torch.equal(loaded_vocab, vocab) and config["kind"] == "eagle"
    # the trained head drafts what the target says: long accepted paths
    prompt = tokens[0, :8]
    out = tree_generate(tiny_target, EagleDrafter(loaded, tiny_target, vocab, top_k=2, depth=4), prompt, 24, budget=8)
    assert out.tokens == autoregressive_generate(tiny_target, prompt, 24).tokens


def test_load_eagle_refuses_a_head_for_another_width(tiny_target, tmp_path):
    head = tiny_head(tiny_target)
    save_eagle(head, torch.arange(10), tmp_path, {})
    other = tiny_model(dim=32, n_heads=2, n_kv_heads=1)
    with pytest.raises(ValueError, match="train a head for this target"):
        load_eagle(tmp_path, other)
    with pytest.raises(FileNotFoundError, match="train_eagle"):
        load_eagle(tmp_path / "nothing", tiny_target)
