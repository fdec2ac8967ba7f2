"""EAGLE-3: the target's tapped blocks, training-time test that unrolls what drafting does, exact decoding."""
import pytest
import torch
from conftest import tiny_model

from labkit import autoregressive_generate
from labkit.decoding.tree import tree_generate
from labkit.drafters.base import tree_target
from labkit.drafters.eagle import EagleDrafter
from labkit.models.adapters import LayerTapsTarget, check_layers, default_layers, layer_taps
from labkit.models.eagle_heads import Eagle3Head, EagleConfig, load_eagle, load_eagle3, save_eagle
from labkit.models.target import as_tree_target
from labkit.training.eagle_loss import eagle3_loss, unrolled_logits, vocab_index
from labkit.training.features import FeatureSet, extract_features

LAYERS = (0, 2, 3)


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, n_layers=5)


def head_for(target, seed=0, draft_vocab=None):
    torch.manual_seed(seed)
    cfg = EagleConfig.for_target(target, hidden_dim=96, layers=LAYERS,
                                 draft_vocab_size=0 if draft_vocab is None else draft_vocab.numel())
    head = Eagle3Head(cfg, target.vocab_size, target.max_seq_len).eval()
    head.init_lm_head(target.lm_head.weight.detach()[draft_vocab if draft_vocab is not None else slice(None)])
    return head


def test_layer_taps_are_the_blocks_outputs_and_the_final_feature(target):
    tokens = torch.tensor([[5, 17, 33, 2, 9, 11, 40]])
    out = layer_taps(target, tokens, target.new_cache(), LAYERS)                       # (1, T, 4D)
    D = target.args.dim
    assert out.shape == (1, 7, 4 * D)
    torch.testing.assert_close(out[..., 3 * D:], target.hidden(tokens, target.new_cache()))
    # block 3's output, through the two remaining blocks and the final norm, is the final feature
    full = layer_taps(target, tokens, target.new_cache(), (0, 3, 4))
    torch.testing.assert_close(target.norm(full[..., 2 * D:3 * D]), full[..., 3 * D:])
    # as the tree loop's target: features of a tree step, logits from the final part
    tree_target = LayerTapsTarget(target, LAYERS)
    cache = tree_target.new_cache()
    feats = tree_target.features(tokens, cache)
    torch.testing.assert_close(tree_target.logits(feats), target(tokens, target.new_cache())[0])


def test_training_time_test_sees_what_a_drafted_chain_sees(target):
    """Step k of the unrolled training at root t equals drafting k deep from committed position t, fed the
    true tokens: same inputs, positions and attention, so what the head learns is what it is asked."""
    head = head_for(target)
    tokens = torch.tensor([[5, 17, 33, 2, 9, 11, 40, 7, 21, 3]])                       # (1, T)
    D, T = target.args.dim, tokens.shape[1]
    taps = layer_taps(target, tokens, target.new_cache(), LAYERS)[..., :3 * D]         # (1, T, 3D)
    embed, rows = target.embed_tokens, target.lm_head.weight
    with torch.no_grad():
        unrolled = unrolled_logits(head, embed, rows, tokens, taps, steps=3)           # 3 x (1, T-1, V)
        for t in (0, 3, 6):
            cache = head.new_cache(T + 4)
            a = head(head.context(taps[:, :t + 1]), embed(tokens[:, 1:t + 2]), cache)[:, -1:]   # committed pairs
            for k in range(3):
                if k:                                                                  # one level deeper
                    a = head(a, embed(tokens[:, t + 1 + k:t + 2 + k]), cache, torch.tensor([[t + k]]))
                torch.testing.assert_close(head.readout_input(a[0, -1]) @ rows.T, unrolled[k][0, t],
                                           atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("top_k,depth,budget", [(1, 4, 4), (3, 4, 12)])
def test_greedy_eagle3_decoding_equals_autoregressive(target, top_k, depth, budget):
    prompt = torch.tensor([5, 17, 33, 2, 9, 11])
    drafter = EagleDrafter(head_for(target), target, top_k=top_k, depth=depth)
    assert drafter.name == ("eagle3-chain" if top_k == 1 else "eagle3-tree")
    assert isinstance(tree_target(drafter, as_tree_target(target)), LayerTapsTarget)
    out = tree_generate(target, drafter, prompt, 30, budget=budget)
    assert out.tokens == autoregressive_generate(target, prompt, 30).tokens


def test_unrolled_training_learns_every_step_and_round_trips(target, tmp_path):
    """Self-distilled tiny data: the target's own greedy continuations; a few hundred steps with 3 unrolled
    steps raise every step's top-1 well above its start; the saved head loads and decodes exactly."""
    torch.manual_seed(0)
    prompts = torch.randint(0, target.vocab_size, (12, 4))
    tokens = torch.tensor([p.tolist() + autoregressive_generate(target, p, 20).tokens for p in prompts])   # (12, 24)
    extract_features(target, list(tokens), tmp_path / "features", shard_size=8, layers=LAYERS, progress=False)
    fs = FeatureSet(tmp_path / "features")
    tokens, _, target_next = fs.split("train")
    taps = fs.taps_of("train").float()
    vocab = target_next.unique()
    vocab_map = vocab_index(vocab, target.vocab_size)
    head = head_for(target, draft_vocab=vocab).float().train()
    torch.testing.assert_close(head.lm_head.weight, target.lm_head.weight[vocab])     # starts as the target's rows
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    rows = head.lm_head.weight                                                         # (Vd, D), its own, trained
    first = None
    for _ in range(120):
        r = eagle3_loss(head, target.embed_tokens, rows, vocab_map, tokens, taps, target_next, steps=3)
        first = first or r
        opt.zero_grad()
        r.loss.backward()
        opt.step()
    acc = [c / n for c, n in zip(r.correct, r.count)]
    acc0 = [c / n for c, n in zip(first.correct, first.count)]
    assert float(r.loss) < 0.5 * float(first.loss)
    assert all(a > max(0.7, a0 + 0.3) for a, a0 in zip(acc, acc0)), (acc0, acc)
    save_eagle(head, vocab, tmp_path / "eagle3", {"base_model": "tiny", "ttt_steps": 3})
    loaded, loaded_vocab, config = load_eagle3(tmp_path / "eagle3", target)
    assert isinstance(loaded, Eagle3Head) and config["kind"] == "eagle3" and config["layers"] == list(LAYERS)
    with pytest.raises(ValueError, match="load_eagle3"):
        load_eagle(tmp_path / "eagle3", target)
    prompt = tokens[0, :8]
    out = tree_generate(target, EagleDrafter(loaded, target, loaded_vocab, top_k=2, depth=4), prompt, 16, budget=8)
    assert out.tokens == autoregressive_generate(target, prompt, 16).tokens
    assert out.trace.tokens_per_forward > 2.0            # on its training text it drafts what the target says


def test_bad_layers_and_features_without_taps_are_refused(target, tmp_path):
    assert default_layers(28) == (1, 13, 24)
    with pytest.raises(ValueError, match="three distinct blocks"):
        check_layers((1, 1, 2), 5)
    with pytest.raises(ValueError, match="three distinct blocks"):
        LayerTapsTarget(target, (0, 2, 9))
    with pytest.raises(ValueError, match="three target blocks"):
        Eagle3Head(EagleConfig.for_target(target, hidden_dim=32), target.vocab_size)
    with pytest.raises(ValueError, match=">= 5 layers"):
        default_layers(4)
    extract_features(target, [torch.arange(8)] * 2, tmp_path, progress=False)
    with pytest.raises(ValueError, match="--layers"):
        FeatureSet(tmp_path).taps_of("train")
