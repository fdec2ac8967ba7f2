"""The packed path's blocks in one C++ call (labkit/models/fused.py) against the same modules run one by one."""
from __future__ import annotations

import copy

import pytest
import torch
from test_backends import PROMPT, SHAPE, on_path

from labkit import DraftModelDrafter, autoregressive_generate, speculative_generate
from labkit.decoding.tree import tree_generate
from labkit.models.fused import fusable, fused_blocks, use_fused
from labkit.models.transformer import ModelArgs, Transformer

PRECISIONS = ("fp32", "bf16", "int4")


def packed(precision: str, seed: int = 0) -> Transformer:
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    ref = Transformer(ModelArgs(**SHAPE)).init_random(std=0.1, seed=seed).to(dtype).eval().requires_grad_(False)
    return on_path(ref, "packed", precision)


def forwards(model: Transformer, fused: bool) -> list[torch.Tensor]:
    """Logits of a prefill, a 1-token step, a 4-token chain and a 5-node tree, and the cache they leave."""
    assert use_fused(model, fused) == fused
    cache = model.new_cache()
    out = [model(PROMPT[None], cache), model(torch.tensor([[11]]), cache), model(torch.tensor([[3, 4, 5, 6]]), cache)]
    n = cache.length                                          # a tree: root, two children, two grandchildren
    parents = [-1, 0, 0, 1, 2]
    mask = torch.ones(5, n + 5, dtype=torch.bool)
    mask[:, n:] = False
    for i, p in enumerate(parents):
        j = i
        while j >= 0:
            mask[i, n + j], j = True, parents[j]
    positions = torch.tensor([[n, n + 1, n + 1, n + 2, n + 2]])
    out.append(model(torch.tensor([[7, 8, 9, 10, 12]]), cache, positions=positions, mask=mask))
    batch = model.new_cache(batch_size=2)
    out.append(model(torch.stack([PROMPT, PROMPT.flip(0)]), batch))          # two sequences at once
    return out + [cache.k[:, :, :, :cache.length], cache.v[:, :, :, :cache.length], batch.k[:, :, :, :batch.length]]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fused_blocks_give_the_bits_of_the_modules_one_by_one(precision):
    model = packed(precision)
    assert fusable(model) is None
    want, got = forwards(model, fused=False), forwards(model, fused=True)
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_speculative_decoding_on_fused_blocks_equals_plain_decoding(precision):
    target, draft = packed(precision), packed(precision, seed=1)
    assert fused_blocks(target) is not None and fused_blocks(draft) is not None
    plain = autoregressive_generate(target, PROMPT, max_new_tokens=24)
    use_fused(target, False)
    assert autoregressive_generate(target, PROMPT, max_new_tokens=24).tokens == plain.tokens
    use_fused(target, True)
    from test_tree import RandomTreeDrafter
    chain = speculative_generate(target, DraftModelDrafter(draft), PROMPT, 24, gamma=4)
    tree = tree_generate(target, RandomTreeDrafter(plain.tokens, PROMPT.numel(), 9, seed=1, vocab=96), PROMPT, 24,
                         budget=9)
    assert chain.tokens == plain.tokens and tree.tokens == plain.tokens
    assert tree.trace.tokens_per_forward > 1.3                           # trees were accepted, and rolled back


@pytest.mark.parametrize("precision", PRECISIONS)
def test_eagle3_layer_taps_run_fused_with_the_bits_of_the_modules(precision, monkeypatch):
    """EAGLE-3's taps (some blocks' outputs and the final hidden state) come out of the one C++ call with the bits
    of the blocks run one by one: a prefill, a plain step and a tree verify, and the cache they leave."""
    from labkit.models.adapters import layer_taps
    from labkit.models.fused import FusedBlocks
    model = packed(precision)
    calls = []
    with_taps = FusedBlocks.with_taps
    monkeypatch.setattr(FusedBlocks, "with_taps", lambda self, *a: calls.append(a[-1]) or with_taps(self, *a))

    def run(fused: bool, layers: tuple[int, ...]) -> list[torch.Tensor]:
        use_fused(model, fused)
        cache = model.new_cache()
        out = [layer_taps(model, PROMPT[None], cache, layers), layer_taps(model, torch.tensor([[11]]), cache, layers)]
        n = cache.length                                                          # root and two children
        mask = torch.ones(3, n + 3, dtype=torch.bool)
        mask[1, n + 2] = mask[2, n + 1] = False
        out.append(layer_taps(model, torch.tensor([[7, 8, 9]]), cache, layers, torch.tensor([[n, n + 1, n + 1]]),
                              mask))
        return out + [cache.k[:, :, :, :cache.length], cache.v[:, :, :, :cache.length]]

    for layers in ((0,), (0, 1), ()):
        want, got = run(False, layers), run(True, layers)
        assert got[0].shape == (1, len(PROMPT), (len(layers) + 1) * SHAPE["dim"])
        for w, g in zip(want, got):
            assert torch.equal(g, w), layers
    assert calls == [(0,)] * 3 + [(0, 1)] * 3 + [()] * 3             # the fused runs took the one call each time
    from labkit.models.layers import rope_cos_sin
    x, a = model.embed_tokens(PROMPT[None]), model.args
    cos, sin = rope_cos_sin(torch.arange(len(PROMPT))[None], a.head_dim, a.rope_theta, x.dtype)
    with pytest.raises(RuntimeError, match="distinct layers in ascending order"):
        fused_blocks(model).with_taps(x, cos, sin, model.new_cache(), None, (1, 0))


