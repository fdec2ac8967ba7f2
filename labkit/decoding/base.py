"""What every decoding loop shares: the request, its checks, the seed, EOS and stopping, the result.

A loop (autoregressive, chain, tree, static, compiled) is a `Decoder`: it owns the committed
tokens, the target's cache and the trace, and each `step()` is one target forward that commits one
or more tokens. `run()` steps until EOS, max_new_tokens or the end of the context and returns a
`Generation`: the new tokens and the trace of every step. The batched loops keep the same contract
for B rows at once (`batched.BatchDecoder`: one Generation per row).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..core.sampling import SamplingConfig
from ..core.trace import Step, Trace
from ..drafters.base import Drafter


@dataclass
class Generation:
    tokens: list[int]    # the new token ids (the prompt excluded)
    trace: Trace


def check_request(model, prompt_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Validate a decode request up front, with errors that say what to do; returns a 1-D cpu tensor."""
    if isinstance(prompt_ids, (str, bytes)) or (isinstance(prompt_ids, (list, tuple)) and prompt_ids
                                                 and isinstance(prompt_ids[0], (str, bytes))):
        raise ValueError("prompt_ids must be token ids, not text: encode the text first, e.g. "
                         "labkit.models.loading.encode_prompt(tokenizer, text, chat_template=True)")
    try:
        prompt_ids = torch.as_tensor(prompt_ids)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"prompt_ids must be a 1-D tensor (or list) of token ids, got {type(prompt_ids).__name__} "
                         f"({e})") from None
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


def check_sampling(sampling: SamplingConfig) -> SamplingConfig:
    if not isinstance(sampling, SamplingConfig):
        hint = f": SamplingConfig(**{sampling!r}) makes one of this dict" if isinstance(sampling, dict) else ""
        raise ValueError(f"sampling must be a labkit.core.sampling.SamplingConfig, such as SamplingConfig() for "
                         f"greedy or SamplingConfig(temperature=0.7, top_p=0.9), got {sampling!r}{hint}")
    return sampling


def check_eos(eos_token_ids) -> tuple[int, ...]:
    """The end-of-sequence ids as a tuple; a lone int (a likely slip) or anything but ids is refused."""
    ok = isinstance(eos_token_ids, (list, tuple, set, frozenset)) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos_token_ids)
    if not ok:
        example = f"({eos_token_ids},)" if isinstance(eos_token_ids, int) else "(151645,)"
        raise ValueError(f"eos_token_ids must be a tuple of token ids, such as {example} or a loaded model's "
                         f".eos_token_ids, got {eos_token_ids!r}")
    return tuple(eos_token_ids)


def check_drafter(drafter: Drafter) -> Drafter:
    if not isinstance(drafter, Drafter):
        raise ValueError(f"drafter must be a labkit Drafter, such as labkit.drafters.DraftModelDrafter(draft_model) or "
                         f"PromptLookupDrafter(), got {type(drafter).__name__}; for plain decoding call "
                         "autoregressive_generate")
    return drafter


MAX_SEED = 2**63 - 1


def check_seed(seed: int | None) -> int | None:
    """A seed torch's generators take: None (torch's global generator) or an integer in [0, 2**63)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        raise ValueError(f"seed must be an integer in [0, 2**63) or None, got {seed!r}")
    return seed


def seeded(seed: int | None) -> torch.Generator | None:
    """A generator for sampled decoding: fixed by `seed`, or torch's global one (None)."""
    return None if check_seed(seed) is None else torch.Generator().manual_seed(seed)


def cut(new_tokens: list[int], eos: set[int], max_new_tokens: int | None = None) -> list[int]:
    """The new tokens up to and including the first end-of-sequence token, at most max_new_tokens of them."""
    new_tokens = new_tokens if max_new_tokens is None else new_tokens[:max_new_tokens]
    for i, t in enumerate(new_tokens):
        if t in eos:
            return new_tokens[: i + 1]
    return new_tokens


def finished(new_tokens: list[int], eos: set[int], max_new_tokens: int) -> bool:
    """Whether a sequence with these new tokens is done (EOS emitted or the limit reached)."""
    return len(new_tokens) >= max_new_tokens or any(t in eos for t in new_tokens)


def finished_message(stop_reason: str, n_generated: int) -> str:
    return (f"this decoder has finished ({stop_reason}, {n_generated} new tokens): its run() returns them; for more "
            "tokens start a new decoder with a larger max_new_tokens, or on the prompt plus these tokens")


class Decoder:
    """One sequence being decoded: committed tokens, the target's cache, a trace, and stepping to the end.

    A subclass sets up `prompt`, `tokens`, `cache`, `trace`, `eos` and `max_new_tokens` in its
    constructor (`begin` does the shared part) and implements `_advance()`, which ends with `_record`.
    """
    prompt: torch.Tensor
    tokens: list[int]
    trace: Trace

    def begin(self, target, prompt_ids: torch.Tensor, max_new_tokens: int, method: str,
              eos_token_ids: tuple[int, ...], seed: int | None, sampling: SamplingConfig) -> None:
        """Check the request and set up what every loop keeps."""
        self.prompt = check_request(target, prompt_ids, max_new_tokens)
        self.sampling = check_sampling(sampling)
        self.max_new_tokens, self.eos, self.generator = max_new_tokens, set(check_eos(eos_token_ids)), seeded(seed)
        self.trace = Trace(method=method, prompt_len=self.prompt.numel())
        self.tokens = self.prompt.tolist()                  # committed: prompt + generated

    @property
    def done(self) -> bool:
        return self.trace.stop_reason != ""

    def step(self) -> Step:
        """One target forward that commits one or more tokens; a decoder that has finished refuses."""
        if self.done:
            raise RuntimeError(finished_message(self.trace.stop_reason, self.trace.n_generated))
        return self._advance()

    def _advance(self) -> Step:
        raise NotImplementedError

    def run(self) -> Generation:
        """Step until EOS, max_new_tokens or the end of the context."""
        while not self.done:
            self.step()
        return Generation(self.tokens[self.prompt.numel():], self.trace)

    def _commit(self, new_tokens: list[int]) -> list[int]:
        """Append a step's new tokens, cut after EOS; returns what was appended."""
        new_tokens = cut(new_tokens, self.eos)
        self.tokens += new_tokens
        return new_tokens

    def _commit_each(self, tokens: list[int], step_of, learn=None) -> Step:
        """Commit tokens decoded without drafting and read at once (a run of plain steps), one Step each
        (`step_of(i, token)`), told to `learn` (a policy's update), up to EOS or the end; the cache keeps every
        committed token but the last. Returns the last Step."""
        for i, token in enumerate(tokens):
            new_tokens = self._commit([token])
            self.cache.length = len(self.tokens) - 1
            step = step_of(i, token)
            if learn is not None:
                learn(step)
            self._record(step, new_tokens)
            if self.done:
                break
        return step

    def _record(self, step: Step, new_tokens: list[int], t0: float | None = None) -> Step:
        """Log a step, its committed tokens already appended, and decide whether to stop; from t0, time it."""
        trace = self.trace
        trace.steps.append(step)
        trace.n_generated = len(self.tokens) - self.prompt.numel()
        trace.stop_reason = self._stop_reason(new_tokens)
        if t0 is not None:
            trace.total_time += time.perf_counter() - t0
        return step

    def _stop_reason(self, new_tokens: list[int]) -> str:
        if any(t in self.eos for t in new_tokens):
            return "eos"
        if self.trace.n_generated >= self.max_new_tokens:
            return "max_new_tokens"
        if self.cache.room() < 1:
            return "context"
        return ""
