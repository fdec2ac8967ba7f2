"""How much of the prompt a draft model reads: the whole context where reading it pays, a window where not.

A draft that reads the whole prompt guesses better on long prompts (it can copy from them), but
reading a long prompt costs a draft prefill the target's decoding must earn back. What it earns
grows with the answer's length: on the lab's long-prompt questions, at a fixed γ = 4 on an Intel
Xeon with AMX, a draft reading the whole context instead of a 64-token window shortened the decode
phase by 0.45 of a target step per new token, pooled over the nine questions (from none on a
6-token answer to 0.92; scripts/draft_window.py, data/bench/draft_window_intel-xeon_avx512-bf16-amx.json).
What it costs is the draft's seconds per prompt token, which the CPU's kernels decide (a prefill is
many rows at once, where AMX tiles and plain AVX2 differ most; docs/forward-paths.md).

`AutoWindow` measures both sides of that trade on this machine once (the draft reading 256 tokens,
the target's one-token step after 256 cached ones) and, per prompt, lets the draft read everything
when the extra reading costs at most `SAVING` target steps per token it may generate:

    (prompt tokens - window - sinks) x draft seconds per token  <=  SAVING x max new tokens x target step

and the window otherwise. SAVING is below the measured saving, since answers often end before
max_new_tokens (the bound the rule uses) and a short answer earns back less.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

SAVING = 0.3           # target steps a whole-context draft is taken to save per new token (measured: 0.45)
# The window a draft falls back to where reading the whole prompt does not pay (a DraftModelDrafter made by hand
# reads the whole context unless given a window): read off the acceptance and speed against the window on long prompts,
# measured by scripts/draft_window.py (data/bench/draft_window*.md).
DEFAULT_WINDOW = 64


@dataclass(frozen=True)
class WindowCosts:
    """This machine's two prices: the draft's seconds per prompt token it reads, the target's one-token step."""
    draft_seconds_per_token: float
    target_step_seconds: float

    @classmethod
    def measure(cls, target, draft, context: int = 256, repeats: int = 2) -> "WindowCosts":
        """Time the draft reading `context` tokens and the target's one-token step after as many (best of
        `repeats`, after one warm-up each): about a second for the 1.5B/0.5B pair on a CPU."""
        context = min(context, target.max_seq_len - 1, draft.max_seq_len)       # a small model's shorter context
        ids = torch.randint(0, min(target.vocab_size, draft.vocab_size), (1, context + 1))
        read, step = [], []
        with torch.no_grad():
            for _ in range(repeats + 1):
                cache = draft.new_cache()
                t0 = time.perf_counter()
                draft(ids[:, :context].to(draft.device), cache, num_logits=1)
                read.append(time.perf_counter() - t0)
                cache = target.new_cache()
                target(ids[:, :context].to(target.device), cache, num_logits=1)
                t0 = time.perf_counter()
                target(ids[:, context:].to(target.device), cache)
                step.append(time.perf_counter() - t0)
        return cls(min(read[1:]) / context, min(step[1:]))


@dataclass(frozen=True)
class AutoWindow:
    """Per prompt: None (the draft reads the whole context) where reading it pays, `window` tokens otherwise."""
    costs: WindowCosts
    new_tokens: int                  # the most tokens the answer may have (max_new_tokens)
    window: int = DEFAULT_WINDOW
    sinks: int = 4
    saving: float = SAVING

    def __post_init__(self):
        if isinstance(self.new_tokens, bool) or not isinstance(self.new_tokens, int) or self.new_tokens < 1:
            raise ValueError(f"new_tokens must be an integer >= 1 (the answer's most tokens), got {self.new_tokens!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an integer >= 1, got {self.window!r}")

    def extra_read_seconds(self, prompt_tokens: int) -> float:
        """What reading the whole prompt costs the draft beyond reading its sinks and window."""
        return max(0, prompt_tokens - self.window - self.sinks) * self.costs.draft_seconds_per_token

    def budget_seconds(self) -> float:
        """What a whole-context draft is expected to save over the answer: SAVING target steps per new token."""
        return self.saving * self.new_tokens * self.costs.target_step_seconds

    def choose(self, prompt_tokens: int) -> int | None:
        """The window for a prompt of this many tokens (None: the whole context)."""
        return None if self.extra_read_seconds(prompt_tokens) <= self.budget_seconds() else self.window

    def longest_whole_prompt(self) -> int:
        """The longest prompt whose whole context the draft reads on this machine."""
        return int(self.budget_seconds() / max(1e-12, self.costs.draft_seconds_per_token)) + self.window + self.sinks

    def describe(self) -> str:
        return (f"the draft model reads the whole context of prompts up to {self.longest_whole_prompt()} tokens "
                f"(reading costs it {self.costs.draft_seconds_per_token * 1e3:.2f} ms a token, a target step "
                f"{self.costs.target_step_seconds * 1e3:.1f} ms, and a whole-context draft is taken to save "
                f"{self.saving:g} of a step per new token, up to {self.new_tokens}), and otherwise its first "
                f"{self.sinks} tokens and its last {self.window}")
