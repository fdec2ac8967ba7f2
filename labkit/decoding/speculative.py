"""The speculative decoding loop: propose -> verify -> accept -> commit.

Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", and
Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling". The target's cache
holds every committed token but the last; a step feeds that last token plus the K draft tokens
in one forward, whose K+1 outputs score each draft token and give one more. The first step is
the exception: the prefill read the whole prompt, as plain decoding's does, so its logits after
the last prompt token are the first row and the step feeds only the draft (no forward at all
for an empty one). Batch size 1: each sequence accepts a different number of tokens per step.
"""
from __future__ import annotations

import time

import torch

from ..core.acceptance import greedy_accept, speculative_accept
from ..core.adaptive import FixedGamma, GammaPolicy
from ..core.sampling import GREEDY, SamplingConfig, probs_from_logits, token_probs
from ..core.trace import Step
from ..drafters.base import Drafter, Proposal
from ..models.target import Target
from .base import Decoder, Generation, check_drafter


class SpeculativeDecoder(Decoder):
    """One sequence decoded speculatively; each `step()` is one target forward.

    Holds what the loop needs between steps (the committed tokens, the target's cache, the
    trace) so a notebook can step through it and look at both caches after each step.
    """

    def __init__(self, target: Target, drafter: Drafter, prompt_ids: torch.Tensor, max_new_tokens: int,
                 gamma: int | GammaPolicy = 5, sampling: SamplingConfig = GREEDY,
                 eos_token_ids: tuple[int, ...] = (), seed: int | None = None):
        self.begin(target, prompt_ids, max_new_tokens, f"speculative/{check_drafter(drafter).name}", eos_token_ids,
                   seed, sampling)
        if drafter.needs.features or drafter.needs.verdict:
            what = "features" if drafter.needs.features else "verdict on every node"
            raise ValueError(f"the {drafter.name} drafter reads the target's {what}, which only the tree loop "
                             "gives: decode with labkit.decoding.tree.TreeDecoder (or tree_generate)")
        drafter.check_target(target)
        self.target, self.drafter = target, drafter
        self.policy = gamma if callable(getattr(gamma, "gamma", None)) else FixedGamma(gamma)
        t0 = time.perf_counter()
        with torch.no_grad():
            self.cache = target.new_cache()                 # every prompt token: the first step feeds no root
            self.prefill_logits = target(self.prompt[None].to(target.device), self.cache,
                                         num_logits=1)[0, -1:].cpu()                     # (1, V) after the prompt
            t1 = time.perf_counter()
            drafter.start(self.prompt)
            self.policy.start(self.prompt)
        self.trace.prefill_time = self.trace.total_time = time.perf_counter() - t0
        self.trace.draft_prefill_time = time.perf_counter() - t1

    @torch.no_grad()
    def _advance(self) -> Step:
        """propose -> verify -> accept -> commit, once."""
        n_before, trace = len(self.tokens), self.trace
        # 1. Propose: the drafter's guess at the next k tokens (none on a plain step)
        t0 = time.perf_counter()
        k = min(self.policy.gamma(), self.max_new_tokens - trace.n_generated - 1, self.cache.room() - 1)
        proposal = self.drafter.propose(torch.tensor(self.tokens), k, self.sampling, self.generator) \
            if k > 0 else Proposal.empty(self.prompt)
        if not proposal.is_chain:
            raise ValueError(f"the {self.drafter.name} drafter proposed a tree: decode it with "
                             "labkit.decoding.tree.TreeDecoder (or tree_generate)")
        draft = proposal.tokens[:k]                                                        # (K,)
        # 2. Verify: one target forward over [last committed token, draft...] (the first step: the draft alone)
        t1 = time.perf_counter()
        logits = self.verify(draft)                                                        # (K+1, V)
        t2 = time.perf_counter()
        # 3. Accept: the longest prefix the target agrees with, plus one token of the target's
        if self.sampling.greedy:
            p_draft = token_probs(logits, torch.arange(draft.numel()), draft)              # (K,), for the trace
            acc = greedy_accept(draft, logits)
        else:
            p_target = probs_from_logits(logits, self.sampling)                            # (K+1, V)
            q_draft = proposal.q_or_one_hot(logits.shape[-1])[:k]                          # (K, V)
            acc = speculative_accept(draft, q_draft, p_target, self.generator)
            p_draft = p_target[torch.arange(draft.numel()), draft].tolist()
        # 4. Commit: extend the sequence; roll both caches back to the accepted prefix
        self.cache.truncate(n_before + acc.n_accepted)
        self.drafter.commit(n_before + acc.n_accepted)
        new_tokens = self._commit(acc.tokens(draft))
        step = Step(draft.tolist(), acc.n_accepted, acc.next_token, acc.bonus, t1 - t0, t2 - t1,
                    p_draft, proposal.q_token[:k].tolist(), asked=k)
        self.policy.update(step)
        return self._record(step, new_tokens, t0)

    def verify(self, draft: torch.Tensor) -> torch.Tensor:
        """Target logits (K+1, V) after the last committed token and each of the K draft tokens. On the first step
        the cache already holds the last committed token (the prompt's) and the prefill gave its row."""
        first, self.prefill_logits = self.prefill_logits, None
        if first is None:
            feed = torch.tensor([self.tokens[-1]] + draft.tolist(), device=self.target.device)[None]   # (1, K+1)
            return self.target(feed, self.cache)[0].cpu()                                      # (K+1, V)
        if not draft.numel():
            return first                                                                       # (1, V)
        rows = self.target(draft[None].to(self.target.device), self.cache)[0].cpu()           # (K, V)
        return torch.cat([first.to(rows.dtype), rows])                                         # (K+1, V)


def speculative_generate(target: Target, drafter: Drafter, prompt_ids: torch.Tensor, max_new_tokens: int,
                         gamma: int | GammaPolicy = 5, sampling: SamplingConfig = GREEDY,
                         eos_token_ids: tuple[int, ...] = (), seed: int | None = None) -> Generation:
    """Decode up to max_new_tokens after prompt_ids (T,) with `drafter` proposing and `target` deciding."""
    return SpeculativeDecoder(target, drafter, prompt_ids, max_new_tokens, gamma, sampling, eos_token_ids, seed).run()

