"""Acceptance as the serving engines count it: drafts, draft tokens, accepted tokens, accepted per position.

vLLM keeps four counters (`vllm:spec_decode_num_drafts`, `_num_draft_tokens`, `_num_accepted_tokens` and
`_num_accepted_tokens_per_pos{position=i}`) and reports two numbers from them; SGLang's "accept len" and
llama.cpp's acceptance are the same quantities under other names:

- mean acceptance length = 1 + accepted tokens / drafts: the tokens one drafting step commits, the target's
  bonus or correction token included (EAGLE's τ, labkit's tokens per forward over the steps that drafted);
- per-position acceptance rate i = drafts whose i-th draft token was accepted / drafts. It is unconditional:
  under the i.i.d. model it falls as α^(i+1), where labkit's per-position view (accepted / reached, 04) stays
  at α.

The counts come from a labkit trace, a benchmark record or an engine's metrics (labkit.bench.vllm_metrics),
so a production run and a lab run are read by the same views: the accept-length histogram against the
i.i.d. model, and α and γ for the speedup calculator.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DraftCounts:
    """The engines' four acceptance counters over a run (or the sum of several)."""
    drafts: int                              # steps that verified a draft (plain steps do not count)
    draft_tokens: int                        # tokens proposed over those steps (a tree's: its nodes)
    accepted_tokens: int                     # draft tokens the target kept
    accepted_per_position: tuple[int, ...]   # [i]: drafts whose i-th draft token was kept (non-increasing)

    def __post_init__(self):
        per = self.accepted_per_position
        if min(self.drafts, self.draft_tokens, self.accepted_tokens, *per, 0) < 0:
            raise ValueError(f"acceptance counts cannot be negative: {self}")
        if any(b > a for a, b in zip((self.drafts, *per), per)):
            raise ValueError(f"accepted per position must not rise with the position, nor exceed the drafts: {self}")
        if sum(per) != self.accepted_tokens:
            raise ValueError(f"accepted per position sums to {sum(per)}, not the {self.accepted_tokens} accepted "
                             "tokens")

    @property
    def gamma(self) -> int:
        """Draft positions counted: the longest draft (vLLM: num_speculative_tokens)."""
        return len(self.accepted_per_position)

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted tokens per draft, the bonus or correction token included (nan: nothing drafted)."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else float("nan")

    @property
    def per_position_rate(self) -> np.ndarray:
        """[i]: the share of drafts whose i-th token was accepted (γ values; empty when nothing drafted)."""
        return np.array(self.accepted_per_position, float) / self.drafts if self.drafts else np.zeros(0)

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted over proposed draft tokens (vLLM's "draft acceptance rate"; nan: nothing drafted)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else float("nan")

    @property
    def accept_length_counts(self) -> np.ndarray:
        """counts[n] = drafts that accepted exactly n draft tokens, n = 0..γ (viz.calculator's pooled counts)."""
        reached = np.array((self.drafts, *self.accepted_per_position, 0))                 # (γ + 2,)
        return reached[:-1] - reached[1:]

    @property
    def judged_alpha(self) -> float:
        """α = accepted / judged draft tokens, each draft that stopped short of γ ending in one rejection.

        Exact where every draft had γ tokens (draft_tokens = γ · drafts, vLLM's chains); a shorter draft that was
        accepted whole counts a rejection it did not have, so α reads low by that share.
        """
        rejections = self.drafts - (self.accepted_per_position[-1] if self.gamma else 0)
        judged = self.accepted_tokens + rejections
        return self.accepted_tokens / judged if judged else float("nan")

    def __add__(self, other: DraftCounts) -> DraftCounts:
        n = max(self.gamma, other.gamma)
        pad = lambda p: (*p, *(0,) * (n - len(p)))                                   # noqa: E731
        return DraftCounts(self.drafts + other.drafts, self.draft_tokens + other.draft_tokens,
                           self.accepted_tokens + other.accepted_tokens,
                           tuple(a + b for a, b in zip(pad(self.accepted_per_position),
                                                       pad(other.accepted_per_position))))

    def __sub__(self, earlier: DraftCounts) -> DraftCounts:
        """The counts of the interval between an earlier reading of the same counters and this one."""
        if earlier.gamma > self.gamma:
            raise ValueError(f"the earlier counts have {earlier.gamma} positions, these {self.gamma}: not one server")
        pad = (*earlier.accepted_per_position, *(0,) * (self.gamma - earlier.gamma))
        try:
            return DraftCounts(self.drafts - earlier.drafts, self.draft_tokens - earlier.draft_tokens,
                               self.accepted_tokens - earlier.accepted_tokens,
                               tuple(a - b for a, b in zip(self.accepted_per_position, pad)))
        except ValueError:
            raise ValueError("the earlier counts exceed these: give the earlier reading second, of the same server "
                             "since its start (a restart sets the counters to zero)") from None

    def as_dict(self) -> dict:
        """The counts and the engines' two numbers, for a summary or a report."""
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "mean_acceptance_length": self.mean_acceptance_length,
                "acceptance_per_position": [round(float(r), 4) for r in self.per_position_rate]}


def count_drafts(steps, tree: bool = False) -> DraftCounts:
    """The counters over steps given as (draft tokens, accepted) pairs; steps that drafted nothing are skipped.

    A chain's positions run to its longest draft; a tree's (draft tokens = its nodes) to its deepest accepted path.
    """
    drafted = [(int(k), int(n)) for k, n in steps if k > 0]
    positions = max((n if tree else k for k, n in drafted), default=0)
    per = np.zeros(positions, int)
    for _, n in drafted:
        per[:n] += 1
    return DraftCounts(len(drafted), sum(k for k, _ in drafted), sum(n for _, n in drafted), tuple(int(x) for x in per))
