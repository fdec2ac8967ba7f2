"""A draft model with another tokenizer: drafts are passed between the two as text.

Universal assisted generation (transformers' `assistant_tokenizer=`, 2024): the draft need
not share the target's vocabulary. A token id means nothing across tokenizers (id 1234 is one
string in Qwen2.5's vocabulary and another in SmolLM2's), so the committed target tokens are
decoded to text and encoded with the draft's tokenizer; the draft continues that text in its
own tokens; its new text is encoded with the target's tokenizer, and those target tokens are
the proposal. The target verifies them as any chain (deterministic drafts: rejection sampling
treats each as a one-hot q, which keeps the target's distribution exactly).

Two alignments need care:
- the draft's cache: the committed text is encoded again each step and only the tokens past
  the longest prefix it shares with what the cache holds are fed (a re-encoding can change
  the last few draft tokens when the text grows);
- the proposal: the draft's text is encoded together with the last few committed target
  tokens' text, and proposed only when that encoding starts with those committed tokens (a
  draft text that merges with the committed tail into another token cannot be proposed as
  a continuation; that step proposes fewer tokens or none).

`TokenIntersectionDrafter` is the token-level intersection of Timor et al. (ICML 2025): the
draft drafts only tokens whose string is in both vocabularies (its distribution restricted to
them and renormalised), so each draft token is one target token, and its distribution is a
true q over the target's vocabulary. Rejection sampling with that q is lossless, and accepts
more than the one-hot q of text-level drafting when sampling.

Both need tokenizers that can spell any text (byte-level BPE or byte fallback): a tokenizer that
drops characters it lacks would hand the draft another text. `start` checks the prompt
round-trips through both and says so when it does not.
"""
from __future__ import annotations

import torch

from ..core.sampling import SamplingConfig
from .base import Drafter, Needs, Proposal, draft_chain


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class CrossTokenizerDrafter(Drafter):
    """A draft model with its own tokenizer, drafting for a target through text (no shared vocabulary needed)."""
    name = "cross-tokenizer"

    def __init__(self, draft_model, draft_tokenizer, target_tokenizer, window: int = 8,
                 draft_factor: float = 1.5):
        """window: committed target tokens re-encoded with the draft's text; draft_factor: draft tokens per
        target token asked for (a draft token may be shorter than a target token)."""
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window (committed target tokens re-encoded with the draft) must be >= 1, got {window!r}")
        self.model, self.draft_tok, self.target_tok = draft_model, draft_tokenizer, target_tokenizer
        self.window, self.draft_factor = window, draft_factor
        self.cache, self.cached_ids = None, []

    def check_target(self, target) -> None:
        n = len(self.target_tok)
        if n > target.vocab_size:
            raise ValueError(f"the target tokenizer has {n} tokens but the target's vocabulary {target.vocab_size}: "
                             "pass the target's own tokenizer as target_tokenizer")
        if len(self.draft_tok) > self.model.vocab_size:
            raise ValueError(f"the draft tokenizer has {len(self.draft_tok)} tokens but the draft model's vocabulary "
                             f"{self.model.vocab_size}: pass the draft model's own tokenizer as draft_tokenizer")

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        text = self.target_tok.decode(prompt_ids.tolist())
        for who, tok in (("target", self.target_tok), ("draft", self.draft_tok)):
            back = tok.decode(tok(text, add_special_tokens=False)["input_ids"])
            if back != text:
                at = common_prefix(list(back), list(text))
                raise ValueError(f"the {who} tokenizer cannot spell this prompt: {text[at:at + 12]!r} comes back as "
                                 f"{back[at:at + 12]!r} (no byte fallback). Drafting through text needs tokenizers "
                                 "that spell any text: a byte-level BPE, or one with byte fallback")
        self.cache, self.cached_ids = self.model.new_cache(), []

    def _encode_draft(self, text: str) -> list[int]:
        return self.draft_tok(text, add_special_tokens=False)["input_ids"]

    def _read_committed(self, committed: list[int]) -> torch.Tensor:
        """The committed text in the draft's tokens, fed past what its cache already holds: the draft's next logits (V,)."""
        if self.cache is None:
            raise ValueError("call start(prompt_ids) before propose")
        draft_ids = self._encode_draft(self.target_tok.decode(committed))
        keep = min(common_prefix(self.cached_ids, draft_ids), len(draft_ids) - 1)   # feed at least one token
        self.cache.truncate(keep)
        device = self.model.device
        logits = self.model(torch.tensor([draft_ids[keep:]], device=device), self.cache, num_logits=1)[0, -1].cpu()
        self.cached_ids = list(draft_ids)
        return logits

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> Proposal:
        if k == 0:
            return Proposal.empty(tokens)
        committed = tokens.tolist()
        # 1. the committed text in the draft's tokens; feed what the draft's cache does not hold yet
        logits = self._read_committed(committed)
        device = self.model.device
        # 2. the draft continues in its own tokens (its cache rolls back to the committed text next step)
        feed = lambda i, x: self.model(x.view(1, 1).to(device), self.cache)[0, -1].cpu()   # (V,)
        drafted = draft_chain(logits, feed, max(1, round(k * self.draft_factor)), sampling, generator).tokens.tolist()
        self.cached_ids += drafted[:-1]
        # 3. its text in the target's tokens, after the committed tail it must not merge with
        tail = committed[-self.window:]
        encoded = self.target_tok(self.target_tok.decode(tail) + self.draft_tok.decode(drafted),
                                  add_special_tokens=False)["input_ids"]
        if encoded[: len(tail)] != tail:
            return Proposal.empty(tokens)
        proposal = torch.tensor(encoded[len(tail): len(tail) + k], dtype=torch.long)
        return Proposal(proposal) if proposal.numel() else Proposal.empty(tokens)

    def commit(self, n_cached: int, features: torch.Tensor | None = None, verdict: torch.Tensor | None = None) -> None:
        pass            # the next propose re-aligns the draft's cache with the committed text


