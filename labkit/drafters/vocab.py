"""A draft that scores only the tokens it is likely to need: its LM head cut to the most frequent ids.

A small draft model spends a large share of each step on its LM head: the 0.5B Qwen2.5 draft's head is
151,936 x 896, a quarter of its weights, streamed whole for every drafted token. Most of those rows are
tokens that almost never occur. FR-Spec (Zhao et al. 2025) scores only the most frequent ones in the draft
(EAGLE-3 ships its heads with such a draft vocabulary too): a draft token outside them is never proposed,
which can cost acceptance, never correctness, since the target still verifies every token with its full
head. Greedy output stays the target's, token for token; sampled output keeps the target's distribution,
because the draft's distribution q (zero outside the vocabulary) is the one its tokens were drawn from.

The ranking comes from counting the tokens of chat (ShareGPT V3, every language) and code (the Python
standard library) with the model's tokenizer: data/vocab/<family>/token_ranks.pt, made by
scripts/token_frequency.py, with its provenance. `frequent_tokens(k, vocab_size)` gives its first k ids.

    drafter = DraftModelDrafter(CutVocab(draft.model, 32768))    # the 32,768 most frequent ids, and the prompt's

`CutVocab` wraps the draft model (drafters/reading.py) with a `VocabHead`:

    head = VocabHead(draft.model, frequent_tokens(32768, draft.model.vocab_size))
    head.extend(prompt_ids)              # and the prompt's own ids, whatever their rank
    logits = head.spread(head(h))        # (V,): the head's rows at its ids, -inf elsewhere
"""
from __future__ import annotations

import weakref
from functools import lru_cache, partial

import torch
import torch.nn as nn

from ..files.shipped import shipped
from ..models.backends import rows_of
from .reading import DraftWrapper

# vocab="auto" (the CLI's and the bench's default): the 32,768 most frequent ids where a ranking is shipped for the
# draft's vocabulary. Read off the step time and speedup against the size (scripts/draft_vocab.py,
# data/bench/draft_vocab_amd-epyc-avx2/: the 4-bit 0.5B draft's step at 0.83 of the whole head's, and its answers
# covered but for 5% of tokens, most of them in translations).
DEFAULT_VOCAB = 32768


@lru_cache(maxsize=None)
def token_ranks(vocab_size: int) -> torch.Tensor:
    """Every ranked id (most frequent first) of the shipped ranking made for a vocabulary of `vocab_size` ids."""
    found = []
    for path in sorted(shipped("vocab").glob("*/token_ranks.pt")):
        ranks = torch.load(path, weights_only=True)
        if ranks["vocab_size"] == vocab_size:
            return ranks["ids"].long()
        found.append(f"{path.parent.name} ({ranks['vocab_size']:,} ids)")
    raise ValueError(f"no shipped token ranking is made for a vocabulary of {vocab_size:,} ids (there are: "
                     f"{', '.join(found) or 'none'}): count one with scripts/token_frequency.py --model <the draft>, "
                     "or pass the ids to draft with (vocab=tensor)")


