"""The one interface every drafter implements: propose K tokens after the committed ones.

A drafter sees the committed token ids (prompt + generated), never text. The speculative
loop calls `start` once per sequence, `propose` once per step and `rollback` after the
target has decided, so a drafter with state (a KV cache) can drop what was rejected.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..sampling import SamplingConfig


@dataclass
class Proposal:
    tokens: torch.Tensor                  # (K,) proposed token ids
    q_draft: torch.Tensor | None = None   # (K, V) distribution each token was sampled from; None: deterministic
    q_token: torch.Tensor | None = None   # (K,) the drafter's probability of each token (for the trace)

    def __post_init__(self):
        if self.q_token is None:
            self.q_token = torch.ones(self.tokens.shape[0])

    @property
    def k(self) -> int:
        return self.tokens.shape[0]

    def q_or_one_hot(self, vocab_size: int) -> torch.Tensor:
        """q_draft, or the one-hot of a deterministic proposal (what rejection sampling needs)."""
        if self.q_draft is not None:
            return self.q_draft
        return torch.nn.functional.one_hot(self.tokens, vocab_size).float()      # (K, V)


class Drafter(ABC):
    name: str = "drafter"

    def check_target(self, target) -> None:
        """Raise ValueError, saying what to do, when this drafter cannot draft for `target`."""

    def start(self, prompt_ids: torch.Tensor) -> None:
        """Get ready for a new sequence whose prompt is `prompt_ids` (T,)."""

    @abstractmethod
    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> Proposal:
        """Up to k draft tokens to follow `tokens` (N,), the committed sequence so far."""

    def rollback(self, n_valid: int) -> None:
        """Forget state beyond the first `n_valid` tokens: the rest were rejected or never committed."""
