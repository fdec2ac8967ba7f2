"""The speculative decoding loop: propose -> verify -> accept -> commit.

Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", and
Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling". The target's cache
always holds every committed token but the last; a step feeds that last token plus the K
draft tokens in one forward, whose K+1 outputs score each draft token and give one more.
Batch size 1: each sequence accepts a different number of tokens per step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .acceptance import greedy_accept, speculative_accept
from .adaptive import FixedGamma, GammaPolicy
from .drafters.base import Drafter, Proposal
from .sampling import GREEDY, SamplingConfig, probs_from_logits
from .trace import Step, Trace


@dataclass
class Generation:
    tokens: list[int]    # the new token ids (the prompt excluded)
    trace: Trace


def check_request(model, prompt_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Validate a decode request up front, with errors that say what to do; returns a 1-D cpu tensor."""
    prompt_ids = torch.as_tensor(prompt_ids)
    if prompt_ids.dtype.is_floating_point or prompt_ids.dtype.is_complex or prompt_ids.dtype == torch.bool:
        raise ValueError(f"prompt token ids must be integers, got a {prompt_ids.dtype} tensor: pass the "
                         "tokenizer's input_ids (torch.long)")
    prompt_ids = prompt_ids.long().cpu()
    if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
        prompt_ids = prompt_ids[0]
    if prompt_ids.dim() != 1:
        raise ValueError(f"batch size must be 1: pass one prompt as a 1-D tensor of token ids, got shape "
                         f"{tuple(prompt_ids.shape)}")
    if prompt_ids.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token (or a non-empty prompt text)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if prompt_ids.numel() >= model.max_seq_len:
        raise ValueError(f"the prompt has {prompt_ids.numel()} tokens but the model's context holds "
                         f"{model.max_seq_len}: shorten the prompt or load the model with a larger max_seq_len")
    if int(prompt_ids.max()) >= model.vocab_size or int(prompt_ids.min()) < 0:
        raise ValueError(f"prompt token ids must lie in [0, {model.vocab_size}): was it tokenized for another model?")
    return prompt_ids