def frequent_tokens(k: int, vocab_size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The k most frequent ids of the ranking for `vocab_size`, and `always` (e.g. end-of-sequence ids), sorted."""
    ranked = token_ranks(vocab_size)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(ranked):
        raise ValueError(f"a draft vocabulary must hold 1 to {len(ranked):,} ids (the ranking's length), got {k!r}: "
                         "use None for the whole vocabulary")
    return torch.cat([ranked[:k], torch.tensor(always, dtype=torch.long)]).unique()


def auto_vocab(vocab_size: int) -> int | None:
    """What vocab="auto" means for a draft of `vocab_size` ids: DEFAULT_VOCAB where a ranking is shipped for it, else
    None (every id)."""
    try:
        return DEFAULT_VOCAB if len(token_ranks(vocab_size)) >= DEFAULT_VOCAB else None
    except ValueError:
        return None


def as_ids(vocab, vocab_size: int, always: tuple[int, ...] = ()) -> torch.Tensor | None:
    """A drafter's `vocab` argument -> sorted ids (n,), or None for the whole vocabulary: a count of the most
    frequent ids (frequent_tokens), "auto" (auto_vocab), or the ids themselves (a 1-D tensor of ids below
    vocab_size)."""
    if isinstance(vocab, str) and vocab == "auto":
        vocab = auto_vocab(vocab_size)
    if vocab is None:
        return None
    if isinstance(vocab, torch.Tensor):
        if vocab.dim() != 1 or vocab.numel() == 0 or vocab.dtype.is_floating_point:
            raise ValueError(f"vocab must be a 1-D tensor of token ids, got shape {tuple(vocab.shape)} {vocab.dtype}")
        if int(vocab.min()) < 0 or int(vocab.max()) >= vocab_size:
            raise ValueError(f"vocab holds ids outside the model's vocabulary of {vocab_size:,}")
        return torch.cat([vocab.long().cpu(), torch.tensor(always, dtype=torch.long)]).unique()
    return frequent_tokens(vocab, vocab_size, always)


_CUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # LM head -> {ids' bytes: its rows at those ids}


class VocabHead(nn.Module):
    """`model`'s LM head at `ids` (n,) alone, on the model's own path and precision (models.backends.rows_of), and at
    the ids of the text it last `extend`ed it with (a prompt's: names and words a draft copies from it)."""

    def __init__(self, model, ids: torch.Tensor):
        super().__init__()
        self.vocab_size = model.vocab_size
        self.cut = partial(rows_of, model.lm_head)                                      # ids (m,) -> a layer
        self.register_buffer("ids", ids.long().to(model.device))                         # (n,) sorted
        self.register_buffer("extra_ids", self.ids[:0])                                  # (m,) from extend
        self.register_buffer("scored", self.ids)       # (n + m,) every id the head scores, in its logits' order
        # cutting 32k rows takes a fraction of a second: once per head and ids, shared by every drafter that asks
        cut = _CUTS.setdefault(model.lm_head, {})
        key = ids.long().cpu().numpy().tobytes()
        if key not in cut:
            cut[key] = self.cut(self.ids)
        self.rows, self.extra = cut[key], None

    def extend(self, tokens: torch.Tensor) -> None:
        """Score the ids of `tokens` too (those not among `ids`), in place of the last text's."""
        new = tokens.to(self.ids.device).long().unique()
        self.extra_ids = new[~torch.isin(new, self.ids)]                                 # (m,)
        self.extra = self.cut(self.extra_ids) if len(self.extra_ids) else None
        self.scored = torch.cat([self.ids, self.extra_ids])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states (..., D) -> logits (..., n + m) at `scored`, in fp32."""
        h = h.contiguous()
        logits = self.rows(h).float()
        return logits if self.extra is None else torch.cat([logits, self.extra(h).float()], -1)

    def spread(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits (..., n + m) at `scored` -> (..., V), -inf at every other id (their probability is 0)."""
        out = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.scored.to(logits.device)] = logits
        return out


class CutVocab(DraftWrapper):
    """A draft model that scores only `vocab` (as_ids: a count of the most frequent ids, "auto", or the ids), the ids
    in `always` (the end-of-sequence ids) and each prompt's own: a cheaper step that never proposes a rarer token;
    the target's verify keeps the output exact."""

    def __init__(self, model, vocab: int | str | torch.Tensor, always: tuple[int, ...] = ()):
        super().__init__(model)
        ids = as_ids(vocab, self.model.vocab_size, tuple(sorted(always)))
        if ids is None:
            raise ValueError(f"vocab={vocab!r} means every id here (no ranking is shipped for a vocabulary of "
                             f"{self.model.vocab_size:,}): leave the draft model unwrapped (with_vocab does)")
        self.head = VocabHead(self.model, ids)

    def prepare(self, prompt_ids: torch.Tensor, cache) -> None:
        self.head.extend(prompt_ids)                                    # and the prompt's ids
        self.inner.prepare(prompt_ids, cache)

    def logits(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        """Read `tokens` (n,); the logits (V,) of the head's ids, -inf elsewhere, on the host."""
        h = self.model.hidden(tokens[None], cache)[0, -1:]                  # (1, D)
        return self.head.spread(self.head(h)[0].cpu())

    def choices(self) -> list[str]:
        return self.inner.choices() + [f"the draft scored {self.head.scored.numel():,} of its "
                                       f"{self.model.vocab_size:,} token ids"]


def with_vocab(model, vocab: int | str | torch.Tensor | None, always: tuple[int, ...] = ()):
    """`model` in a CutVocab, or as it is where `vocab` means every id (None, or "auto" without a shipped ranking)."""
    if vocab is None or (isinstance(vocab, str) and vocab == "auto" and auto_vocab(model.vocab_size) is None):
        return model
    return CutVocab(model, vocab, always)