def test_a_hook_on_a_layer_runs_the_modules_and_sees_them():
    model = packed("int4")
    fused_run = model(PROMPT[None], model.new_cache())                # builds the fused blocks before any hook
    x, cache = model.embed_tokens(PROMPT[None]), model.new_cache()
    assert fused_blocks(model).applies(x, cache)
    seen = []
    hook = model.layers[1].mlp.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    pre = model.layers[0].self_attn.qkv_proj.register_forward_pre_hook(lambda mod, args: seen.append("qkv"))
    try:
        assert not fused_blocks(model).applies(x, cache)                # hooks added after the blocks were gathered
        with_hook = model(PROMPT[None], model.new_cache())
    finally:
        hook.remove()
        pre.remove()
    assert seen == ["qkv", (1, len(PROMPT), SHAPE["dim"])]
    assert fused_blocks(model).applies(x, cache)                        # the hooks gone, the blocks run fused again
    assert torch.equal(with_hook, fused_run)
    assert torch.equal(with_hook, model(PROMPT[None], model.new_cache()))


def test_what_cannot_run_fused_says_why_and_runs_the_modules():
    ref = Transformer(ModelArgs(**SHAPE)).init_random(std=0.1).eval().requires_grad_(False)
    assert fusable(ref) == "not on the packed path" and not use_fused(ref)
    int8 = on_path(copy.deepcopy(ref).to(torch.bfloat16), "packed", "int8")
    assert fusable(int8) == "linear layers of kind Int8Linear" and fused_blocks(int8) is None
    odd = on_path(Transformer(ModelArgs(**{**SHAPE, "n_heads": 8, "n_kv_heads": 2})).init_random(std=0.1)
                  .eval().requires_grad_(False), "packed", "fp32")                  # head size 32
    assert "sizes the fused kernels do not take (head 32" in fusable(odd)
    assert odd(PROMPT[None], odd.new_cache()).shape == (1, len(PROMPT), SHAPE["vocab_size"])


def test_the_packed_amx_path_runs_fused_below_the_rows_it_sends_to_onednn():
    """packed-amx is the packed path with a second, oneDNN copy of each weight for products of WIDE_ROWS rows or
    more: the narrower forwards (steps, verifies) run fused, with the packed path's bits; wider ones run the
    modules. (Built without the AMX check: the narrow forwards never touch oneDNN.)"""
    from labkit.models.backends import WIDE_ROWS, ForwardPath, swap_modules
    ref = Transformer(ModelArgs(**SHAPE)).init_random(std=0.1).to(torch.bfloat16).eval().requires_grad_(False)
    amx = copy.deepcopy(ref)
    amx.forward_path = swap_modules(amx, ForwardPath("packed-amx", "bf16", "cpu"))
    fused = fused_blocks(amx)
    assert fusable(amx) is None and fused is not None and fused.max_rows == WIDE_ROWS - 1
    plain = on_path(ref, "packed", "bf16")
    assert use_fused(plain, False) is False
    cache_amx, cache_plain = amx.new_cache(), plain.new_cache()
    for tokens in (PROMPT[None], torch.tensor([[11]]), torch.tensor([[3, 4, 5, 6]])):
        assert fused.applies(amx.embed_tokens(tokens), cache_amx)
        assert torch.equal(amx(tokens, cache_amx), plain(tokens, cache_plain))
    assert not fused.applies(amx.embed_tokens(torch.zeros(1, WIDE_ROWS, dtype=torch.long)), cache_amx)
    assert not fused.applies(amx.embed_tokens(torch.zeros(2, WIDE_ROWS // 2, dtype=torch.long)), cache_amx)