def _seeded(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(seed)


class StepDecoder:
    """What the chain and tree loops share: committed tokens, a cache, a trace, and stepping to the end."""
    prompt: torch.Tensor
    tokens: list[int]
    trace: Trace

    @property
    def done(self) -> bool:
        return self.trace.stop_reason != ""

    def run(self) -> Generation:
        """Step until EOS, max_new_tokens or the end of the context."""
        while not self.done:
            self.step()
        return Generation(self.tokens[self.prompt.numel():], self.trace)

    def _record(self, step: Step, new_tokens: list[int], t0: float) -> Step:
        """Log a finished step, its committed tokens already appended, and decide whether to stop."""
        trace = self.trace
        trace.steps.append(step)
        trace.n_generated = len(self.tokens) - self.prompt.numel()
        trace.stop_reason = _stop_reason(new_tokens, self.eos, trace.n_generated, self.max_new_tokens, self.cache)
        trace.total_time += time.perf_counter() - t0
        return step


class SpeculativeDecoder(StepDecoder):
    """One sequence decoded speculatively; each `step()` is one target forward.

    Holds what the loop needs between steps (the committed tokens, the target's cache, the
    trace) so a notebook can step through it and look at both caches after each step.
    """

    def __init__(self, target, drafter: Drafter, prompt_ids: torch.Tensor, max_new_tokens: int,
                 gamma: int | GammaPolicy = 5, sampling: SamplingConfig = GREEDY,
                 eos_token_ids: tuple[int, ...] = (), seed: int | None = None):
        self.prompt = check_request(target, prompt_ids, max_new_tokens)
        drafter.check_target(target)
        self.target, self.drafter, self.max_new_tokens, self.sampling = target, drafter, max_new_tokens, sampling
        self.policy = gamma if isinstance(gamma, GammaPolicy) else FixedGamma(gamma)
        self.generator, self.eos = _seeded(seed), set(eos_token_ids)
        self.trace = Trace(method=f"speculative/{drafter.name}", prompt_len=self.prompt.numel())
        self.tokens = self.prompt.tolist()                  # committed: prompt + generated
        t0 = time.perf_counter()
        with torch.no_grad():
            self.cache = target.new_cache()                 # holds every committed token but the last
            if len(self.tokens) > 1:
                target(self.prompt[None, :-1].to(target.device), self.cache, num_logits=1)
            drafter.start(self.prompt)
        self.trace.prefill_time = self.trace.total_time = time.perf_counter() - t0

    @torch.no_grad()
    def step(self) -> Step:
        """propose -> verify -> accept -> commit, once."""
        n_before, trace = len(self.tokens), self.trace
        k = min(self.policy.gamma(), self.max_new_tokens - trace.n_generated - 1, self.cache.room() - 1)
        # 1. Propose: the drafter's guess at the next k tokens
        t0 = time.perf_counter()
        proposal = self.drafter.propose(torch.tensor(self.tokens), k, self.sampling, self.generator) \
            if k > 0 else Proposal(self.prompt[:0])
        draft = proposal.tokens[:k]                                                        # (K,)
        # 2. Verify: one target forward over [last committed token, draft...]
        t1 = time.perf_counter()
        feed = torch.tensor([self.tokens[-1]] + draft.tolist(), device=self.target.device)[None]  # (1, K+1)
        logits = self.target(feed, self.cache)[0].cpu()                                    # (K+1, V)
        t2 = time.perf_counter()
        # 3. Accept: the longest prefix the target agrees with, plus one token of the target's
        if self.sampling.greedy:
            p_target = logits.softmax(-1)                                                  # (K+1, V), for the trace
            acc = greedy_accept(draft, logits)
        else:
            p_target = probs_from_logits(logits, self.sampling)                            # (K+1, V)
            q_draft = proposal.q_or_one_hot(logits.shape[-1])[:k]                          # (K, V)
            acc = speculative_accept(draft, q_draft, p_target, self.generator)
        # 4. Commit: extend the sequence; roll both caches back to the accepted prefix
        self.cache.truncate(n_before + acc.n_accepted)
        self.drafter.rollback(n_before + acc.n_accepted)
        new_tokens = _until_eos(acc.tokens(draft), self.eos)
        self.tokens += new_tokens
        step = Step(draft.tolist(), acc.n_accepted, acc.next_token, acc.bonus, t1 - t0, t2 - t1,
                    p_target[torch.arange(draft.numel()), draft].tolist(), proposal.q_token[:k].tolist())
        self.policy.update(step)
        return self._record(step, new_tokens, t0)


def speculative_generate(target, drafter: Drafter, prompt_ids: torch.Tensor, max_new_tokens: int,
                         gamma: int | GammaPolicy = 5, sampling: SamplingConfig = GREEDY,
                         eos_token_ids: tuple[int, ...] = (), seed: int | None = None) -> Generation:
    """Decode up to max_new_tokens after prompt_ids (T,) with `drafter` proposing and `target` deciding."""
    return SpeculativeDecoder(target, drafter, prompt_ids, max_new_tokens, gamma, sampling, eos_token_ids, seed).run()


def _until_eos(new_tokens: list[int], eos: set[int]) -> list[int]:
    """The new tokens up to and including the first end-of-sequence token."""
    for i, t in enumerate(new_tokens):
        if t in eos:
            return new_tokens[: i + 1]
    return new_tokens


def _stop_reason(new_tokens: list[int], eos: set[int], n_generated: int, max_new_tokens: int, cache) -> str:
    if any(t in eos for t in new_tokens):
        return "eos"
    if n_generated >= max_new_tokens:
        return "max_new_tokens"
    if cache.room() < 1:
        return "context"
    return ""
