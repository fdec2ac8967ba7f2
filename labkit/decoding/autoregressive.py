"""The baseline: one target forward per token, with a KV cache (greedy, temperature, top-k, top-p).

Same trace format as the speculative loops (each step proposes nothing and commits one
token), so every comparison reads the two runs the same way.
"""
from __future__ import annotations

import time

import torch

from ..core.sampling import GREEDY, SamplingConfig, next_token
from ..core.trace import Step
from ..models.target import Target
from .base import Decoder, Generation


class AutoregressiveDecoder(Decoder):
    """One sequence, one token per `step()`: sample from the last logits, then feed that token."""

    def __init__(self, target: Target, prompt_ids: torch.Tensor, max_new_tokens: int,
                 sampling: SamplingConfig = GREEDY, eos_token_ids: tuple[int, ...] = (), seed: int | None = None):
        self.begin(target, prompt_ids, max_new_tokens, "autoregressive", eos_token_ids, seed, sampling)
        self.target = target
        t0 = time.perf_counter()
        with torch.no_grad():
            self.cache = target.new_cache()                  # holds every committed token
            self.logits = target(self.prompt[None].to(target.device), self.cache, num_logits=1)[0, -1]  # (V,)
        self.trace.prefill_time = self.trace.total_time = time.perf_counter() - t0

    @torch.no_grad()
    def _advance(self) -> Step:
        """sample -> commit -> feed, once."""
        t0 = time.perf_counter()
        token = int(next_token(self.logits, self.sampling, self.generator))
        new_tokens = self._commit([token])
        step = self._record(Step([], 0, token, True, 0.0, 0.0), new_tokens)   # stops before a forward it won't use
        if not self.done:
            self.logits = self.target(torch.tensor([[token]], device=self.target.device), self.cache)[0, -1]  # (V,)
        step.verify_time = time.perf_counter() - t0
        self.trace.total_time += step.verify_time
        return step


def autoregressive_generate(model: Target, prompt_ids: torch.Tensor, max_new_tokens: int,
                            sampling: SamplingConfig = GREEDY, eos_token_ids: tuple[int, ...] = (),
                            seed: int | None = None) -> Generation:
    """Decode up to max_new_tokens after prompt_ids (T,), one forward per token."""
    return AutoregressiveDecoder(model, prompt_ids, max_new_tokens, sampling, eos_token_ids, seed).run()
