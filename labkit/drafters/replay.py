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

from ..core.adaptive import GammaPolicy
from ..core.sampling import SamplingConfig
from ..core.tree import Tree
from ..core.tree_budget import FixedBudget
from .base import Drafter, Needs, Proposal


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

    def next_length(self, k: int) -> int:
        """How many tokens (a tree: nodes) the next `propose(..., k, ...)` proposes, known before it builds them."""
        return min(self.recorded[len(self.replayed) % len(self.recorded)][0], k)

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


class ReplayTreeDrafter(ReplayDrafter):
    """The tree version: step i proposes a tree of γ_i nodes whose first path holds the continuation's next n_i
    tokens, then wrong ones, to a depth of `depth` (or n_i + 1, or γ_i, whichever fits); every other node is a
    wrong sibling hung under that path, round robin from the root down. Greedy tree verification accepts exactly
    n_i; a tree of the recorded size costs what the recorded tree cost to verify (the same nodes, another shape).
    """
    name = "replay-tree"

    def __init__(self, continuation: list[int], recorded: list[tuple[int, int]], vocab_size: int, depth: int = 6):
        super().__init__(continuation, recorded, vocab_size)
        if depth < 1:
            raise ValueError(f"depth must be >= 1 (the first path's length), got {depth}")
        self.depth = depth
        self.trees: dict[tuple[int, ...], Tree] = {}    # a few shapes, each checked once

    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> Proposal:
        chain = super().propose(tokens, k, sampling, generator).tokens.tolist()  # (γ,) n right, then wrong
        gamma, n = self.replayed[-1]
        if gamma == 0:                                                           # a recorded plain step
            return Proposal.empty(tokens)
        done = tokens.numel() - self.prompt_len
        d = min(gamma, max(self.depth, n + 1))                                   # the first path's length
        extra = gamma - d                                                        # siblings, round robin from the root
        parents, node_tokens, path_node = [], [], -1
        for j in range(d):                                                       # depth j + 1, depth by depth
            after = done + j                                                     # the target's pick there
            pick = self.continuation[after] if after < len(self.continuation) else 0
            parent, path_node = path_node, len(node_tokens)
            parents.append(parent)
            node_tokens.append(chain[j])
            for s in range(extra // d + (j < extra % d)):                        # never the pick, never the path's
                parents.append(parent)
                node_tokens.append((pick + 2 + s) % self.vocab_size)
        key = tuple(parents)
        if key not in self.trees:
            self.trees[key] = Tree(torch.tensor(parents))
        return Proposal(torch.tensor(node_tokens), tree=self.trees[key])


class CostOnly(Drafter):
    """Proposes nothing; runs `cost()` each step. A drafter's cost without its tokens, for `PacedDrafter`: e.g. a
    draft head's forwards at their real shapes, recorded once as a CUDA graph and replayed."""

    def __init__(self, cost, name: str):
        self.cost, self.name = cost, name

    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> Proposal:
        self.cost()
        return Proposal.empty(tokens)


class _FollowsReplay:
    """A replay's recorded choice of γ (or tree size) for each step, as the policy that made it: a recorded plain
    step is the policy's 0, and the plain steps recorded in a row are those it is sure of (`plain_steps`), so the
    compiled loops take them at once, as they take a cost-aware policy's. A plain step the loop takes without asking
    the replay is entered in its record."""

    def _follow(self, replay: ReplayDrafter) -> None:
        self.replay = replay

    def _next(self) -> int:
        recorded = self.replay.recorded
        return recorded[len(self.replay.replayed) % len(recorded)][0]

    def update(self, step) -> None:
        if step.asked == 0:                       # the loop took a plain step: the replay was not asked
            self.replay.replayed.append((0, 0))

    def plain_steps(self) -> int:
        recorded, done, n = self.replay.recorded, len(self.replay.replayed), 0
        while n < len(recorded) and recorded[(done + n) % len(recorded)][0] == 0:
            n += 1
        return max(1, n)


class ReplayedGamma(_FollowsReplay, GammaPolicy):
    """The chain loops' policy replaying a recorded run's γ choices, plain steps included (ReplayDrafter's)."""
    name = "replayed"

    def __init__(self, replay: ReplayDrafter):
        self._follow(replay)

    def gamma(self) -> int:
        return self._next()


class ReplayedBudget(_FollowsReplay, FixedBudget):
    """The tree loops' budget replaying a recorded run's tree sizes, plain steps included (ReplayTreeDrafter's)."""
    name = "replayed"

    def __init__(self, replay: ReplayDrafter):
        super().__init__(max(1, max(g for g, _ in replay.recorded)))
        self._follow(replay)

    def budget(self) -> int:
        return self._next()


class PacedDrafter(Drafter):
    """Proposes `tokens_from`'s tokens while `paced_by` (a draft model, Medusa heads, a `CostOnly`) drafts as many
    and is ignored: the acceptance of one drafter at the drafting cost of the other. It reads the target's
    features when `paced_by` does (and passes them on)."""

    def __init__(self, tokens_from: Drafter, paced_by: Drafter):
        if not isinstance(paced_by, Drafter) or paced_by.needs.verdict:
            raise ValueError(f"paced_by must be a Drafter that does not read the verdict (its propose sets the cost), "
                             f"got {type(paced_by).__name__}")
        self.tokens_from, self.paced_by = tokens_from, paced_by
        pacing = paced_by.needs          # its features and target; on the device only as a draft model
        self.needs = Needs(features=pacing.features, samples_tokens=tokens_from.needs.samples_tokens,
                           target=pacing.target, device="model" if pacing.device == "model" else None)
        self.name = f"{tokens_from.name}@{paced_by.name}-cost"

    def check_target(self, target) -> None:
        self.tokens_from.check_target(target)
        self.paced_by.check_target(target)

    def device_parts(self) -> tuple:
        """Paced by a draft model (decoding/compiled.py's protocol): the compiled loop runs that model on the device
        for its cost and reads the tokens of `tokens_from` on the host."""
        model, host = self.paced_by.device_parts()
        return (model, self.tokens_from) if model is not None and host is None else (None, self)

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        self.tokens_from.start(prompt_ids)
        self.paced_by.start(prompt_ids, features)

    def cost(self, tokens: torch.Tensor, n: int, sampling: SamplingConfig, generator=None) -> None:
        """Run the pacing drafter's drafting of n nodes, its tokens ignored (a device drafter's left unread)."""
        if self.paced_by.needs.device == "tree":
            self.paced_by.propose_on_device(tokens, n)
        else:
            self.paced_by.propose(tokens, n, sampling, generator)

    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> Proposal:
        if isinstance(self.tokens_from, ReplayDrafter):
            # a replay knows its length first: the drafting cost is queued before the replay builds its tokens on
            # the host, so on a GPU that host work (the measuring device's, not a drafter's) overlaps the cost
            if n := self.tokens_from.next_length(k):
                self.cost(tokens, n, sampling, generator)
            proposal = self.tokens_from.propose(tokens, k, sampling, generator)
            assert proposal.k == n, (proposal.k, n)
            return proposal
        proposal = self.tokens_from.propose(tokens, k, sampling, generator)
        if proposal.k:
            self.cost(tokens, proposal.k, sampling, generator)
        return proposal

    def commit(self, n_cached: int, features: torch.Tensor | None = None, verdict: torch.Tensor | None = None) -> None:
        self.tokens_from.commit(n_cached)
        self.paced_by.commit(n_cached, features)
