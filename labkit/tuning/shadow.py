"""Shadow proposals: learn what drafting would commit from plain steps, without verifying a draft.

A cost-aware policy that judges drafting not to pay takes plain steps (γ = 0, budget 0): the target
commits its one token and no draft is verified. It must still notice when drafting would pay again,
and finding out by verifying a probe costs a verify wider than a plain step's, on every probe. A shadow
costs only the drafter's own work. On a plain step the drafter proposes as usual; the proposal is not
verified, and the tokens the following
steps commit say which of its nodes the target would have kept. Under greedy decoding that is exact:
the target keeps a node when the node's token is the target's pick after the node's ancestors, and the
committed tokens are those picks. (Under sampling a node counts as kept when its token is the one the
target drew: for a draft that proposes one token with certainty the rule keeps it with probability
p_target(token), the chance of that draw, so the estimate is right on average.)

A shadow's path grows as plain steps commit tokens, one a step: the policies read it as it grows (what
it has matched so far is a lower bound on what it would have committed), so a drafter that starts to
guess right is trusted after one or two matched tokens, not after the whole run it guessed.
The shadow never touches the committed tokens or the caches: decoding stays exactly what it was.

`Shadowed(policy, drafter)` makes them: a policy wrapper (γ or tree budget) that, on the plain steps its policy
chooses, has the drafter propose unverified and follows each proposal along the tokens the steps commit. The
loops see only a policy. It runs on the eager loops (the compiled ones draft on the device, which a shadow's
eager proposal would bypass).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..core.sampling import GREEDY
from ..core.trace import Step

# The share of the plain steps' time a cost-aware policy spends on shadows: the most a plain stretch loses to
# them. A drafter that costs next to nothing (prompt lookup, suffix decoding) shadows every plain step; a dearer
# one (Medusa's heads) only every so often.
SHADOW_SHARE = 0.01


def check_share(share: float) -> float:
    """The share of the plain steps' time a policy may spend on shadow proposals, in [0, 1)."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
        raise ValueError(f"shadow_share is a share of the plain steps' time in [0, 1) (0.01: 1%; 0: no shadows), "
                         f"got {share!r}")
    return float(share)


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


class Shadowed:
    """A cost-aware policy (tuning.gamma.CostAwareGamma or tuning.tree_budget.CostAwareBudget) whose plain steps
    have `drafter` propose unverified, as much as the policy asks (its shadow_size), each proposal then judged by
    the tokens the next steps commit. Every other question goes to the policy; each plain step's Step.shadow
    says how many nodes its shadow had."""
    eager_only = True                        # loops.why_not_compiled keeps it off the compiled loops

    def __init__(self, policy, drafter):
        for hook in ("shadow_size", "add_shadow", "shadow_grew", "expect_shadows"):
            if not callable(getattr(policy, hook, None)):
                raise ValueError(f"Shadowed wraps a policy that sizes and learns from shadows (CostAwareGamma, "
                                 f"CostAwareBudget); {type(policy).__name__} has no {hook}(): pass it to the loop "
                                 "as it is")
        self.policy, self.drafter, self.name = policy, drafter, policy.name
        policy.expect_shadows()
        self.tokens: list[int] | None = None
        self.pending: list[Shadow] = []      # proposals the committed tokens still judge
        self.made = 0                        # nodes of this step's shadow

    def __getattr__(self, name):             # the policy's own estimates and settings (reports, tests)
        if name == "policy":
            raise AttributeError(name)
        return getattr(self.policy, name)

    def start(self, prompt_ids) -> None:
        self.tokens, self.pending, self.made = torch.as_tensor(prompt_ids).tolist(), [], 0
        self.policy.start(prompt_ids)

    def gamma(self) -> int:
        return self._shadow_if_plain(self.policy.gamma())

    def budget(self) -> int:
        return self._shadow_if_plain(self.policy.budget())

    def _shadow_if_plain(self, n: int) -> int:
        if n == 0:
            self.made = self._shadow()
        return n

    def _shadow(self) -> int:
        """Propose unverified when the policy asks; returns the proposal's nodes."""
        if self.tokens is None:
            raise RuntimeError("Shadowed follows the committed tokens from start(prompt_ids), which the eager loops "
                               "call: decode with labkit.decoding.speculative or .tree")
        n = self.policy.shadow_size()
        if n <= 0:
            return 0
        t0 = time.perf_counter()
        proposal = self.drafter.propose(torch.tensor(self.tokens), n, GREEDY).limit(n)
        shadow = Shadow.of(proposal, len(self.tokens), time.perf_counter() - t0)
        self.policy.add_shadow(shadow)
        if shadow.n_nodes:
            self.pending.append(shadow)
        return shadow.n_nodes

    def update(self, step: Step) -> None:
        """Note the step's shadow on it, follow the pending shadows along the tokens it committed, then let the
        policy learn from the step."""
        step.shadow, self.made = self.made, 0
        self.tokens += step.accepted_tokens + [step.next_token]
        if self.pending:
            self.pending = follow_shadows(self.pending, self.tokens, self.policy)
        self.policy.update(step)

    def plain_steps(self) -> int:
        return self.policy.plain_steps()
