"""A small draft model of the same tokenizer proposes K tokens autoregressively (Leviathan 2023).

It keeps its own KV cache, filled with the prompt (but its last token) when decoding starts.
Each `propose` first feeds the committed tokens it has not seen (the last step's accepted tokens and the target's correction/bonus token), then drafts.
`commit` truncates its cache to what the target accepted. For B sequences at once it keeps one
`RaggedCache` and drafts every row in the same forward: each draft position costs one forward
of B tokens, not B forwards of one.

A draft only guesses, so it need not read everything the target reads. With `window=W` it sees
the context's first `sinks` tokens (attention sinks) and its last W tokens, at contiguous
positions, as StreamingLLM (Xiao et al. 2024) and TriForce (Sun et al. 2024) keep a draft's
cache: its prefill and each step cost the same whatever the prompt's length. Once the tokens past
the sinks reach 2W it starts a fresh window of the last W (one draft forward over W tokens, every
W committed tokens). The target still verifies against the whole context, so the output is
exactly the target's; only how often the draft is right can change. With `window=AutoWindow(...)`
(drafters/window.py) the window is chosen per prompt from this machine's costs: the whole context
where the draft reads it cheaply enough, the window where not.

Nor need it score every token. With `vocab=k` its LM head is cut to the k most frequent ids and
the prompt's own (drafters/vocab.py, FR-Spec): a cheaper step that never proposes a rarer token;
the target's verify keeps the output exact.

Nor need it reread what every prompt starts with. With `opening=ids` (drafters/opening.py: the chat template's
system turn) it copies the opening's keys and values, computed once per draft model, into each prompt's cache
and reads only the rest.
"""
from __future__ import annotations

import torch

from ..core.sampling import SamplingConfig, draw
from ..models.ragged_cache import RaggedCache, left_pad
from .base import Drafter, Proposal, draft_chain
from .opening import Opening
from .vocab import VocabHead, as_ids
from .window import DEFAULT_WINDOW, AutoWindow  # noqa: F401 (DEFAULT_WINDOW: read from here too)


