"""The shipped Medusa and EAGLE heads, the model-free suffix and lookahead drafters, and the drafts with another
tokenizer, on the real target: exact greedy output, and real acceleration.

fp32 target, so that token-for-token equality with plain greedy decoding is a fair demand (in
bf16 a 33-token tree forward and a 1-token forward can round a near-tie differently).
"""
import gc

import pytest
import torch

from labkit import autoregressive_generate, load_model
from labkit.bench.methods import METHODS, Models
from labkit.core.sampling import SamplingConfig
from labkit.decoding.tree import tree_generate
from labkit.drafters.eagle import EagleDrafter
from labkit.drafters.medusa import MedusaDrafter
from labkit.models.eagle_heads import load_eagle, load_eagle3
from labkit.models.hub import DEFAULT_TARGET
from labkit.models.loading import encode_prompt
from labkit.models.medusa_heads import REPO_HEADS, load_medusa

pytestmark = pytest.mark.integration
PROMPT = "Write a Python function that merges two sorted lists into one sorted list."
N = 32


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(2)
    target = load_model(DEFAULT_TARGET, "fp32", progress=False)
    ids = encode_prompt(target.tokenizer, PROMPT, chat_template=True)
    plain = autoregressive_generate(target.model, ids, N, eos_token_ids=target.eos_token_ids)
    yield target, ids, plain
    del target
    gc.collect()


def drafters(model):
    heads, cfg = load_medusa(REPO_HEADS / "medusa-qwen2.5-coder-1.5b", model)
    eagle, vocab, _ = load_eagle(REPO_HEADS / "eagle-qwen2.5-coder-1.5b", model)
    eagle3, vocab3, _ = load_eagle3(REPO_HEADS / "eagle3-qwen2.5-coder-1.5b", model)
    return {"medusa": (MedusaDrafter(heads, cfg["choices"]), 32),
            "eagle-chain": (EagleDrafter(eagle, model, vocab, top_k=1, depth=6), 6),
            "eagle-tree": (EagleDrafter(eagle, model, vocab, top_k=8, depth=6), 32),
            "eagle3-chain": (EagleDrafter(eagle3, model, vocab3, top_k=1, depth=6), 6),
            "eagle3-tree": (EagleDrafter(eagle3, model, vocab3, top_k=8, depth=6), 32)}


# floors well under what the heads reach on held-out code (docs/trees.md: chains replayed at 1.4-1.8)
@pytest.mark.parametrize("name,floor", [("medusa", 1.3), ("eagle-chain", 1.05), ("eagle-tree", 1.05),
                                        ("eagle3-chain", 1.1), ("eagle3-tree", 1.2)])
def test_shipped_heads_are_exact_and_accelerate(setup, name, floor):
    target, ids, plain = setup
    drafter, budget = drafters(target.model)[name]
    out = tree_generate(target.model, drafter, ids, N, budget=budget, eos_token_ids=target.eos_token_ids)
    assert out.tokens == plain.tokens
    # trained heads accept real tokens: above the 1 token a forward of plain decoding
    assert out.trace.tokens_per_forward > floor, out.trace.summary()


@pytest.mark.parametrize("name", ["medusa", "eagle-tree", "eagle3-tree"])   # chains: the same builders, top_k=1
def test_bench_head_methods_are_exact_on_the_real_target(setup, name):
    """`labkit bench --methods medusa,eagle-*` builds its drafters itself: same output, and it counts the forwards."""
    target, ids, plain = setup
    n = 12                                                           # a greedy prefix of `plain`: enough to check the wiring
    result = METHODS[name].build(Models(target), n, 4, 10)(ids)
    assert result.tokens == plain.tokens[:n]
    assert 0 < result.target_forwards < len(result.tokens)          # some forward committed more than one token


def test_an_eagle3_head_reading_a_window_of_a_long_prompt_is_exact_on_the_real_target(setup):
    """The bench's heads read 4 + HEAD_WINDOW pairs of a long prompt: the output stays plain decoding's."""
    from labkit.bench.questions import read_questions
    from labkit.drafters.eagle import HEAD_WINDOW
    from labkit.files.shipped import shipped
    target, _, _ = setup
    question = read_questions(shipped("questions", "long_prompts.jsonl"), categories=["rag"])[0]
    ids = encode_prompt(target.tokenizer, question.prompt, chat_template=True)              # 479 tokens
    plain = autoregressive_generate(target.model, ids, 16, eos_token_ids=target.eos_token_ids)
    eagle3, vocab3, _ = load_eagle3(REPO_HEADS / "eagle3-qwen2.5-coder-1.5b", target.model)
    drafter = EagleDrafter(eagle3, target.model, vocab3, top_k=8, depth=6, window=HEAD_WINDOW)
    out = tree_generate(target.model, drafter, ids, 16, budget=16, eos_token_ids=target.eos_token_ids)
    assert out.tokens == plain.tokens
    assert drafter.skipped == ids.numel() - 1 - 4 - HEAD_WINDOW                  # the prompt's middle, never read


