"""How much of the prompt a draft model reads: the whole context where reading it pays, a window where not.

A draft that reads the whole prompt guesses better on long prompts (it can copy from them), but
reading a long prompt costs a draft prefill the target's decoding must earn back. What it earns
grows with the answer's length: every drafted token is a little likelier to be right, so the saving is
a share of a target step per new token (measured on the lab's long-prompt questions by
scripts/draft_window.py; docs/benchmark.md). What it costs is the draft's seconds per prompt token, which
the CPU's kernels decide (a prefill is many rows at once, where AMX tiles and plain AVX2 differ most;
docs/forward-paths.md).

`AutoWindow` measures both sides of that trade on this machine once (the draft reading 256 tokens,
the target's one-token step after 256 cached ones) and, per prompt, lets the draft read everything
when the extra reading costs at most `SAVING` target steps per token it may generate:

    (prompt tokens - window - sinks) x draft seconds per token  <=  SAVING x max new tokens x target step

and the window otherwise. SAVING is below the measured saving, since answers often end before
max_new_tokens (the bound the rule uses) and a short answer earns back less. Nor can reading save more
than drafting saves at all: where the draft's own step is dear against the target's, or the verify cost
grows fast with its width, even a draft that copies from the prompt (COPY_ALPHA of its tokens accepted)
saves only a small share of a step per token, and the rule uses that smaller saving (`most_saving`), from
the draft's step time and the verify curve.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.adaptive import VerifyCurve, expected_speedup
from .reading import DraftWrapper

SAVING = 0.3           # target steps a whole-context draft is taken to save per new token (measured: 0.45)
# The window a draft falls back to where reading the whole prompt does not pay (a draft model not wrapped in
# Windowed reads the whole context): read off the acceptance and speed against the window on long prompts,
# measured by scripts/draft_window.py (data/bench/draft_window*.md).
DEFAULT_WINDOW = 64
# The acceptance rate of a draft that reads the whole prompt where it copies from it: the most saving `most_saving`
# credits a whole-context read with (the 4-bit pair accepts 0.94-0.96 of its tokens on rag at γ = 4,
# data/bench/int4_target_amd-epyc-avx2 and its cost-aware rerun).
COPY_ALPHA = 0.9


@dataclass(frozen=True)
class WindowCosts:
    """This machine's prices: the draft's seconds per prompt token it reads, the target's one-token step, and the
    draft's own one-token step (None: not measured, and then reading is not weighed against it)."""
    draft_seconds_per_token: float
    target_step_seconds: float
    draft_step_seconds: float | None = None

    @classmethod
    def measure(cls, target, draft, context: int = 256, repeats: int = 2) -> "WindowCosts":
        """Time the draft reading `context` tokens, then its one-token step, and the target's one-token step after
        as many (best of `repeats`, after one warm-up each): about a second for the 1.5B/0.5B pair on a CPU."""
        context = min(context, target.max_seq_len - 1, draft.max_seq_len - 1)   # a small model's shorter context
        ids = torch.randint(0, min(target.vocab_size, draft.vocab_size), (1, context + 1))
        read, draft_step, step = [], [], []
        with torch.no_grad():
            for _ in range(repeats + 1):
                cache = draft.new_cache()
                t0 = time.perf_counter()
                draft(ids[:, :context].to(draft.device), cache, num_logits=1)
                read.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                draft(ids[:, context:].to(draft.device), cache)
                draft_step.append(time.perf_counter() - t0)
                cache = target.new_cache()
                target(ids[:, :context].to(target.device), cache, num_logits=1)
                t0 = time.perf_counter()
                target(ids[:, context:].to(target.device), cache)
                step.append(time.perf_counter() - t0)
        return cls(min(read[1:]) / context, min(step[1:]), min(draft_step[1:]))


