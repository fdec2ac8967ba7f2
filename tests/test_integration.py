"""The real embedded pair (Qwen2.5-Coder 1.5B target, 0.5B draft), in fp32: exactness where it matters.

fp32, because near-ties can flip between a 1-token and a k-token forward in bf16; the speed
runs (python -m labkit bench) use bf16. Run with LABKIT_INTEGRATION=1 (`make test` does).
"""
import gc

import pytest
import torch

from labkit import (
    DraftModelDrafter,
    HeuristicGamma,
    PromptLookupDrafter,
    autoregressive_generate,
    load_model,
    speculative_generate,
)
from labkit.drafters import CutVocab
from labkit.models.hub import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_model
from labkit.models.loading import encode_prompt
from labkit.tuning import CostAwareGamma

pytestmark = pytest.mark.integration
PROMPT = "Write a Python function that checks whether a string is a palindrome."
N = 24


@pytest.fixture(scope="module")
def pair():
    torch.set_num_threads(2)
    target, draft = load_model(DEFAULT_TARGET, "fp32"), load_model(DEFAULT_DRAFT, "fp32")
    ids = encode_prompt(target.tokenizer, PROMPT, chat_template=True)
    ref = autoregressive_generate(target.model, ids, N, eos_token_ids=target.eos_token_ids)
    yield target, draft, ids, ref
    del target, draft
    gc.collect()


def test_native_target_matches_transformers():
    from transformers import AutoModelForCausalLM
    native = load_model(DEFAULT_TARGET, "fp32")
    ids = encode_prompt(native.tokenizer, PROMPT, chat_template=True)[None]
    with torch.no_grad():
        ours = native.model(ids, native.model.new_cache())[0]
        del native
        gc.collect()
        hf = AutoModelForCausalLM.from_pretrained(resolve_model(DEFAULT_TARGET), dtype=torch.float32)
        ref = hf(ids).logits[0]
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    torch.testing.assert_close(ours, ref, rtol=1e-3, atol=2e-3)


@pytest.mark.parametrize("gamma", [2, 5])
def test_draft_model_greedy_equals_autoregressive(pair, gamma):
    target, draft, ids, ref = pair
    out = speculative_generate(target.model, DraftModelDrafter(draft.model), ids, N, gamma,
                               eos_token_ids=target.eos_token_ids)
    assert out.tokens == ref.tokens
    assert out.trace.tokens_per_forward > 1.5, "the 0.5B draft should agree with the 1.5B target often"


@pytest.mark.parametrize("policy", [HeuristicGamma, CostAwareGamma])
def test_adaptive_greedy_equals_autoregressive(pair, policy):
    target, draft, ids, ref = pair
    out = speculative_generate(target.model, DraftModelDrafter(draft.model), ids, N, policy(4),
                               eos_token_ids=target.eos_token_ids)
    assert out.tokens == ref.tokens


@pytest.mark.parametrize("vocab", [4096, "auto"])
def test_a_draft_scoring_only_frequent_ids_equals_autoregressive(pair, vocab):
    target, draft, ids, ref = pair
    drafter = DraftModelDrafter(CutVocab(draft.model, vocab))
    assert len(drafter.reading.head.ids) <= (4096 if vocab == 4096 else 32768)
    out = speculative_generate(target.model, drafter, ids, N, 4, eos_token_ids=target.eos_token_ids)
    assert out.tokens == ref.tokens
    assert out.trace.tokens_per_forward > 1.5, "the cut draft should still agree with the target often"


def test_a_draft_copying_in_the_chat_opening_equals_autoregressive(pair):
    from labkit.drafters.opening import OpeningCopied, chat_opening
    target, draft, ids, ref = pair
    opening = chat_opening(target.tokenizer)
    assert len(opening) == 24 and torch.equal(ids[:24], opening)                  # Qwen2.5's system turn and more
    drafter = DraftModelDrafter(OpeningCopied(draft.model, opening))
    out = speculative_generate(target.model, drafter, ids, N, 4, eos_token_ids=target.eos_token_ids)
    assert out.tokens == ref.tokens
    assert out.trace.tokens_per_forward > 1.5, "the draft with the copied opening should agree as often as before"


def test_prompt_lookup_greedy_equals_autoregressive(pair):
    target, _, ids, ref = pair
    out = speculative_generate(target.model, PromptLookupDrafter(), ids, N, 4, eos_token_ids=target.eos_token_ids)
    assert out.tokens == ref.tokens


def test_fallback_smollm2_runs_natively_and_matches_transformers():
    """The documented fallback (a Llama-architecture 135M model) on the native path, and prompt lookup on it."""
    from transformers import AutoModelForCausalLM
    small = load_model("smollm2-135m-instruct", "fp32")
    assert small.backend == "native"
    ids = encode_prompt(small.tokenizer, "List three colours, then list them again in reverse order.", True)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m-instruct"), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(small.model(ids[None], small.model.new_cache())[0], hf(ids[None]).logits[0],
                                   rtol=1e-3, atol=2e-3)
    ref = autoregressive_generate(small.model, ids, 40, eos_token_ids=small.eos_token_ids)
    out = speculative_generate(small.model, PromptLookupDrafter(), ids, 40, 4, eos_token_ids=small.eos_token_ids)
    assert out.tokens == ref.tokens
