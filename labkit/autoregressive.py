"""The baseline: one target forward per token, with a KV cache (greedy, temperature, top-k, top-p).

Same trace format as the speculative loop (each step proposes nothing and commits one
token), so every comparison reads the two runs the same way.
"""
from __future__ import annotations

import time

import torch

from .sampling import GREEDY, SamplingConfig, next_token
from .speculative import Generation, _seeded, _stop_reason, check_request
from .trace import Step, Trace


@torch.no_grad()
def autoregressive_generate(model, prompt_ids: torch.Tensor, max_new_tokens: int,
                            sampling: SamplingConfig = GREEDY, eos_token_ids: tuple[int, ...] = (),
                            seed: int | None = None) -> Generation:
    """Decode up to max_new_tokens after prompt_ids (T,), one forward per token."""
    prompt = check_request(model, prompt_ids, max_new_tokens)
    generator, eos = _seeded(seed), set(eos_token_ids)
    trace, t_start = Trace(method="autoregressive", prompt_len=prompt.numel()), time.perf_counter()
    cache = model.new_cache()
    logits = model(prompt[None].to(model.device), cache, num_logits=1)[0, -1]      # (V,)
    trace.prefill_time = time.perf_counter() - t_start
    tokens = prompt.tolist()
    while not trace.stop_reason:
        t0 = time.perf_counter()
        token = int(next_token(logits, sampling, generator))
        tokens.append(token)
        trace.n_generated += 1
        trace.stop_reason = _stop_reason([token], eos, trace.n_generated, max_new_tokens, cache)
        if not trace.stop_reason:
            logits = model(torch.tensor([[token]], device=model.device), cache)[0, -1]  # (V,)
        trace.steps.append(Step([], 0, token, True, 0.0, time.perf_counter() - t0))
    trace.total_time = time.perf_counter() - t_start
    return Generation(tokens[prompt.numel():], trace)
