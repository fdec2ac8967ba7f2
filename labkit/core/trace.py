"""The trace of a run: what every step proposed, kept and cost. Plots and tables read this."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .engine_counts import DraftCounts, count_drafts


@dataclass
class Step:
    """One target forward: the draft it verified and what it committed.

    p_target / q_draft are each proposed token's probability under the target and the draft:
    the sampling distributions when sampling, the plain softmax (temperature 1) when greedy.
    """
    proposed: list[int]          # draft tokens, K of them (empty for an autoregressive step)
    n_accepted: int              # leading draft tokens the target kept
    next_token: int              # correction or bonus token from the target
    bonus: bool                  # all K accepted (the next token is the bonus token)
    draft_time: float            # seconds spent proposing
    verify_time: float           # seconds of the target forward
    p_target: list[float] = field(default_factory=list)
    q_draft: list[float] = field(default_factory=list)
    parents: list[int] | None = None   # tree steps: the proposal's parent vector (proposed = its node tokens)
    path: list[int] | None = None      # tree steps: the accepted nodes, root to leaf
    asked: int | None = None           # the draft length / tree budget asked for (0: a plain step by choice)
    shadow: int = 0                    # a plain step: nodes the drafter proposed unverified (tuning/shadow.py)

    @property
    def plain_by_choice(self) -> bool:
        """A step that drafted nothing because the γ or budget policy judged drafting would not pay."""
        return self.asked == 0

    @property
    def accepted_tokens(self) -> list[int]:
        """The draft tokens the target kept, in order (a tree step: its accepted path)."""
        if self.path is not None:
            return [self.proposed[i] for i in self.path]
        return self.proposed[: self.n_accepted]

    @property
    def rejected_tokens(self) -> list[int]:
        """The draft tokens shown as rejected: a chain's tail, or a tree's first-ranked line past the path."""
        if self.parents is None:
            return self.proposed[self.n_accepted:]
        out, node = [], self.path[-1] if self.path else -1
        while node in self.parents:
            node = self.parents.index(node)        # the first (best-ranked) child
            out.append(self.proposed[node])
        return out

    @property
    def gamma(self) -> int:
        return len(self.proposed)

    @property
    def n_committed(self) -> int:
        return self.n_accepted + 1

    @property
    def n_judged(self) -> int:
        """Draft tokens the target judged: up to and including the first rejection (the rest were never looked at)."""
        return min(self.gamma, self.n_accepted + 1)


@dataclass
class Trace:
    method: str
    prompt_len: int
    steps: list[Step] = field(default_factory=list)
    prefill_time: float = 0.0
    total_time: float = 0.0
    draft_prefill_time: float = 0.0  # of prefill_time: the drafter reading the prompt (Drafter.start)
    stop_reason: str = ""        # "max_new_tokens", "eos" or "context"
    n_generated: int = 0         # tokens returned (a step past EOS or the limit is cut)

    @property
    def n_target_forwards(self) -> int:
        """Decode-time target forwards (verify passes), prefill not counted."""
        return len(self.steps)

    @property
    def tokens_per_forward(self) -> float:
        """Mean tokens committed per target forward, the bonus/correction token included."""
        return self.n_generated / max(1, self.n_target_forwards)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens (nan for a run that drafted nothing)."""
        proposed = sum(s.gamma for s in self.steps)
        return sum(s.n_accepted for s in self.steps) / proposed if proposed else float("nan")

    @property
    def draft_counts(self) -> DraftCounts:
        """The serving engines' acceptance counters over this run (core/engine_counts.py)."""
        return count_drafts([(s.gamma, s.n_accepted) for s in self.steps],
                            tree=any(s.parents is not None for s in self.steps))

    @property
    def draft_time(self) -> float:
        return sum(s.draft_time for s in self.steps)

    @property
    def verify_time(self) -> float:
        return sum(s.verify_time for s in self.steps)

    @property
    def tokens_per_second(self) -> float:
        return self.n_generated / self.total_time if self.total_time else float("nan")

    def summary(self) -> dict:
        counts = self.draft_counts
        return {"method": self.method, "new_tokens": self.n_generated, "target_forwards": self.n_target_forwards,
                "tokens_per_forward": self.tokens_per_forward, "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": counts.mean_acceptance_length,
                "acceptance_per_position": counts.as_dict()["acceptance_per_position"],
                "tokens_per_second": self.tokens_per_second, "total_time": self.total_time,
                "prefill_time": self.prefill_time, "draft_time": self.draft_time,
                "verify_time": self.verify_time, "stop_reason": self.stop_reason,
                "plain_steps": sum(s.plain_by_choice for s in self.steps)}

    def to_dict(self) -> dict:
        return {**self.summary(), "prompt_len": self.prompt_len, "steps": [asdict(s) for s in self.steps]}


@dataclass(frozen=True)
class CacheLengths:
    """One cache's length around a step: what the rollback plot and the stepper show."""
    before: int    # valid slots when the step began
    peak: int      # after the step's forwards wrote their tokens, just before the rollback
    after: int     # after the rollback to the accepted prefix

    @property
    def dropped(self) -> int:
        return self.peak - self.after
