"""A draft with another tokenizer: drafts pass as text, ids never cross, and decoding stays exact."""
import copy

import pytest
import torch
from conftest import perturbed, tiny_model, tiny_tokenizer

from labkit import SpeculativeDecoder, autoregressive_generate, speculative_generate
from labkit.drafters.cross_tokenizer import CrossTokenizerDrafter, common_prefix

PROMPTS = ["def add(a, b):", "The cat sat on the mat. The cat", "x = [1, 2, 3]"]


def permuted(tokenizer, seed: int = 0):
    """The same strings under shuffled ids (and the permutation: new id of each old id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = tokenizer.get_vocab()
    order = torch.randperm(len(vocab), generator=torch.Generator().manual_seed(seed))
    new_id = {old: int(order[old]) for old in range(len(vocab))}
    tok = Tokenizer(models.BPE({s: new_id[i] for s, i in vocab.items()}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    bos, eos = tokenizer.bos_token, tokenizer.eos_token
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos), new_id


def merging(tokenizer):
    """A byte-level BPE over the same characters with merges learned from a little code and prose: the same
    text cut into other, longer tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    alphabet = [s for s in tokenizer.get_vocab() if s not in ("<s>", "</s>")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["def add(a, b):\n    return a + b\n", "The cat sat on the mat. The dog sat on the log.",
            "for i in range(10):\n    print(i)\n"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=len(alphabet) + 60, initial_alphabet=alphabet,
                                                      special_tokens=["<s>", "</s>"], show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def pair():
    target_tok = tiny_tokenizer()
    target = tiny_model(seed=4, vocab_size=len(target_tok))
    return target, target_tok


def encode(tok, text):
    return torch.tensor(tok(text, add_special_tokens=False)["input_ids"])


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0 and common_prefix([7], [7]) == 1


def test_the_same_model_under_shuffled_ids_drafts_perfectly_through_text(pair):
    """Ids mean nothing across tokenizers: a draft whose ids are shuffled, fed and read through text, is the
    target itself, so every draft token is accepted; read as target ids, its first guess would be wrong."""
    target, target_tok = pair
    draft_tok, new_id = permuted(target_tok)
    draft = copy.deepcopy(target)
    with torch.no_grad():                                        # row new_id[t] of the draft = row t of the target
        order = torch.tensor([new_id[t] for t in range(len(new_id))])
        draft.embed_tokens.weight[order] = target.embed_tokens.weight.clone()
    prompt = encode(target_tok, PROMPTS[0])
    drafter = CrossTokenizerDrafter(draft, draft_tok, target_tok)
    out = speculative_generate(target, drafter, prompt, 24, gamma=4)
    assert out.tokens == autoregressive_generate(target, prompt, 24).tokens
    assert out.trace.acceptance_rate == 1.0 and out.trace.n_target_forwards <= 5
    draft_first = int(draft(encode(draft_tok, PROMPTS[0])[None], draft.new_cache(max_len=64))[0, -1].argmax())
    assert draft_first != out.tokens[0] and new_id[out.tokens[0]] == draft_first   # naive id mapping: wrong token


@pytest.mark.parametrize("text", PROMPTS)
def test_a_draft_that_cuts_text_differently_keeps_greedy_exact(pair, text):
    target, target_tok = pair
    draft_tok = merging(target_tok)
    draft = tiny_model(seed=5, vocab_size=len(draft_tok))
    prompt = encode(target_tok, text)
    out = speculative_generate(target, CrossTokenizerDrafter(draft, draft_tok, target_tok), prompt, 24, gamma=4)
    assert out.tokens == autoregressive_generate(target, prompt, 24).tokens
    assert any(s.proposed for s in out.trace.steps)                       # the draft's text did become proposals


def test_proposals_are_the_drafts_text_in_target_tokens(pair):
    target, target_tok = pair
    draft_tok = merging(target_tok)
    draft = tiny_model(seed=5, vocab_size=len(draft_tok))
    drafter = CrossTokenizerDrafter(draft, draft_tok, target_tok, draft_factor=1.0)
    prompt = encode(target_tok, PROMPTS[1])
    assert len(encode(draft_tok, PROMPTS[1])) < len(prompt)                   # the draft's tokens are longer
    drafter.start(prompt)
    from labkit.core.sampling import SamplingConfig
    proposal = drafter.propose(prompt, 6, SamplingConfig())
    assert 0 < proposal.k <= 6
    text = target_tok.decode(prompt.tolist() + proposal.tokens.tolist())
    assert text.startswith(PROMPTS[1]) and len(text) > len(PROMPTS[1])
    assert drafter.cached_ids[: len(encode(draft_tok, PROMPTS[1]))] == encode(draft_tok, PROMPTS[1]).tolist()


def test_cross_tokenizer_drafter_refuses_a_mismatched_tokenizer(pair):
    target, target_tok = pair
    draft_tok = merging(target_tok)
    small = tiny_model(seed=5, vocab_size=len(draft_tok) - 10)
    with pytest.raises(ValueError, match="draft model's own tokenizer"):
        speculative_generate(target, CrossTokenizerDrafter(small, draft_tok, target_tok), encode(target_tok, "ab"), 4)
    with pytest.raises(ValueError, match="target's own tokenizer"):
        speculative_generate(tiny_model(vocab_size=20), CrossTokenizerDrafter(small, draft_tok, target_tok),
                             torch.tensor([1, 2]), 4)
    with pytest.raises(ValueError, match="window"):
        CrossTokenizerDrafter(small, draft_tok, target_tok, window=0)


def letters():
    """Eight one-letter tokens, ids 0-7 (the chi-square helpers' vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate("abcdefgh")}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def cross_counts(target, cfg):
    from test_sampling_heads import first_two_counts
    target_tok = letters()
    draft_tok, new_id = permuted(target_tok, seed=1)
    draft = perturbed(target, scale=0.5)                  # another model, which the target often agrees with ...
    with torch.no_grad():                                 # ... under shuffled ids
        draft.embed_tokens.weight[torch.tensor([new_id[t] for t in range(8)])] = draft.embed_tokens.weight.clone()
    return first_two_counts(lambda seed: SpeculativeDecoder(target, CrossTokenizerDrafter(draft, draft_tok, target_tok),
                                                            torch.tensor([1, 4, 2, 7, 3]), 8, gamma=2, sampling=cfg,
                                                            seed=seed))


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("cfg", ["t1", "warped"])
def test_sampled_cross_tokenizer_decoding_matches_the_targets_sampling(cfg):
    from test_sampling_heads import T1, WARPED, chi2_pvalue, exact_joint
    cfg = {"t1": T1, "warped": WARPED}[cfg]
    target = tiny_model(seed=3, vocab_size=8, std=0.2)
    counts, accepted = cross_counts(target, cfg)
    assert accepted > 500, "the draft's text should often be accepted, or the test checks only resampling"
    assert chi2_pvalue(counts, exact_joint(target, cfg)) > 1e-3


@pytest.mark.usefixtures("one_thread")
def test_a_broken_chain_rule_fails_the_cross_tokenizer_test(monkeypatch):
    import sys

    from test_sampling_heads import T1, chain_always_accepts, chi2_pvalue, exact_joint
    monkeypatch.setattr(sys.modules[SpeculativeDecoder.__module__], "speculative_accept", chain_always_accepts)
    target = tiny_model(seed=3, vocab_size=8, std=0.2)
    counts, _ = cross_counts(target, T1)
    assert chi2_pvalue(counts, exact_joint(target, T1)) < 1e-6
