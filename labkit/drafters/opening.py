"""The opening every chat prompt starts with, read by the draft once instead of with every prompt.

Through a chat template every prompt opens with the same tokens: Qwen2.5's system turn and the start of the
user's turn are 24 of them, half of a one-sentence request such as "Translate into French: ...". A draft model
reads the prompt before its first guess, and the target's decoding must earn that reading back
(drafters/draft_model.py), so on a short prompt half of it would go to tokens the draft read in the last
request too. `Opening` computes their keys and values once per draft model and copies them into the cache of
each prompt that starts with them, as serving engines keep a system prompt's cache (vLLM's automatic prefix
caching, llama.cpp's prompt cache). A position's keys and values depend only on the tokens up to it, so the
draft's cache holds what reading the whole prompt puts there. Only the draft's reading changes: the target
still reads its whole prompt and verifies every token, so the output stays the target's.

    opening = chat_opening(tokenizer)                                    # (24,) for Qwen2.5's template
    drafter = DraftModelDrafter(OpeningCopied(draft.model, opening))     # each prompt: reads only what follows it
"""
from __future__ import annotations

import weakref

import torch

from ..models.kv_cache import KVCache
from .reading import DraftWrapper

# Each draft model's openings, read once: model -> {ids: (keys, values)}, shared by every drafter of the model (the
# bench makes a drafter per request).
_READ: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def chat_opening(tokenizer) -> torch.Tensor:
    """The ids (n,) every prompt put through `tokenizer`'s chat template starts with: the longest prefix that two
    different requests share (empty where the tokenizer has no chat template)."""
    from ..models.loading import encode_prompt
    if getattr(tokenizer, "chat_template", None) is None:
        return torch.zeros(0, dtype=torch.long)
    a, b = (encode_prompt(tokenizer, text, True) for text in ("Hello.", "Translate into French: good night"))
    n = min(len(a), len(b))
    differs = (a[:n] != b[:n]).nonzero()
    return a[:int(differs[0]) if len(differs) else n].clone()


class Opening:
    """Tokens many prompts start with, whose keys and values a draft model computes once and copies into a cache."""

    def __init__(self, model, ids: torch.Tensor):
        """`ids` (n,): the opening's token ids, n >= 1 (chat_opening(tokenizer) for a chat template's)."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point():
            raise ValueError("opening must be a 1-D tensor of at least one token id, such as "
                             "labkit.drafters.opening.chat_opening(tokenizer), or None for none")
        if int(ids.min()) < 0 or int(ids.max()) >= model.vocab_size:
            raise ValueError(f"the opening's ids must lie in [0, {model.vocab_size}) (the draft's vocabulary), got "
                             f"{int(ids.min())} to {int(ids.max())}: encode it with the draft's tokenizer")
        self.model, self.ids = model, ids.long().cpu()

    def __len__(self) -> int:
        return self.ids.numel()

    def opens(self, tokens: torch.Tensor) -> bool:
        """Whether `tokens` (T,) start with the opening."""
        n = len(self)
        return tokens.numel() >= n and torch.equal(tokens[:n].cpu(), self.ids)

    @torch.no_grad()
    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The opening's keys and values (L, 1, Hkv, n, hd) each, computed on first use and shared by the model's
        drafters."""
        read = _READ.setdefault(self.model, {})
        key = tuple(self.ids.tolist())
        if key not in read:
            cache = self.model.new_cache(max_len=len(self))
            self.model(self.ids[None].to(self.model.device), cache, num_logits=1)
            read[key] = (cache.k.clone(), cache.v.clone())
        return read[key]

    def fill(self, cache, tokens: torch.Tensor) -> int:
        """Copy the opening into an empty `cache` when `tokens` (T,) open with it; returns how many tokens the cache
        then holds (0 where they do not, or where the cache is not labkit's KVCache: read them all)."""
        if type(cache) is not KVCache or cache.length or not self.opens(tokens):
            return 0
        k, v = self.keys_values()                                        # (L, 1, Hkv, n, hd) each
        n = len(self)
        cache.k[:, :, :, :n] = k
        cache.v[:, :, :, :n] = v
        cache.advance(n)
        return n


class OpeningCopied(DraftWrapper):
    """A draft model that copies the keys and values of `ids` (n,), read once, into the cache of each prompt that
    starts with them, and reads only the rest."""

    def __init__(self, model, ids: torch.Tensor):
        super().__init__(model)
        self.opening = Opening(self.model, ids)

    def prepare(self, prompt_ids: torch.Tensor, cache) -> None:
        self.inner.prepare(prompt_ids, cache)
        self.opening.fill(cache, prompt_ids[:-1])

    def choices(self) -> list[str]:
        return self.inner.choices() + [f"the draft copied in the {len(self.opening)}-token opening it read once"]
