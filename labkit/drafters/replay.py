"""Replayed acceptance: time speculation on random weights with the acceptance of a recorded run.

A forward's time does not depend on the weights' values, so a GPU without the checkpoints can time
a model of the real shape with random weights. Acceptance does depend on them: a random draft
agrees with a random target about as often as two dice. `ReplayDrafter` puts a recorded run's
acceptance back: it knows the target's own greedy continuation of the prompt (decoded first) and,
for every step, how many draft tokens a real drafter proposed and got accepted on the real pair
(`labkit.bench.runner.load_recorded_steps` reads them from a benchmark's results.jsonl); it
proposes that many tokens of the continuation and then wrong ones, so greedy verification
accepts exactly the recorded count. It costs nothing to draft, like prompt lookup or suffix decoding.

`PacedDrafter` adds a draft model's cost: the draft model drafts as many tokens as the replay
proposes, on every step, and its tokens are thrown away. Both are measuring devices, not
drafters to decode with: every number they produce is "replayed acceptance".
"""
from __future__ import annotations

import torch

from ..core.sampling import SamplingConfig
from .base import Drafter, Proposal
from .draft_model import DraftModelDrafter


class ReplayDrafter(Drafter):
    """Proposes the target's continuation so that step i accepts `recorded[i] = (γ_i, n_i)`: n_i right tokens,
    then γ_i - n_i wrong ones. The recording starts over when it runs out. Greedy only.

    `replayed` lists the (γ, n) each step was set up to accept, to compare with the trace; `diverged` turns True
    when a committed token is not the continuation's (the target decoded something else: the replay is off).
    """
    name = "replay"

    def __init__(self, continuation: list[int], recorded: list[tuple[int, int]], vocab_size: int):
        if not continuation or not all(isinstance(t, int) and 0 <= t < vocab_size for t in continuation):
            raise ValueError(f"continuation must be the target's greedy new token ids, in [0, {vocab_size}): decode "
                             "the prompt first (e.g. StaticDecoder(...).generate(prompt, n).tokens)")
        if not recorded or not all(0 <= n <= g for g, n in recorded):
            raise ValueError("recorded must be a non-empty list of (gamma, n_accepted) with 0 <= n_accepted <= "
                             "gamma: read one with labkit.bench.runner.load_recorded_steps(results.jsonl, method)")
        self.continuation, self.recorded, self.vocab_size = list(continuation), list(recorded), vocab_size
        self.prompt_len, self.replayed, self.diverged = 0, [], False

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        self.prompt_len, self.replayed, self.diverged = prompt_ids.numel(), [], False

    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> Proposal:
        if not sampling.greedy:
            raise ValueError("replayed acceptance is exact for greedy verification only: pass SamplingConfig() "
                             "(greedy)")
        done = tokens.numel() - self.prompt_len                                  # tokens generated so far
        if done and int(tokens[-1]) != self.continuation[min(done, len(self.continuation)) - 1]:
            self.diverged = True
        gamma, n = self.recorded[len(self.replayed) % len(self.recorded)]
        gamma = min(gamma, k)
        n = min(n, gamma, max(0, len(self.continuation) - done))
        self.replayed.append((gamma, n))
        right = self.continuation[done:done + n]
        # any token but the target's next one is rejected; past the continuation's end, one guess
        wrong = (self.continuation[done + n] + 1) % self.vocab_size if done + n < len(self.continuation) else 0
        return Proposal(torch.tensor(right + [wrong] * (gamma - n), dtype=torch.long))     # (γ,)


class PacedDrafter(Drafter):
    """Proposes `tokens_from`'s tokens while `paced_by` (a draft model) drafts as many and is ignored: the
    acceptance of one drafter at the drafting cost of the other."""

    def __init__(self, tokens_from: Drafter, paced_by: DraftModelDrafter):
        if not isinstance(paced_by, DraftModelDrafter):
            raise ValueError(f"paced_by must be a DraftModelDrafter (its draft model sets the cost), got "
                             f"{type(paced_by).__name__}")
        self.tokens_from, self.paced_by = tokens_from, paced_by
        self.name = f"{tokens_from.name}@{paced_by.name}-cost"

    def check_target(self, target) -> None:
        self.tokens_from.check_target(target)
        self.paced_by.check_target(target)

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        self.tokens_from.start(prompt_ids)
        self.paced_by.start(prompt_ids)

    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> Proposal:
        proposal = self.tokens_from.propose(tokens, k, sampling, generator)
        if proposal.k:
            self.paced_by.propose(tokens, proposal.k, sampling, generator)   # the cost, not the tokens
        return proposal

    def commit(self, n_cached: int, features: torch.Tensor | None = None) -> None:
        self.tokens_from.commit(n_cached)
        self.paced_by.commit(n_cached)
