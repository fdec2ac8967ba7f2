"""Jacobi decoding of one block (Santilli et al. 2023), the fixed-point iteration lookahead decoding builds on.

Guess all n next tokens at once, then let one target pass over the prompt and the guess replace
every position by the target's greedy token after the guesses before it. After pass i at least the
first i tokens are right, so at most n passes reach the fixed point, which is the greedy
continuation. It is rarely faster than plain decoding on its own (a wrong early guess spoils every
later one); lookahead decoding (labkit.drafters.lookahead) keeps the n-grams these passes
produce and verifies them as drafts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..core.trace import Step, Trace
from .base import Generation


@dataclass
class JacobiGeneration(Generation):
    rows: torch.Tensor | None = None     # (passes+1, n): the guess before each pass, and the last pass's output


@torch.no_grad()
def jacobi_decode(target, prompt_ids: torch.Tensor, n: int, max_iterations: int | None = None,
                  seed: int = 0) -> JacobiGeneration:
    """One block of n tokens by Jacobi iteration: its tokens, one trace step per target pass, and every guess.

    Row 0 of `rows` is a random guess (tokens of the prompt); each next row is one target pass. A step's
    proposed tokens are the guess it judged, n_accepted the leading guesses the pass confirmed. The passes
    stop at the fixed point (stop_reason "converged") or after max_iterations ("max_iterations").
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (tokens in the Jacobi block) must be an integer >= 1, got {n!r}")
    context = prompt_ids.flatten().cpu()                                        # (T,)
    if context.numel() + n > target.max_seq_len:
        raise ValueError(f"a prompt of {context.numel()} tokens and a block of {n} exceed the target's context of "
                         f"{target.max_seq_len}: shorten one of them")
    gen = torch.Generator().manual_seed(seed)
    guess = context[torch.randint(context.numel(), (n,), generator=gen)]        # (n,)
    rows, trace = [guess], Trace(method="jacobi", prompt_len=context.numel(), stop_reason="max_iterations")
    for _ in range(n if max_iterations is None else max_iterations):
        t0 = time.perf_counter()
        sequence = torch.cat([context, guess[:-1]])[None].to(target.device)     # (1, T+n-1)
        logits = target(sequence, target.new_cache(max_len=sequence.shape[1]))  # (1, T+n-1, V)
        new = logits[0, context.numel() - 1:].argmax(-1).cpu()                  # (n,)
        kept = int((new != guess).int().argmax()) if not torch.equal(new, guess) else n
        trace.steps.append(Step(guess.tolist(), kept, int(new[min(kept, n - 1)]), kept == n, 0.0,
                                time.perf_counter() - t0))
        trace.total_time += trace.steps[-1].verify_time
        rows.append(new)
        if kept == n:
            trace.stop_reason = "converged"
            break
        guess = new
    trace.n_generated = n
    return JacobiGeneration(rows[-1].tolist(), trace, torch.stack(rows))
