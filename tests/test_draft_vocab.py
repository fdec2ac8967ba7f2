"""A draft model with a vocabulary of its own (drafters/vocab.py): its cut LM head scores its ids as the whole head
does, it never proposes another id, and speculation with it stays exact, greedy and sampled."""
import copy

import numpy as np
import pytest
import torch
from conftest import tiny_model
from test_sampling import CONFIGS, V, chi2_pvalues, exact_marginals, sampled_counts

from labkit import GREEDY, DraftModelDrafter, autoregressive_generate, speculative_generate
from labkit.decoding.loops import why_not_compiled
from labkit.drafters.vocab import CutVocab, VocabHead, frequent_tokens, token_ranks, with_vocab
from labkit.models.backends import apply_path, check_path, rows_of

QWEN_VOCAB = 151936


def on_path(model, path: str, precision: str):
    try:
        check_path(path, precision)
    except ValueError as e:
        pytest.skip(str(e))
    return apply_path(copy.deepcopy(model), path, precision)


@pytest.mark.parametrize("path,precision", [("packed", "fp32"), ("packed", "bf16"), ("packed", "int4"),
                                            ("reference", "int8")])
def test_the_cut_head_scores_its_ids_bit_for_bit_as_the_whole_head(path, precision):
    model = tiny_model(seed=0) if precision != "bf16" else tiny_model(seed=0).to(torch.bfloat16)
    model = on_path(model, path, precision)
    ids = torch.tensor([0, 3, 4, 17, 50, 51, 95])
    head = VocabHead(model, ids)
    with torch.no_grad():
        h = model.hidden(torch.tensor([[5, 9, 2, 7]]), model.new_cache())               # (1, 4, D)
        assert torch.equal(head(h), model.lm_head(h).float()[..., ids])
        spread = head.spread(head(h)[0, -1])
    assert spread.shape == (model.vocab_size,)
    assert torch.isinf(spread).sum() == model.vocab_size - len(ids) and torch.equal(spread[ids], head(h)[0, -1])


def test_the_cut_head_on_the_reference_path_is_the_rows_of_the_whole_one():
    model = tiny_model(seed=0)
    ids = torch.tensor([1, 2, 60])
    h = torch.randn(3, model.args.dim)
    torch.testing.assert_close(rows_of(model.lm_head, ids)(h), model.lm_head(h)[:, ids])


def test_torchs_int4_layout_cannot_be_cut_and_says_what_to_do():
    model = on_path(tiny_model(seed=0), "reference", "int4")
    with pytest.raises(ValueError, match="backend='packed'"):
        VocabHead(model, torch.tensor([1, 2]))


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_with_a_vocabulary_equals_plain_decoding_and_proposes_only_its_ids(tiny_target, tiny_draft, gamma):
    ids = torch.arange(0, 96, 2)                                                   # every even id
    prompt = torch.tensor([3, 14, 15, 9, 2, 6])
    ref = autoregressive_generate(tiny_target, prompt, 40)
    drafter = DraftModelDrafter(CutVocab(tiny_draft, ids))
    proposed = []
    propose = drafter.propose
    drafter.propose = lambda *a, **k: proposed.append(p := propose(*a, **k)) or p
    out = speculative_generate(tiny_target, drafter, prompt, 40, gamma)
    assert out.tokens == ref.tokens
    drafted = torch.cat([p.tokens for p in proposed])
    assert len(drafted) > 0 and torch.isin(drafted, drafter.reading.head.scored).all()
    assert any(t % 2 for t in ref.tokens), "the answer holds ids outside the vocabulary: the target still emits them"


def test_a_vocabulary_always_keeps_the_end_of_sequence_ids(tiny_draft):
    drafter = DraftModelDrafter(CutVocab(tiny_draft, torch.tensor([1, 2, 3]), always=(7,)), eos_token_ids=(7,))
    assert drafter.reading.head.ids.tolist() == [1, 2, 3, 7]


@pytest.mark.parametrize("cfg", CONFIGS[:1], ids=["t1"])
def test_speculative_sampling_with_a_vocabulary_matches_the_target_distribution(cfg):
    target, draft = tiny_model(seed=3, vocab_size=V, std=0.4), tiny_model(seed=4, vocab_size=V, std=0.4)
    drafter = DraftModelDrafter(CutVocab(draft, torch.tensor([0, 2, 3, 5])))
    counts = sampled_counts(target, drafter, cfg, gamma=2)
    assert min(chi2_pvalues(counts, exact_marginals(target, cfg))) > 1e-3
    assert counts.sum() == 3 * 3000 and np.all(counts.sum(1) == 3000)


def test_the_shipped_ranking_puts_common_tokens_first_and_keeps_the_eos_ids():
    ranks = token_ranks(QWEN_VOCAB)
    assert len(ranks) > 65536 and len(ranks.unique()) == len(ranks)
    top = frequent_tokens(32768, QWEN_VOCAB, always=(151645,))
    assert len(top) in (32768, 32769) and 151645 in top.tolist() and torch.equal(top, top.sort().values)
    assert set(ranks[:100].tolist()) >= {13, 11, 220, 198}                    # '.', ',', ' ', '\n' (Qwen2's ids)


