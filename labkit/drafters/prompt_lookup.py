"""Prompt lookup / n-gram drafting (Saxena 2023): copy what followed the last n-gram before.

No model at all: find the latest earlier occurrence of the sequence's last n tokens (longest
n first) and propose the tokens that followed it. It shines when the output repeats the
input (editing code, summarising, RAG) and proposes nothing when there is no match.
"""
from __future__ import annotations

import torch

from ..core.sampling import SamplingConfig
from .base import Drafter, Needs, Proposal


class PromptLookupDrafter(Drafter):
    name = "lookup"
    needs = Needs(best_first=True)      # a chain: its first n tokens are the chain it drafts with k = n

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> Proposal:
        N = tokens.shape[0]
        for n in range(min(self.max_ngram, N - 1), self.min_ngram - 1, -1):
            windows = tokens[: N - 1].unfold(0, n, 1)                          # (N-n, n), all but the last n-gram
            hits = (windows == tokens[N - n:]).all(-1).nonzero().flatten()   # start of each earlier match
            if hits.numel():
                start = int(hits[-1]) + n                                     # latest match: freshest context
                return Proposal(tokens[start: start + k].clone())
        return Proposal.empty(tokens)