@pytest.mark.parametrize("window", [None, "long prompt"])
def test_eagle3_trees_drafted_on_the_device_are_the_reference_trees_on_the_real_target(setup, window):
    """DeviceEagleDrafter (fixed shapes, nothing read back before the verify) grows the shipped EAGLE-3 head's trees
    as EagleDrafter does, step for step, in the compiled tree loop (static cache, uncompiled on a CPU); exact. With
    a long prompt, both read the same window of it."""
    from labkit.bench.questions import read_questions
    from labkit.decoding.compiled_tree import CompiledTreeDecoder
    from labkit.drafters.eagle import HEAD_WINDOW
    from labkit.drafters.eagle_device import DeviceEagleDrafter
    from labkit.files.shipped import shipped
    target, ids, plain = setup
    n = N
    if window:
        question = read_questions(shipped("questions", "long_prompts.jsonl"), categories=["rag"])[0]
        ids, n = encode_prompt(target.tokenizer, question.prompt, chat_template=True), 12
        plain = autoregressive_generate(target.model, ids, n, eos_token_ids=target.eos_token_ids)
    model, w = target.model, HEAD_WINDOW if window else None
    eagle3, vocab3, _ = load_eagle3(REPO_HEADS / "eagle3-qwen2.5-coder-1.5b", model)
    runs = [CompiledTreeDecoder(model, cls(eagle3, model, vocab3, top_k=8, depth=6, window=w), max_len=ids.numel() + n
                                + 64).generate(ids, n, budget=32, eos_token_ids=target.eos_token_ids)
            for cls in (EagleDrafter, DeviceEagleDrafter)]
    assert runs[0].tokens == runs[1].tokens == plain.tokens
    assert [(s.proposed, s.parents, s.path) for s in runs[0].trace.steps] == \
        [(s.proposed, s.parents, s.path) for s in runs[1].trace.steps]
    assert runs[1].trace.tokens_per_forward > 1.2


def test_sampling_over_an_eagle_tree_runs_on_the_real_target(setup):
    target, ids, _ = setup
    drafter, budget = drafters(target.model)["eagle-tree"]
    out = tree_generate(target.model, drafter, ids, 16, budget=budget, sampling=SamplingConfig(temperature=0.7),
                        seed=0, eos_token_ids=target.eos_token_ids)
    assert out.trace.n_generated == 16 or out.tokens[-1] in target.eos_token_ids
    assert out.trace.tokens_per_forward > 1.0          # some drafted token was accepted (fixed seed)
    again = tree_generate(target.model, drafter, ids, 16, budget=budget, sampling=SamplingConfig(temperature=0.7),
                          seed=0, eos_token_ids=target.eos_token_ids)
    assert again.tokens == out.tokens                  # the seed fixes every draw: drafts, acceptance, residuals


EDIT_PROMPT = ("Rename the variable `x` to `total` in this function and return the whole function:\n"
               "```python\ndef add_all(values):\n    x = 0\n    for v in values:\n        x += v\n    return x\n```")


def test_suffix_decoding_is_exact_and_copies_on_the_real_target(setup):
    """An edit repeats the prompt's code: the suffix trie drafts it from the prompt, exactly."""
    from labkit.drafters.suffix import SuffixDrafter
    target = setup[0]
    ids = encode_prompt(target.tokenizer, EDIT_PROMPT, chat_template=True)
    plain = autoregressive_generate(target.model, ids, N, eos_token_ids=target.eos_token_ids)
    out = tree_generate(target.model, SuffixDrafter(), ids, N, budget=24, eos_token_ids=target.eos_token_ids)
    assert out.tokens == plain.tokens
    assert out.trace.tokens_per_forward > 1.5, out.trace.summary()
    result = METHODS["suffix"].build(Models(target), N, 4, 10)(ids)
    assert result.tokens == plain.tokens and result.target_forwards == out.trace.n_target_forwards


def test_a_draft_with_another_tokenizer_is_exact_on_the_real_target(setup):
    """SmolLM2-135M (49,152 tokens of its own) drafts for the Qwen2.5 target (151,936) through text."""
    from labkit.decoding.speculative import speculative_generate
    from labkit.drafters.cross_tokenizer import CrossTokenizerDrafter
    target, ids, plain = setup
    draft = load_model("smollm2-135m-instruct", "fp32", progress=False)
    assert draft.model.vocab_size != target.model.vocab_size
    drafter = CrossTokenizerDrafter(draft.model, draft.tokenizer, target.tokenizer)
    out = speculative_generate(target.model, drafter, ids, N, gamma=4, eos_token_ids=target.eos_token_ids)
    assert out.tokens == plain.tokens
    assert out.trace.tokens_per_forward > 1.2, out.trace.summary()      # its code drafts are often right
    # the token-level intersection: only the token strings both vocabularies hold, one target token per draft token
    from labkit.drafters.cross_tokenizer import TokenIntersectionDrafter
    shared = TokenIntersectionDrafter(draft.model, draft.tokenizer, target.tokenizer)
    assert 10_000 < len(shared.draft_ids) < len(draft.tokenizer)
    out = speculative_generate(target.model, shared, ids, N, gamma=4, eos_token_ids=target.eos_token_ids)
    assert out.tokens == plain.tokens
    assert out.trace.tokens_per_forward > 1.2, out.trace.summary()


def test_lookahead_decoding_is_exact_on_the_real_target(setup):
    """Jacobi guesses and the n-gram pool they fill: exact, and some of the pool's n-grams are accepted."""
    from labkit.decoding.jacobi import jacobi_decode
    from labkit.drafters.lookahead import LookaheadDrafter
    target, ids, plain = setup
    drafter = LookaheadDrafter(window=5, ngram=4, max_verify=4)
    out = tree_generate(target.model, drafter, ids, N, budget=32, eos_token_ids=target.eos_token_ids)
    assert out.tokens == plain.tokens
    assert sum(s.n_accepted for s in out.trace.steps) > 0, out.trace.summary()   # 1.07 tokens a forward here
    assert len(drafter.pool) > 50
    block = jacobi_decode(target.model, ids, 6)
    assert block.tokens == plain.tokens[:6]                         # Jacobi's fixed point: the greedy tokens
