"""Forward paths (labkit/models/backends.py) pinned to the reference model: logits, greedy equality, caches, errors."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import perturbed

from labkit import (
    DraftModelDrafter,
    PromptLookupDrafter,
    autoregressive_generate,
    speculative_generate,
)
from labkit.decoding.tree import tree_generate
from labkit.models.backends import PATHS, ForwardPath, apply_path, check_path
from labkit.models.transformer import ModelArgs, Transformer

# head size 64 and widths in whole vectors: every fused kernel runs (none falls back to its reference)
SHAPE = dict(vocab_size=96, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=320, qkv_bias=True,
             tie_embeddings=True, max_seq_len=256)
PROMPT = torch.tensor([5, 17, 33, 2, 9, 41])


def runnable(path: str, precision: str) -> bool:
    try:
        check_path(path, precision)
        return True
    except ValueError:
        return False


def model(dtype=torch.float32, seed=0) -> Transformer:
    return Transformer(ModelArgs(**SHAPE)).init_random(std=0.1, seed=seed).to(dtype).eval().requires_grad_(False)


def on_path(reference: Transformer, path: str, precision: str) -> Transformer:
    if not runnable(path, precision):
        pytest.skip(f"the {path} path with {precision} weights cannot run here")
    return apply_path(copy.deepcopy(reference), path, precision)


CASES = [(p, prec) for p in PATHS if p != "packed-amx" for prec in ("fp32", "bf16")] + \
    [("packed-amx", "bf16"), ("reference", "int8"), ("reference", "int4"), ("packed", "int8"), ("packed", "int4")]
TOL = {"fp32": 1e-4, "bf16": 0.06, "int8": 0.25, "int4": 0.6}     # max |logit error| / max |logit|


@pytest.mark.parametrize("path,precision", CASES)
def test_logits_match_the_reference(path, precision):
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    ref = model(dtype)
    fast = on_path(ref, path, precision)
    assert fast.path == ForwardPath(path, precision, "cpu")
    tokens = torch.arange(7, 7 + 17 * 5, 5)[None] % 96                              # (1, 17): wide rows too
    want = ref(tokens, ref.new_cache())
    got = fast(tokens, fast.new_cache())
    assert got.shape == want.shape
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < TOL[precision], f"{path}/{precision}: relative logit error {err:.3g}"
    if precision in ("fp32", "bf16"):   # the next token agrees almost everywhere
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


# Exact where the target's kernels are batch invariant or fp32 (stock bf16 GEMMs round a k-row product
# differently from k one-row products, so a near tie can flip): labkit's int4 kernel is, so a 4-bit
# target's speculative decoding reproduces its own plain decoding.
EXACT = [(p, "fp32", "fp32") for p in PATHS if p != "packed-amx"] + \
    [("packed", "bf16", d) for d in ("bf16", "int8", "int4")] + [("packed-amx", "bf16", "int8")] + \
    [("packed", "int4", "int4"), ("packed", "int4", "int8")]


@pytest.mark.parametrize("path,precision,draft_precision", EXACT)
def test_greedy_speculative_equals_autoregressive_on_the_same_path(path, precision, draft_precision):
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    target = on_path(model(dtype), path, precision)
    draft_path = path if draft_precision == precision else "reference"
    draft = on_path(perturbed(model(dtype), scale=0.4), draft_path, draft_precision)
    ref = autoregressive_generate(target, PROMPT, max_new_tokens=30)
    for drafter in (DraftModelDrafter(draft), PromptLookupDrafter()):
        out = speculative_generate(target, drafter, PROMPT, max_new_tokens=30, gamma=4)
        assert out.tokens == ref.tokens, f"{drafter.name} on the {path} path ({precision})"


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int4"])
def test_packed_verify_gives_the_bits_of_single_steps(precision):
    """Batch invariance: one 6-token forward == six 1-token forwards, logits and cache, bit for bit."""
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    fast = on_path(model(dtype), "packed", precision)
    c1 = fast.new_cache()
    together = fast(PROMPT[None], c1)
    c2 = fast.new_cache()
    alone = torch.cat([fast(PROMPT[None, i:i + 1], c2) for i in range(PROMPT.numel())], 1)
    assert torch.equal(together, alone)
    assert torch.equal(c1.k[:, :, :, :6], c2.k[:, :, :, :6]) and torch.equal(c1.v[:, :, :, :6], c2.v[:, :, :, :6])


def test_packed_tree_decoding_and_rollback_match_the_reference():
    """Tree masks and positions on the packed path; the cache after rejected drafts equals a recomputed one."""
    from test_tree import RandomTreeDrafter
    target = on_path(model(), "packed", "fp32")
    ref = autoregressive_generate(target, PROMPT, max_new_tokens=30).tokens
    assert ref == autoregressive_generate(model(), PROMPT, max_new_tokens=30).tokens
    out = tree_generate(target, RandomTreeDrafter(ref, PROMPT.numel(), 9, seed=1, vocab=96), PROMPT, 30, budget=9)
    assert out.tokens == ref and out.trace.tokens_per_forward > 1.3
    from labkit import SpeculativeDecoder
    dec = SpeculativeDecoder(target, DraftModelDrafter(on_path(perturbed(model(), 0.6), "packed", "fp32")), PROMPT, 30,
                             gamma=4)
    for _ in range(6):
        dec.step()
    assert any(not s.bonus for s in dec.trace.steps), "the test needs a rejection"
    fresh = target.new_cache()
    target(torch.tensor(dec.tokens[: dec.cache.length])[None], fresh)
    n = dec.cache.length
    torch.testing.assert_close(dec.cache.k[:, :, :, :n], fresh.k[:, :, :, :n], rtol=0, atol=0)
    torch.testing.assert_close(dec.cache.v[:, :, :, :n], fresh.v[:, :, :, :n], rtol=0, atol=0)


def test_bad_paths_and_precisions_are_refused_with_advice():
    m = model()
    with pytest.raises(ValueError, match="unknown forward path 'fast'.*reference"):
        apply_path(m, "fast", "fp32")
    with pytest.raises(ValueError, match="unknown precision 'int3'"):
        apply_path(m, "reference", "int3")
    with pytest.raises(ValueError, match="loaded in torch.float32.*dtype='bf16'"):
        apply_path(m, "reference", "bf16")
    apply_path(m, "reference", "int8")
    with pytest.raises(ValueError, match="already runs.*load it again"):
        apply_path(m, "reference", "fp32")
    odd = Transformer(ModelArgs(**{**SHAPE, "hidden_dim": 328})).init_random(seed=0).to(torch.bfloat16)
    with pytest.raises(ValueError, match="int4 weights need.*use int8 or bf16"):
        apply_path(odd, "reference", "int4")


def test_load_model_rejects_unknown_backend_device_and_dtype(tmp_path):
    from labkit.models.loading import load_model
    with pytest.raises(ValueError, match="backend must be one of"):
        load_model(str(tmp_path), backend="turbo")
    with pytest.raises(ValueError, match="device must be one of"):
        load_model(str(tmp_path), device="tpu")
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(str(tmp_path), dtype="fp8")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no GPU"):
            load_model(str(tmp_path), device="cuda")
    with pytest.raises(ValueError, match="int8 weights run labkit's model: use backend 'auto' or 'native'"):
        load_model(str(tmp_path), dtype="int8", backend="hf")


def test_load_model_runs_the_path_asked_and_records_it(tmp_path):
    from conftest import save_tiny_checkpoint

    from labkit.models.loading import load_model
    save_tiny_checkpoint(tmp_path, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=256)
    ref = load_model(str(tmp_path), dtype="fp32", backend="reference", progress=False)
    assert ref.path == ForwardPath("reference", "fp32", "cpu") and ref.calibration is None
    for path in ("onednn", "packed"):
        if not runnable(path, "fp32"):
            continue
        fast = load_model(str(tmp_path), dtype="fp32", backend=path, progress=False)
        assert fast.path == ForwardPath(path, "fp32", "cpu")
        prompt = torch.tensor([4, 8, 15, 16, 23, 42])
        assert autoregressive_generate(fast.model, prompt, 20).tokens == autoregressive_generate(ref.model, prompt, 20).tokens
    draft = load_model(str(tmp_path), dtype="int8", backend="reference", progress=False)
    assert draft.path == ForwardPath("reference", "int8", "cpu")


@pytest.mark.parametrize("path,precision", CASES)
def test_parameters_and_weight_bytes_are_counted_on_every_path(path, precision):
    from labkit.models.transformer import count_params, weight_bytes
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    ref = model(dtype)
    fast = on_path(ref, path, precision)
    assert count_params(fast) == count_params(ref)
    per_weight = {"fp32": 4, "bf16": 2, "int8": 1, "int4": 0.5 + 4 / 32}[precision]    # int4: + scale, zero per 32
    linears = sum(m.weight.numel() for m in ref.modules() if isinstance(m, torch.nn.Linear))   # tied head once
    others = sum(p.numel() * p.element_size() for n, p in ref.named_parameters() if p.dim() == 1)
    want = linears * per_weight + others * (1 if precision in ("fp32", "bf16") else 2 / ref.embed_tokens.weight.element_size())
    assert abs(weight_bytes(fast) - want) / want < 0.08     # quantised: plus the scales
