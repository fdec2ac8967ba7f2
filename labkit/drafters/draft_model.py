"""A small draft model of the same tokenizer proposes K tokens autoregressively (Leviathan 2023).

It keeps its own KV cache, filled with the prompt (but its last token) when decoding starts.
Each `propose` first feeds the committed tokens it has not seen (the last step's accepted tokens and the target's
correction/bonus token), then drafts. `commit` truncates its cache to what the target accepted. For B sequences at
once `rows` gives a `DraftModelRows`, one `RaggedCache` whose rows all draft in the same forward: each draft position
costs one forward of B tokens, not B forwards of one.

`DraftModelDrafter(model)` is the textbook draft: it reads the whole context and scores every id. A draft only
guesses, so it need not: wrapped (drafters/reading.py), the same drafter reads a window of the context
(`Windowed`, window.py), scores a cut vocabulary (`CutVocab`, vocab.py) or copies in the chat opening read once
(`OpeningCopied`, opening.py); `draft_reading` stacks the ones asked for. The target still verifies every token.
"""
from __future__ import annotations

import torch

from ..core.sampling import SamplingConfig, draw
from ..models.ragged_cache import RaggedCache, left_pad
from .base import Drafter, Needs, Proposal, draft_chain
from .opening import OpeningCopied
from .reading import as_reading, is_textbook
from .vocab import with_vocab
from .window import DEFAULT_WINDOW, AutoWindow, Windowed  # noqa: F401 (DEFAULT_WINDOW: read from here too)


class DraftModelDrafter(Drafter):
    name = "draft"
    # a chain (its first n tokens are the chain it drafts with k = n) of draws from the draft's distribution; the
    # compiled chain loop may run the model on the device, and a batch drafts every row in one forward
    needs = Needs(best_first=True, samples_tokens=True, device="model", rows=True)

    def __init__(self, model, stop_below: float | None = None, eos_token_ids: tuple[int, ...] = ()):
        """`model`: the draft model, or the draft model wrapped to read less (drafters/reading.py).
        `stop_below`: stop drafting early once the draft's own top probability drops below it.
        `eos_token_ids`: stop drafting after one of them."""
        if stop_below is not None and not 0 <= stop_below < 1:
            raise ValueError(f"stop_below must be in [0, 1) or None, got {stop_below}")
        self.reading = as_reading(model)
        self.model, self.stop_below, self.eos_token_ids = self.reading.model, stop_below, set(eos_token_ids)
        self.cache = None

    def check_target(self, target) -> None:
        check_draft_model(target, self.model)

    def device_parts(self) -> tuple:
        """(the draft model, None): the compiled chain loop drafts with this model on the device, the textbook
        draft only (decoding/compiled.py's protocol)."""
        if not is_textbook(self.reading) or self.stop_below is not None or self.eos_token_ids:
            raise ValueError("the draft model reads a window of the context, scores a vocabulary of its own, copies "
                             "in an opening or stops early: the compiled draft reads the whole context and drafts k "
                             "tokens every step, so build the drafter as DraftModelDrafter(model) (no wrapper, "
                             "stop_below or eos_token_ids)")
        return self.model, None

    @torch.no_grad()
    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        """Read the prompt but its last token now, as the target does: the draft's own prefill is counted with the
        prefill, not with the first step's drafting (a wrapped draft first prepares: picks its window, copies in
        the opening)."""
        self.cache = self.model.new_cache()
        self.reading.prepare(prompt_ids, self.cache)
        unseen = self.reading.unseen(prompt_ids[:-1], self.cache)                 # (n,)
        if unseen.numel():
            self.model(unseen[None].to(self.model.device), self.cache, num_logits=1)

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> Proposal:
        if k == 0:
            return Proposal.empty(tokens)
        unseen = self.reading.unseen(tokens, self.cache).to(self.model.device)   # (n,): >= 1 committed token
        logits = self.next_logits(unseen)                                       # (V,), sampled on the host
        feed = lambda i, x: self.next_logits(x.view(1).to(self.model.device))   # (V,)
        return draft_chain(logits, feed, k, sampling, generator, stop=self._stops)

    def next_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Read `tokens` (n,) into the cache; the draft's logits (V,) for the next token, on the host."""
        return self.reading.logits(tokens, self.cache)

    def commit(self, n_cached: int, features: torch.Tensor | None = None, verdict: torch.Tensor | None = None) -> None:
        self.reading.commit(self.cache, n_cached)

    def _stops(self, token: int, probs: torch.Tensor) -> bool:
        return token in self.eos_token_ids or (self.stop_below is not None and float(probs.max()) < self.stop_below)

    def rows(self, prompts: list[torch.Tensor], max_len: int) -> "DraftModelRows":
        """This draft for B rows at once (decoding/batched.py's protocol), its cache prefilled with each prompt."""
        if not is_textbook(self.reading):
            raise ValueError("a draft wrapped to read less (Windowed, CutVocab, OpeningCopied) drafts one sequence at "
                             "a time: batch the bare draft, DraftModelDrafter(model)")
        return DraftModelRows(self.model, prompts, max_len, self._stops)


