"""Shadow proposals: learn what drafting would commit from plain steps, without verifying a draft.

A cost-aware policy that judges drafting not to pay takes plain steps (γ = 0, budget 0): the target
commits its one token and no draft is verified. It must still notice when drafting would pay again,
and finding out by verifying a probe costs: on a 2-core CPU a 5-token verify is 1.3-1.5 plain steps, so
three probes in a 30-token answer lose 1.7-1.9 steps. A shadow costs only the drafter's own work. On a
plain step the drafter proposes as usual; the proposal is not verified, and the tokens the following
steps commit say which of its nodes the target would have kept. Under greedy decoding that is exact:
the target keeps a node when the node's token is the target's pick after the node's ancestors, and the
committed tokens are those picks. (Under sampling a node counts as kept when its token is the one the
target drew: for a draft that proposes one token with certainty the rule keeps it with probability
p_target(token), the chance of that draw, so the estimate is right on average.)

A shadow's path grows as plain steps commit tokens, one a step: the policies read it as it grows (what
it has matched so far is a lower bound on what it would have committed), so a drafter that starts to
guess right is trusted after one or two matched tokens, not after the whole run it guessed.
The shadow never touches the committed tokens or the caches: decoding stays exactly what it was.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# The share of the plain steps' time a cost-aware policy spends on shadows: the most a plain stretch loses to
# them. A drafter that costs under 1% of a step (prompt lookup, suffix decoding) shadows every plain step;
# Medusa's heads, a fifth of a plain step on a 2-core CPU, about one in twenty.
SHADOW_SHARE = 0.01


@dataclass
class Shadow:
    """One unverified proposal and the part of it the committed tokens have confirmed so far."""
    start: int                   # tokens committed when it was proposed: a node at depth d guesses token start+d-1
    tokens: list[int]            # (N,) each node's token
    parents: list[int]           # (N,) each node's parent, -1 under the root (a chain: i - 1)
    seconds: float = 0.0         # what proposing it cost
    path: list[int] = field(default_factory=list)    # the nodes the target kept so far, root to leaf
    settled: bool = False        # a committed token missed every child, or a leaf was reached: the path is final

    @classmethod
    def of(cls, proposal, start: int, seconds: float) -> "Shadow":
        """A drafter's `Proposal`, made when `start` tokens were committed."""
        parents = proposal.as_tree().parents.tolist()
        return cls(start, proposal.tokens.tolist(), parents, seconds, settled=not parents)

    @property
    def n_nodes(self) -> int:
        return len(self.tokens)

    @property
    def reached_leaf(self) -> bool:
        """Every node along the path was kept down to a leaf (a chain: all its tokens, as a bonus step)."""
        return bool(self.path) and self.path[-1] not in self.parents

    def follow(self, committed: list[int]) -> int:
        """Extend the path along the tokens committed after the proposal (`committed`: every committed token,
        the prompt included); returns how many nodes it gained."""
        gained = 0
        while not self.settled and self.start + len(self.path) < len(committed):
            token = committed[self.start + len(self.path)]
            parent = self.path[-1] if self.path else -1
            child = next((i for i, (t, p) in enumerate(zip(self.tokens, self.parents)) if p == parent and t == token),
                         None)
            if child is None:
                self.settled = True
            else:
                self.path.append(child)
                gained += 1
                self.settled = self.reached_leaf
        return gained


def follow_shadows(shadows: list[Shadow], committed: list[int], policy) -> list[Shadow]:
    """Tell `policy` what each pending shadow gained from the tokens committed so far; returns the unsettled."""
    for shadow in shadows:
        gained = shadow.follow(committed)
        if gained or shadow.settled:
            policy.shadow_grew(shadow, gained)
    return [s for s in shadows if not s.settled]