class DraftModelDrafter(Drafter):
    name = "draft"
    best_first = True                   # a chain: its first n tokens are the chain it drafts with k = n
    samples_tokens = True               # when sampling, each token is drawn from the draft's distribution

    def __init__(self, model, stop_below: float | None = None, eos_token_ids: tuple[int, ...] = (),
                 window: int | None | AutoWindow = None, sinks: int = 4, vocab: int | str | torch.Tensor | None = None,
                 opening: torch.Tensor | None = None):
        """`stop_below`: stop drafting early once the draft's own top probability drops below it.
        `window`: the draft reads the first `sinks` tokens and the last `window` of the context (None: all of it;
        an AutoWindow: chosen per prompt, see `start`).
        `vocab`: the ids the draft may propose: the k most frequent (an int; "auto": vocab.DEFAULT_VOCAB where a
        ranking is shipped for the draft's vocabulary, else all), the ids themselves (a tensor), or None for all;
        `eos_token_ids` and each prompt's ids are always among them.
        `opening`: ids (n,) many prompts start with (opening.chat_opening(tokenizer)), read once per draft model
        and copied into the cache of each prompt that starts with them; None: every prompt is read whole."""
        if stop_below is not None and not 0 <= stop_below < 1:
            raise ValueError(f"stop_below must be in [0, 1) or None, got {stop_below}")
        self.auto = window if isinstance(window, AutoWindow) else None
        if self.auto is not None:
            window, sinks = self.auto.window, self.auto.sinks
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be an integer >= 1 (tokens the draft reads) or None for the whole "
                             f"context, got {window!r}")
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise ValueError(f"sinks must be an integer >= 0 (the context's first tokens the draft keeps), got {sinks!r}")
        self.model, self.stop_below, self.eos_token_ids = model, stop_below, set(eos_token_ids)
        self.window, self.sinks = window, sinks
        ids = as_ids(vocab, model.vocab_size, tuple(sorted(self.eos_token_ids)))
        self.head = None if ids is None else VocabHead(model, ids)     # None: the model's whole LM head
        self.opening = None if opening is None else Opening(model, opening)
        self.cache = None
        self.skipped = 0            # committed tokens between the sinks and the window that the cache left out

    def check_target(self, target) -> None:
        check_draft_model(target, self.model)

    @torch.no_grad()
    def device_parts(self) -> tuple:
        """The compiled loop drafts with this model on the device: the textbook draft only."""
        if self.window is not None or self.stop_below is not None or self.head is not None \
                or self.opening is not None or self.eos_token_ids:
            raise ValueError("the draft model reads a window of the context, scores a vocabulary of its own, copies "
                             "in an opening or stops early: the compiled draft reads the whole context and drafts k "
                             "tokens every step, so build the drafter as DraftModelDrafter(model) (no window, vocab, "
                             "stop_below, eos_token_ids or opening)")
        return self.model, None

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        """Read the prompt but its last token (or, with a window, its sinks and last W) now, as the target
        does: the draft's own prefill is counted with the prefill, not with the first step's drafting. An
        AutoWindow picks this prompt's window first (`self.window`: None when the draft reads it all). Where the
        prompt starts with the opening, the cache starts with the opening's keys and values and the rest is read."""
        self.cache, self.skipped = self.model.new_cache(), 0
        if self.auto is not None:
            self.window = self.auto.choose(prompt_ids.numel())
        if self.head is not None:                                           # a vocabulary: and the prompt's ids
            self.head.extend(prompt_ids)
        if self.opening is not None:
            self.opening.fill(self.cache, prompt_ids[:-1])
        unseen = self.unseen(prompt_ids[:-1])                              # (n,): after the opening, or a window
        if unseen.numel():
            self.model(unseen[None].to(self.model.device), self.cache, num_logits=1)

    def unseen(self, tokens: torch.Tensor) -> torch.Tensor:
        """The committed tokens (n,) the draft has not read yet; with a window, a fresh one started when due."""
        held = self.cache.length + self.skipped                                  # committed tokens accounted for
        if self.window is not None and len(tokens) - min(len(tokens), self.sinks) - self.skipped > 2 * self.window:
            kept = min(self.cache.length, self.sinks)
            self.cache.truncate(kept)
            self.skipped = len(tokens) - self.sinks - self.window
            return torch.cat([tokens[kept:self.sinks], tokens[-self.window:]])   # sinks, then the last W
        return tokens[held:]

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> Proposal:
        if k == 0:
            return Proposal.empty(tokens)
        unseen = self.unseen(tokens).to(self.model.device)                      # (n,): >= 1 committed token
        logits = self.next_logits(unseen)                                       # (V,), sampled on the host
        feed = lambda i, x: self.next_logits(x.view(1).to(self.model.device))   # (V,)
        return draft_chain(logits, feed, k, sampling, generator, stop=self._stops)

    def next_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Read `tokens` (n,) into the cache; the draft's logits (V,) for the next token, on the host (with a
        vocabulary: its ids' logits, -inf elsewhere)."""
        if self.head is None:
            return self.model(tokens[None], self.cache, num_logits=1)[0, -1].cpu()
        h = self.model.hidden(tokens[None], self.cache)[0, -1:]                 # (1, D)
        return self.head.spread(self.head(h)[0].cpu())

    def commit(self, n_cached: int, features: torch.Tensor | None = None) -> None:
        if n_cached - self.skipped < self.sinks and self.skipped:    # rolled back into the skipped stretch: restart
            self.cache.truncate(min(self.cache.length, self.sinks, n_cached))
            self.skipped = 0
        self.cache.truncate(min(self.cache.length, n_cached - self.skipped))

    def _stops(self, token: int, probs: torch.Tensor) -> bool:
        return token in self.eos_token_ids or (self.stop_below is not None and float(probs.max()) < self.stop_below)

    @torch.no_grad()
    def start_rows(self, prompts: list[torch.Tensor], max_len: int) -> None:
        """A cache for all rows, prefilled with each prompt but its last token (as the target's is)."""
        if self.window is not None or self.auto is not None or self.head is not None or self.opening is not None:
            raise ValueError("a windowed draft (window=...), one with a vocabulary (vocab=...) or an opening "
                             "(opening=...) drafts one sequence at a time: batch it with "
                             "DraftModelDrafter(model, window=None, vocab=None, opening=None)")
        self.rows_cache = RaggedCache(self.model, len(prompts), max_len)
        if max(p.numel() for p in prompts) > 1:
            self.rows_cache.feed(*left_pad([p[:-1].tolist() for p in prompts]))

    @torch.no_grad()
    def propose_rows(self, rows: list[torch.Tensor], k: list[int], sampling: SamplingConfig,
                     generator: torch.Generator | None = None) -> list[Proposal]:
        """Every row drafts in the same forwards; a row with k[b] = 0 (or one that stopped) feeds padding."""
        cache, B = self.rows_cache, len(rows)
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
            live &= torch.tensor([i + 1 < k[b] and not self._stops(int(x[b]), probs[b]) for b in range(B)])
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

    def commit_rows(self, n_cached: list[int]) -> None:
        cache = self.rows_cache
        cache.truncate_rows(torch.minimum(torch.tensor(n_cached), cache.length))


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