class DraftModelRows:
    """The draft model drafting B rows in the same forwards: one `RaggedCache`, each draft position one forward of
    B tokens (not B forwards of one)."""

    @torch.no_grad()
    def __init__(self, model, prompts: list[torch.Tensor], max_len: int, stops):
        """A cache for all rows, prefilled with each prompt but its last token (as the target's is); stops(x, probs):
        a row ends its chain after x."""
        self.cache, self.stops = RaggedCache(model, len(prompts), max_len), stops
        if max(p.numel() for p in prompts) > 1:
            self.cache.feed(*left_pad([p[:-1].tolist() for p in prompts]))

    @torch.no_grad()
    def propose(self, rows: list[torch.Tensor], k: list[int], sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> list[Proposal]:
        """Row b's chain of at most k[b] tokens after its committed tokens rows[b] (N_b,); every row drafts in the
        same forwards, and a row with k[b] = 0 (or one that stopped) feeds padding."""
        cache, B = self.cache, len(rows)
        if max(k) == 0:
            return [Proposal.empty(t) for t in rows]
        unseen = [t[int(cache.length[b]):].tolist() if k[b] > 0 else [] for b, t in enumerate(rows)]
        logits = cache.feed(*left_pad(unseen))[:, -1]                                  # (B, V)
        live = torch.tensor(k) > 0                                                     # (B,) still drafting
        drafted, q_rows = [], []
        for i in range(max(k)):
            x, probs = draw(logits, sampling, generator)                               # (B,), (B, V)
            drafted.append(torch.where(live, x, -1))
            q_rows.append(probs)
            live &= torch.tensor([i + 1 < k[b] and not self.stops(int(x[b]), probs[b]) for b in range(B)])
            if not live.any():
                break
            logits = cache.feed(x[:, None], live.long())[:, -1]                        # (B, V)
        tokens, q_draft = torch.stack(drafted, 1), torch.stack(q_rows, 1)              # (B, K), (B, K, V)
        out = []
        for b in range(B):
            n = int((tokens[b] >= 0).sum())                                            # drafted, then -1s
            q_tok = q_draft[b, torch.arange(n), tokens[b, :n]]                         # (n,)
            out.append(Proposal(tokens[b, :n], None if sampling.greedy else q_draft[b, :n], q_tok))
        return out

    def commit(self, n_cached: list[int]) -> None:
        """The target's cache now holds row b's first n_cached[b] committed tokens."""
        self.cache.truncate_rows(torch.minimum(torch.tensor(n_cached), self.cache.length))


def draft_reading(model, window: int | AutoWindow | None = None, vocab: int | str | torch.Tensor | None = None,
                  opening: torch.Tensor | None = None, always: tuple[int, ...] = ()):
    """`model` wrapped in the speed choices asked for, each None for off: a window of the context (Windowed), a
    vocabulary (CutVocab via with_vocab, `always` among its ids), an opening copied in (OpeningCopied); the bare
    model where none is asked."""
    draft = with_vocab(model, vocab, always)
    if opening is not None and opening.numel():
        draft = OpeningCopied(draft, opening)
    return draft if window is None else Windowed(draft, window)


def check_draft_model(target, draft) -> None:
    """A draft model must share the target's vocabulary and hold as long a context."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model's vocabulary has {draft.vocab_size} ids, the target's {target.vocab_size}: "
                         "a draft must use the target's tokenizer (pick one from the target's family), or use "
                         "PromptLookupDrafter, which needs no model")
    if draft.max_seq_len < target.max_seq_len:
        raise ValueError(f"the draft model's context holds {draft.max_seq_len} tokens, the target's "
                         f"{target.max_seq_len}: load the draft with max_seq_len={target.max_seq_len} "
                         f"(or the target with {draft.max_seq_len})")