@dataclass(frozen=True)
class AutoWindow:
    """Per prompt: None (the draft reads the whole context) where reading it pays, `window` tokens otherwise.

    costs: this machine's prices, or a function that measures them (`WindowCosts.measure`), called once when
    a prompt first outgrows the window and sinks: a prompt they hold whole is read whole, with nothing to weigh."""
    costs: WindowCosts | Callable[[], WindowCosts]
    new_tokens: int                  # the most tokens the answer may have (max_new_tokens)
    window: int = DEFAULT_WINDOW
    sinks: int = 4
    saving: float = SAVING
    verify_curve: dict[int, float] | None = None   # this machine's t(tokens)/t(1) for the target (None: flat)

    def __post_init__(self):
        if isinstance(self.new_tokens, bool) or not isinstance(self.new_tokens, int) or self.new_tokens < 1:
            raise ValueError(f"new_tokens must be an integer >= 1 (the answer's most tokens), got {self.new_tokens!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an integer >= 1, got {self.window!r}")

    @property
    def prices(self) -> WindowCosts:
        """The costs, measured now where they were given as a function (once: the result replaces it)."""
        if callable(self.costs):
            object.__setattr__(self, "costs", self.costs())
        return self.costs

    def extra_read_seconds(self, prompt_tokens: int) -> float:
        """What reading the whole prompt costs the draft beyond reading its sinks and window."""
        return max(0, prompt_tokens - self.window - self.sinks) * self.prices.draft_seconds_per_token

    def most_saving(self) -> float:
        """Target steps per new token that drafting saves at its best length were COPY_ALPHA of the draft accepted,
        on this machine's draft step and verify curve: 1 - 1 / Leviathan's speedup (`saving` where the draft's
        step was not measured)."""
        if self.prices.draft_step_seconds is None:
            return self.saving
        c, curve = self.prices.draft_step_seconds / self.prices.target_step_seconds, VerifyCurve(self.verify_curve)
        best = max(expected_speedup(COPY_ALPHA, g, c, curve(g + 1)) for g in range(1, 17))
        return max(0.0, 1 - 1 / best)

    def saving_per_token(self) -> float:
        """The target steps a whole-context draft is taken to save per new token: SAVING, or less where drafting
        cannot save that much on this machine."""
        return min(self.saving, self.most_saving())

    def budget_seconds(self) -> float:
        """What a whole-context draft is expected to save over the answer."""
        return self.saving_per_token() * self.new_tokens * self.prices.target_step_seconds

    def choose(self, prompt_tokens: int) -> int | None:
        """The window for a prompt of this many tokens (None: the whole context)."""
        if prompt_tokens <= self.window + self.sinks:
            return None                                   # the window holds it all: the same read either way
        return None if self.extra_read_seconds(prompt_tokens) <= self.budget_seconds() else self.window

    def longest_whole_prompt(self) -> int:
        """The longest prompt whose whole context the draft reads on this machine."""
        return int(self.budget_seconds() / max(1e-12, self.prices.draft_seconds_per_token)) + self.window + self.sinks

    def describe(self) -> str:
        return (f"the draft model reads the whole context of prompts up to {self.longest_whole_prompt()} tokens "
                f"(reading costs it {self.prices.draft_seconds_per_token * 1e3:.2f} ms a token, a target step "
                f"{self.prices.target_step_seconds * 1e3:.1f} ms, and a whole-context draft is taken to save "
                f"{self.saving_per_token():.2g} of a step per new token, up to {self.new_tokens}{self._capped()}), "
                f"and otherwise its first {self.sinks} tokens and its last {self.window}")

    def _capped(self) -> str:
        """Why the saving is below SAVING, where it is."""
        if self.most_saving() >= self.saving:
            return ""
        step_ms = self.prices.draft_step_seconds * 1e3
        return (f"; less than {self.saving:g} because its own step costs {step_ms:.1f} ms: "
                f"drafting saves no more even with {COPY_ALPHA:g} of its tokens accepted")


class Windowed(DraftWrapper):
    """A draft model that reads the context's first `sinks` tokens (attention sinks) and its last `window`, at
    contiguous positions, as StreamingLLM (Xiao et al. 2024) and TriForce (Sun et al. 2024) keep a draft's cache: its
    prefill and each step cost the same whatever the prompt's length. Once the tokens past the sinks reach 2W it
    starts a fresh window of the last W (one draft forward over W tokens, every W committed tokens). The target still
    verifies against the whole context, so the output is exactly the target's; only how often the draft is right can
    change. With an AutoWindow the window is chosen per prompt from this machine's costs (None: the whole context)."""

    def __init__(self, model, window: int | AutoWindow, sinks: int = 4):
        super().__init__(model)
        self.auto = window if isinstance(window, AutoWindow) else None
        if self.auto is not None:
            window, sinks = self.auto.window, self.auto.sinks
        for name, value, least, what in (
                ("window", window, 1, "tokens the draft reads, or an AutoWindow; the whole context: no Windowed"),
                ("sinks", sinks, 0, "the context's first tokens the draft keeps")):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least} ({what}), got {value!r}")
        self.window, self.sinks = window, sinks
        self.skipped = 0            # committed tokens between the sinks and the window that the cache left out

    def prepare(self, prompt_ids: torch.Tensor, cache) -> None:
        """A new sequence: nothing skipped yet; an AutoWindow picks this prompt's window (None: read it all)."""
        self.skipped = 0
        if self.auto is not None:
            self.window = self.auto.choose(prompt_ids.numel())
        self.inner.prepare(prompt_ids, cache)

    def unseen(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        """The committed tokens (n,) the draft has not read yet; a fresh window started when due."""
        held = cache.length + self.skipped                                      # committed tokens accounted for
        if self.window is not None and len(tokens) - min(len(tokens), self.sinks) - self.skipped > 2 * self.window:
            kept = min(cache.length, self.sinks)
            cache.truncate(kept)
            self.skipped = len(tokens) - self.sinks - self.window
            return torch.cat([tokens[kept:self.sinks], tokens[-self.window:]])   # sinks, then the last W
        return tokens[held:]

    def commit(self, cache, n_cached: int) -> None:
        if n_cached - self.skipped < self.sinks and self.skipped:    # rolled back into the skipped stretch: restart
            cache.truncate(min(cache.length, self.sinks, n_cached))
            self.skipped = 0
        cache.truncate(min(cache.length, n_cached - self.skipped))

    def choices(self) -> list[str]:
        said = [] if self.window is None else \
            [f"the draft read at most the first {self.sinks} and the last {self.window} tokens of the context"]
        return self.inner.choices() + said
