"""A draft model that reads the chat template's opening once (drafters/opening.py): the cache it copies in holds
what reading the prompt puts there, the draft reads only the rest, and speculation with it stays exact."""
import pytest
import torch

from labkit import GREEDY, DraftModelDrafter, autoregressive_generate, speculative_generate
from labkit.decoding.loops import why_not_compiled
from labkit.drafters import Windowed, draft_reading
from labkit.drafters import opening as opening_module
from labkit.drafters.opening import Opening, OpeningCopied, chat_opening

OPENING = torch.tensor([3, 14, 15, 9, 2])


class Counting:
    """The tiny draft, counting the tokens each of its forwards reads."""

    def __init__(self, model):
        self.model, self.read = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, tokens, cache, **kw):
        self.read.append(tokens.shape[1])
        return self.model(tokens, cache, **kw)


def test_the_copied_opening_holds_what_reading_the_prompt_puts_there(tiny_draft):
    prompt = torch.cat([OPENING, torch.tensor([40, 41, 7, 8])])
    whole, opened = DraftModelDrafter(tiny_draft), DraftModelDrafter(OpeningCopied(tiny_draft, OPENING))
    whole.start(prompt)
    opened.start(prompt)
    n = whole.cache.length
    assert opened.cache.length == n == len(prompt) - 1
    torch.testing.assert_close(opened.cache.k[:, :, :, :n], whole.cache.k[:, :, :, :n])
    torch.testing.assert_close(opened.cache.v[:, :, :, :n], whole.cache.v[:, :, :, :n])
    torch.testing.assert_close(opened.next_logits(prompt[-1:]), whole.next_logits(prompt[-1:]))


def test_the_draft_reads_only_what_follows_the_opening_and_the_opening_once(tiny_draft):
    counting = Counting(tiny_draft)
    opening_module._READ.pop(counting, None)
    for tail in ([40, 41, 7], [50, 51, 52, 53, 9], [60]):
        drafter = DraftModelDrafter(OpeningCopied(counting, OPENING))     # one drafter per request, as the bench
        drafter.start(torch.cat([OPENING, torch.tensor(tail)]))
    assert counting.read == [len(OPENING), 2, 4]         # the opening once; each prompt's rest but its last token
    counting.read.clear()
    DraftModelDrafter(OpeningCopied(counting, OPENING)).start(torch.tensor([3, 14, 16, 9, 2, 40, 41]))
    assert counting.read == [6], "a prompt that does not start with the opening is read whole"
    counting.read.clear()
    DraftModelDrafter(OpeningCopied(counting, OPENING)).start(torch.cat([OPENING, torch.tensor([40])]))
    assert counting.read == [], "a prompt that is the opening and one token needs no reading at all"


def test_a_windowed_draft_keeps_its_sinks_from_the_opening(tiny_draft):
    prompt = torch.cat([OPENING, torch.arange(20, 60)])
    opened = DraftModelDrafter(Windowed(OpeningCopied(tiny_draft, OPENING), 8, sinks=4))
    plain = DraftModelDrafter(Windowed(tiny_draft, 8, sinks=4))
    opened.start(prompt)
    plain.start(prompt)
    assert opened.cache.length == plain.cache.length == 12 and opened.reading.skipped == plain.reading.skipped
    torch.testing.assert_close(opened.next_logits(prompt[-1:]), plain.next_logits(prompt[-1:]))


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_with_an_opening_equals_plain_decoding(tiny_target, tiny_draft, gamma, window):
    for tail in ([6], [6, 5, 3], [9, 9, 1, 40, 2, 33, 12, 70, 4, 4, 18], [7]):
        prompt = torch.cat([OPENING, torch.tensor(tail)])
        ref = autoregressive_generate(tiny_target, prompt, 40)
        out = speculative_generate(tiny_target, DraftModelDrafter(draft_reading(tiny_draft, window, opening=OPENING)),
                                   prompt, 40, gamma)
        assert out.tokens == ref.tokens
        # the target as its own draft, reading the whole context: a wrong opening in its cache would cost acceptance
        own_draft = DraftModelDrafter(OpeningCopied(tiny_target, OPENING))
        own = speculative_generate(tiny_target, own_draft, prompt, 40, gamma)
        assert own.tokens == ref.tokens
        assert all(s.n_accepted == len(s.proposed) for s in own.trace.steps)


def test_drafters_of_one_model_share_the_openings_keys_and_values(tiny_draft):
    a, b = Opening(tiny_draft, OPENING), Opening(tiny_draft, OPENING.clone())
    assert a.keys_values()[0] is b.keys_values()[0]
    assert Opening(tiny_draft, OPENING[:3]).keys_values()[0] is not a.keys_values()[0]


@pytest.mark.parametrize("bad,match", [(torch.tensor([[1, 2]]), "1-D"), (torch.tensor([1.0]), "1-D"),
                                       (torch.zeros(0, dtype=torch.long), "1-D"), ([1, 2], "1-D"),
                                       (torch.tensor([-1, 2]), "lie in"), (torch.tensor([96]), "lie in")])
def test_a_bad_opening_is_refused_with_what_to_pass(tiny_draft, bad, match):
    with pytest.raises(ValueError, match=match):
        OpeningCopied(tiny_draft, bad)


def test_the_compiled_loop_and_batches_decline_an_opening_and_say_why(tiny_target, tiny_draft):
    drafter = DraftModelDrafter(OpeningCopied(tiny_draft, OPENING))
    assert "opening" in why_not_compiled(tiny_target, drafter, 4, GREEDY, False)
    with pytest.raises(ValueError, match="batch the bare draft"):
        drafter.rows([torch.tensor([1, 2, 3])], 64)


def test_a_chat_templates_opening_is_what_every_prompt_starts_with():
    pytest.importorskip("transformers")
    from labkit.models.hub import DEFAULT_TARGET, converted_dir
    from labkit.models.loading import encode_prompt
    path = converted_dir(DEFAULT_TARGET)
    if not (path / "tokenizer_config.json").exists():
        pytest.skip(f"{DEFAULT_TARGET} is not installed here: make models")
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = chat_opening(tokenizer)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\n"), text
    for prompt in ("Summarize: the cat sat.", "x"):
        full = encode_prompt(tokenizer, prompt, True)
        assert torch.equal(full[:len(ids)], ids) and len(full) > len(ids)


def test_the_bench_copies_in_the_opening_only_where_the_prompts_have_one(tiny_target):
    from labkit.bench.methods import Models
    from labkit.bench.report import _opening_sentence

    class Loaded:
        model, tokenizer = tiny_target, None
    assert Models(Loaded(), chat_template=False).opening is None
    assert Models(Loaded(), loop="compiled").opening is None             # the compiled draft reads every prompt whole
    models = Models(Loaded())
    models._opening = OPENING
    assert torch.equal(models.opening, OPENING)
    assert "first 24 tokens once" in _opening_sentence({"draft_opening_tokens": 24})
    assert _opening_sentence({"draft_opening_tokens": 0}) == "" == _opening_sentence({})
