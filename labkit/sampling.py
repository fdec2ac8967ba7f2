"""From logits to the distribution we sample from: temperature, top-k, top-p.

Speculative sampling is exact for whatever distribution the target *samples from*, so the
target's `p_target` and the draft's `q_draft` both go through the same warping here
(as transformers does for assisted generation) before the acceptance rule compares them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0        # 0 means greedy (argmax)
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 (or None for no top-k filter), got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (or None), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingConfig()


def probs_from_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The sampling distribution (..., V) for logits (..., V); one-hot at the argmax when greedy."""
    logits = logits.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / cfg.temperature
    if cfg.top_k is not None and cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[..., -1:]                     # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if cfg.top_p is not None and cfg.top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p                              # mass of strictly better tokens
        sorted_p = sorted_p.masked_fill(mass_before >= cfg.top_p, 0.0)           # keeps at least the top token
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of probs (..., V) -> (...)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def next_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick the next token (...) from logits (..., V): argmax when greedy, else a sample."""
    if cfg.greedy:
        return logits.argmax(-1)
    return sample(probs_from_logits(logits, cfg), generator)
