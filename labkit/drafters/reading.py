"""How a draft model reads the committed context and scores its next token.

The textbook draft (Leviathan 2023, notebook 02) reads every committed token and scores every id:
`Whole(model)`, what `DraftModelDrafter(model)` drafts with. A draft only guesses, so it may read
less, and the wrappers of the draft model say how, each in the file of its idea: `Windowed`
(window.py: the context's first tokens and its last W), `CutVocab` (vocab.py: the LM head cut to
the frequent ids and the prompt's), `OpeningCopied` (opening.py: the chat opening's keys and
values, computed once, copied into each prompt's cache). They stack,

    drafter = DraftModelDrafter(Windowed(CutVocab(draft_model, 32768), 64))

and since the target verifies every token, none changes the output: only how often the draft is
right and what its step costs. A reading has four steps, which DraftModelDrafter calls on the
draft's KV cache:

    prepare(prompt_ids, cache)    a new sequence: what to set up before its prompt is read
    unseen(tokens, cache)         the committed tokens (n,) it has not read yet
    logits(tokens, cache)         read `tokens` (n,) into the cache: the next token's logits (V,), on the host
    commit(cache, n_cached)       the target kept the first n_cached committed tokens: drop the rest
"""
from __future__ import annotations

import torch


class Whole:
    """The textbook draft's reading: every committed token, every id of the vocabulary."""

    def __init__(self, model):
        self.model = model

    def prepare(self, prompt_ids: torch.Tensor, cache) -> None:
        pass

    def unseen(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        return tokens[cache.length:]

    def logits(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        return self.model(tokens[None], cache, num_logits=1)[0, -1].cpu()

    def commit(self, cache, n_cached: int) -> None:
        cache.truncate(min(cache.length, n_cached))

    def choices(self) -> list[str]:
        """What this reading does beyond the textbook's, in words: nothing."""
        return []


class DraftWrapper:
    """A reading that changes some of the steps of the one it wraps (a bare model is read whole) and passes the
    others on; `model` is the network underneath."""

    def __init__(self, inner):
        self.inner = as_reading(inner)

    def __getattr__(self, name: str):
        if name == "inner":                      # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def prepare(self, prompt_ids: torch.Tensor, cache) -> None:
        self.inner.prepare(prompt_ids, cache)

    def choices(self) -> list[str]:
        return self.inner.choices()


def as_reading(model) -> Whole | DraftWrapper:
    """`model` as a reading: a wrapper as it is, a bare draft model read whole."""
    return model if isinstance(model, (Whole, DraftWrapper)) else Whole(model)


def is_textbook(reading) -> bool:
    """Whether the draft reads every committed token and scores every id (no wrapper)."""
    return isinstance(as_reading(reading), Whole)