@pytest.mark.parametrize("bad,match", [(0, "1 to"), (10**7, "1 to"), (True, "1 to"), (2.5, "1 to"),
                                       (torch.tensor([[1, 2]]), "1-D"), (torch.tensor([1.0]), "1-D"),
                                       (torch.tensor([-1, 2]), "outside"), (torch.tensor([96]), "outside")])
def test_a_bad_vocabulary_is_refused_with_what_to_pass(tiny_draft, bad, match):
    vocab_size = QWEN_VOCAB if isinstance(bad, (int, float)) else tiny_draft.vocab_size
    with pytest.raises(ValueError, match=match):
        if isinstance(bad, (int, float)):
            frequent_tokens(bad, vocab_size)
        else:
            DraftModelDrafter(CutVocab(tiny_draft, bad))


def test_a_vocabulary_size_with_no_ranking_says_how_to_make_one(tiny_draft):
    with pytest.raises(ValueError, match="token_frequency.py"):
        DraftModelDrafter(CutVocab(tiny_draft, 1000))


def test_the_compiled_loop_and_batches_decline_a_vocabulary_and_say_why(tiny_target, tiny_draft):
    drafter = DraftModelDrafter(CutVocab(tiny_draft, torch.arange(10)))
    assert "vocabulary" in why_not_compiled(tiny_target, drafter, 4, GREEDY, False)
    with pytest.raises(ValueError, match="batch the bare draft"):
        drafter.rows([torch.tensor([1, 2, 3])], 64)


def test_a_vocabulary_takes_in_each_prompts_ids_and_drops_the_last_ones(tiny_draft):
    drafter = DraftModelDrafter(CutVocab(tiny_draft, torch.tensor([1, 2, 3])))
    drafter.start(torch.tensor([2, 40, 41, 40]))
    assert drafter.reading.head.scored.tolist() == [1, 2, 3, 40, 41]
    logits = drafter.next_logits(torch.tensor([40]))
    assert torch.isfinite(logits).nonzero().flatten().tolist() == [1, 2, 3, 40, 41]
    drafter.start(torch.tensor([5, 6]))
    assert drafter.reading.head.scored.tolist() == [1, 2, 3, 5, 6]


def test_the_prompts_ids_are_cut_from_the_packed_head_bit_for_bit():
    model = on_path(tiny_model(seed=0), "packed", "int4")
    head = VocabHead(model, torch.tensor([0, 1]))
    head.extend(torch.tensor([77, 33, 77, 90]))
    with torch.no_grad():
        h = model.hidden(torch.tensor([[5, 9]]), model.new_cache())
        assert torch.equal(head(h), model.lm_head(h).float()[..., head.scored])


def test_drafters_of_one_model_and_vocabulary_share_the_cut_rows_and_not_the_prompts(tiny_draft):
    a, b = (DraftModelDrafter(CutVocab(tiny_draft, torch.tensor([1, 2, 3]))) for _ in range(2))
    assert a.reading.head.rows is b.reading.head.rows
    assert DraftModelDrafter(CutVocab(tiny_draft, torch.tensor([1, 2]))).reading.head.rows is not a.reading.head.rows
    a.start(torch.tensor([9, 10]))
    b.start(torch.tensor([11]))
    assert a.reading.head.scored.tolist() == [1, 2, 3, 9, 10] and b.reading.head.scored.tolist() == [1, 2, 3, 11]


def test_auto_is_the_default_size_where_a_ranking_is_shipped_and_every_id_where_none_is(tiny_draft):
    from labkit.drafters.vocab import DEFAULT_VOCAB, auto_vocab
    assert auto_vocab(QWEN_VOCAB) == DEFAULT_VOCAB and auto_vocab(tiny_draft.vocab_size) is None
    assert with_vocab(tiny_draft, "auto") is tiny_draft and with_vocab(tiny_draft, None) is tiny_draft
    with pytest.raises(ValueError, match="leave the draft model unwrapped"):
        CutVocab(tiny_draft, "auto")


def test_the_command_line_takes_auto_all_or_a_count_and_refuses_the_rest():
    import argparse

    from labkit.cli import draft_vocab, resolve_vocab
    assert draft_vocab("auto") == "auto" and draft_vocab("all") is None and draft_vocab("4096") == 4096
    for bad in ("0", "-3", "many"):
        with pytest.raises(argparse.ArgumentTypeError, match="'auto' or 'all'"):
            draft_vocab(bad)
    assert resolve_vocab("auto", "cpu", "compiled") is None and resolve_vocab(4096, "cpu", "eager") == 4096


def test_the_bench_report_says_which_ids_the_draft_scored():
    from labkit.bench.report import _vocab_sentence
    assert "32,768 most frequent token ids and the prompt's own" in _vocab_sentence(
        {"draft_vocab": "auto", "draft_vocab_auto": 32768})
    assert "4,096 most frequent" in _vocab_sentence({"draft_vocab": 4096})
    assert _vocab_sentence({"draft_vocab": "auto", "draft_vocab_auto": None}) == "" == _vocab_sentence({})
