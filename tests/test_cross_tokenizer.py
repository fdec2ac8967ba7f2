"""A draft with another tokenizer: drafts pass as text, ids never cross, and decoding stays exact."""
import copy

import pytest
import torch
from conftest import perturbed, tiny_model, tiny_tokenizer

from labkit import SpeculativeDecoder, autoregressive_generate, speculative_generate
from labkit.drafters.cross_tokenizer import (
    CrossTokenizerDrafter,
    TokenIntersectionDrafter,
    common_prefix,
    shared_vocabulary,
)

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
@pytest.mark.parametrize("make", [CrossTokenizerDrafter, TokenIntersectionDrafter], ids=["text", "intersection"])
def test_a_draft_that_cuts_text_differently_keeps_greedy_exact(pair, text, make):
    target, target_tok = pair
    draft_tok = merging(target_tok)
    draft = tiny_model(seed=5, vocab_size=len(draft_tok))
    prompt = encode(target_tok, text)
    out = speculative_generate(target, make(draft, draft_tok, target_tok), prompt, 24, gamma=4)
    assert out.tokens == autoregressive_generate(target, prompt, 24).tokens
    assert any(s.proposed for s in out.trace.steps)                       # the draft's text did become proposals
    if make is TokenIntersectionDrafter:                                  # one target token per draft token, always
        assert all(s.proposed for s in out.trace.steps[:-1])


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


def cross_counts(target, cfg, kind: str = "text"):
    """Counts of the first two tokens over many seeds, drafting through text (another model under shuffled ids,
    which the target often agrees with) or with the shared tokens only (the target, perturbed, plus two tokens
    the target's vocabulary lacks)."""
    from test_sampling_heads import first_two_counts
    target_tok = letters()
    with torch.no_grad():
        if kind == "text":
            draft_tok, new_id = permuted(target_tok, seed=1)
            draft = perturbed(target, scale=0.5)
            draft.embed_tokens.weight[torch.tensor([new_id[t] for t in range(8)])] = draft.embed_tokens.weight.clone()
        else:
            draft_tok, draft, source = letters_with_merges(), tiny_model(seed=3, vocab_size=10, std=0.2), perturbed(
                target, scale=0.5)
            for name, tensor in source.state_dict().items():
                mine = draft.state_dict()[name]
                mine[: tensor.shape[0]].copy_(tensor) if mine.shape != tensor.shape else mine.copy_(tensor)
    make = CrossTokenizerDrafter if kind == "text" else TokenIntersectionDrafter
    return first_two_counts(lambda seed: SpeculativeDecoder(target, make(draft, draft_tok, target_tok),
                                                            torch.tensor([1, 4, 2, 7, 3]), 8, gamma=2, sampling=cfg,
                                                            seed=seed))


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("kind", ["text", "intersection"])
@pytest.mark.parametrize("cfg", ["t1", "warped"])
def test_sampled_cross_tokenizer_decoding_matches_the_targets_sampling(cfg, kind):
    from test_sampling_heads import T1, WARPED, chi2_pvalue, exact_joint
    cfg = {"t1": T1, "warped": WARPED}[cfg]
    target = tiny_model(seed=3, vocab_size=8, std=0.2)
    counts, accepted = cross_counts(target, cfg, kind)
    assert accepted > 500, "the draft's text should often be accepted, or the test checks only resampling"
    assert chi2_pvalue(counts, exact_joint(target, cfg)) > 1e-3


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("kind", ["text", "intersection"])
def test_a_broken_chain_rule_fails_the_cross_tokenizer_test(monkeypatch, kind):
    import sys

    from test_sampling_heads import T1, chain_always_accepts, chi2_pvalue, exact_joint
    monkeypatch.setattr(sys.modules[SpeculativeDecoder.__module__], "speculative_accept", chain_always_accepts)
    target = tiny_model(seed=3, vocab_size=8, std=0.2)
    counts, _ = cross_counts(target, T1, kind)
    assert chi2_pvalue(counts, exact_joint(target, T1)) < 1e-6


# --- the token-level intersection (Timor et al.): draft only the tokens both vocabularies hold -------------

def letters_with_merges():
    """The eight letters of `letters()` (same ids) plus "ab" and "cd", which the target's vocabulary lacks."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {**{c: i for i, c in enumerate("abcdefgh")}, "ab": 8, "cd": 9}
    tok = Tokenizer(models.BPE(vocab, [("a", "b"), ("c", "d")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_shared_vocabulary_pairs_ids_by_string(pair):
    _, target_tok = pair
    draft_tok, new_id = permuted(target_tok)
    draft_ids, target_ids = shared_vocabulary(draft_tok, target_tok)
    assert len(draft_ids) == len(target_tok)
    assert all(new_id[int(t)] == int(d) for d, t in zip(draft_ids, target_ids))
    d, t = shared_vocabulary(letters_with_merges(), letters())
    assert d.tolist() == t.tolist() == list(range(8))                       # "ab" and "cd" are not shared


def test_intersection_drafts_only_shared_tokens_with_a_true_q(pair):
    target = tiny_model(seed=3, vocab_size=8, std=0.2)
    draft_tok = letters_with_merges()
    draft = tiny_model(seed=6, vocab_size=10, std=0.5)
    with torch.no_grad():
        best = draft(torch.tensor([[1, 4, 2, 7, 3]]), draft.new_cache(max_len=16))[0, -1].argmax()
        draft.lm_head.weight[8:] = 3 * draft.lm_head.weight[best]            # "ab", "cd": much of the draft's mass
    drafter = TokenIntersectionDrafter(draft, draft_tok, letters())
    drafter.check_target(target)
    prompt = torch.tensor([1, 4, 2, 7, 3])
    drafter.start(prompt)
    from labkit.core.sampling import SamplingConfig
    proposal = drafter.propose(prompt, 4, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    assert proposal.k == 4 and proposal.q_draft.shape == (4, 8)
    assert torch.allclose(proposal.q_draft.sum(-1), torch.ones(4))          # renormalised over the shared tokens
    assert (proposal.q_token > 0).all()
    raw = draft(torch.tensor([[1, 4, 2, 7, 3]]), draft.new_cache(max_len=16))[0, -1].softmax(-1)
    assert raw[8:].sum() > 0.3                                              # the mass the intersection leaves out


def test_tokenizers_that_cannot_spell_the_text_or_share_nothing_are_refused(pair):
    target, target_tok = pair
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate("~@$%&|^`")}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    symbols = PreTrainedTokenizerFast(tokenizer_object=tok)                 # no letters, no byte fallback
    with pytest.raises(ValueError, match="share no token string"):
        TokenIntersectionDrafter(tiny_model(vocab_size=8), symbols, target_tok)
    with pytest.raises(ValueError, match="draft tokenizer cannot spell this prompt.*no byte fallback"):
        speculative_generate(target, CrossTokenizerDrafter(tiny_model(vocab_size=8), symbols, target_tok),
                             encode(target_tok, "def add"), 4)