def shared_vocabulary(draft_tokenizer, target_tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft ids (S,), target ids (S,)) of the S token strings both vocabularies hold, in draft-id order."""
    target_vocab = target_tokenizer.get_vocab()
    pairs = sorted((i, target_vocab[s]) for s, i in draft_tokenizer.get_vocab().items() if s in target_vocab)
    if not pairs:
        raise ValueError("the two tokenizers share no token string (their vocabularies spell tokens differently, "
                         "say byte-level BPE against SentencePiece): draft through text with CrossTokenizerDrafter")
    draft_ids, target_ids = torch.tensor(pairs).T
    return draft_ids, target_ids


class TokenIntersectionDrafter(CrossTokenizerDrafter):
    """A draft with another tokenizer restricted to the tokens both vocabularies share (Timor et al., 2025):
    each draft token is one target token, and q is a true distribution over the target's vocabulary."""
    name = "token-intersection"
    needs = Needs(samples_tokens=True)  # when sampling, each token is drawn from q over the shared vocabulary

    def __init__(self, draft_model, draft_tokenizer, target_tokenizer):
        super().__init__(draft_model, draft_tokenizer, target_tokenizer)
        self.draft_ids, self.target_ids = shared_vocabulary(draft_tokenizer, target_tokenizer)    # (S,), (S,)
        self.to_target = torch.full((draft_model.vocab_size,), -1)                                 # (V_draft,)
        self.to_target[self.draft_ids] = self.target_ids
        self.outside = self.to_target < 0                                                          # (V_draft,)
        self.target_vocab = None

    def check_target(self, target) -> None:
        super().check_target(target)
        self.target_vocab = target.vocab_size

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> Proposal:
        if self.target_vocab is None:
            raise ValueError("the decoder calls check_target(target) first: decode with speculative_generate")
        if k == 0:
            return Proposal.empty(tokens)
        logits = self._read_committed(tokens.tolist())                                # (V_draft,)
        masked = lambda lg: lg.masked_fill(self.outside, float("-inf"))               # (V_draft,)
        feed = lambda i, x: masked(self.model(x.view(1, 1).to(self.model.device), self.cache)[0, -1].cpu())
        chain = draft_chain(masked(logits), feed, k, sampling, generator, keep_q=True)   # in the draft's vocabulary
        self.cached_ids += chain.tokens[:-1].tolist()                                 # the last draft was not fed
        q_draft = torch.zeros(k, self.target_vocab)                                   # (k, V)
        q_draft[:, self.target_ids] = chain.q_draft[:, self.draft_ids].float()
        token = self.to_target[chain.tokens]                                          # (k,)
        return Proposal(token, q_draft, q_draft[torch.arange(k), token])
