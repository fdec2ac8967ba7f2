"""labkit's native model computes what transformers computes, on the same checkpoint."""
import pytest
import torch
from conftest import save_tiny_checkpoint

from labkit import (
    DraftModelDrafter,
    autoregressive_generate,
    load_model,
    speculative_generate,
)
from labkit.models.transformer import chain_mask


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_checkpoint(path, request.param)
    return path, hf


def test_native_logits_match_transformers(checkpoint):
    path, hf = checkpoint
    lm = load_model(str(path), dtype="fp32")
    assert lm.backend == "native"
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        ours = lm.model(ids, lm.model.new_cache(batch_size=2))
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_cached_steps_match_one_full_forward(checkpoint):
    """Prefill, then a 4-token chain, then single tokens: the same logits as one forward over all."""
    path, _ = checkpoint
    model = load_model(str(path), dtype="fp32").model
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids, model.new_cache())
        cache = model.new_cache()
        parts = [model(ids[:, :6], cache), model(ids[:, 6:10], cache), model(ids[:, 10:11], cache),
                 model(ids[:, 11:], cache)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-4)
    assert cache.length == 12


def test_explicit_mask_and_positions_equal_the_defaults(checkpoint):
    path, _ = checkpoint
    model = load_model(str(path), dtype="fp32").model
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache_a, cache_b = model.new_cache(), model.new_cache()
        model(ids[:, :5], cache_a), model(ids[:, :5], cache_b)
        a = model(ids[:, 5:], cache_a)
        b = model(ids[:, 5:], cache_b, positions=torch.arange(5, 9)[None], mask=chain_mask(5, 4))
    torch.testing.assert_close(a, b)


def test_hf_backend_matches_native_in_the_speculative_loop(checkpoint):
    """The transformers adapter (DynamicCache.crop rollback) decodes the same tokens as the native model."""
    path, _ = checkpoint
    native = load_model(str(path), dtype="fp32")
    hf = load_model(str(path), dtype="fp32", backend="hf")
    assert hf.backend == "hf"
    prompt = torch.tensor([3, 9, 27, 4, 5])
    ref = autoregressive_generate(native.model, prompt, 30)
    assert autoregressive_generate(hf.model, prompt, 30).tokens == ref.tokens
    for target, draft in [(hf.model, native.model), (native.model, hf.model), (hf.model, hf.model)]:
        assert speculative_generate(target, DraftModelDrafter(draft), prompt, 30, gamma=3).tokens == ref.tokens
