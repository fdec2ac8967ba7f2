"""Speculation at the speed of memory: the chain loop on a static cache, compiled, one CUDA graph a shape.

The eager loop (speculative.py) is the reference; this is the same propose -> verify -> accept ->
commit on gpt-fast's decode path (static.py), so that on a GPU a step costs what its forwards
cost, not what launching them from Python costs:

1. The target sits in a `StaticKVCache`. The verify forward feeds the last committed token and K
   draft tokens, padded to a fixed width: K is rounded up to a bucket of `BUCKETS` = (0, 1, 2, 4, 8),
   so the verify has five shapes (six or seven with max_gamma=16 or 32); K = 0, a plain step (a cost-aware γ
   declining to draft, the last token), is the last token alone, as plain decoding's step (a 2-token forward
   costs more than a one-token one, however little: docs/hardware.md). Each shape is compiled once by torch.compile and, on CUDA,
   recorded once as a CUDA graph (`FixedShapeStep`); positions and slots are tensors filled in
   place, so nothing Python-side changes between calls.
2. A draft model drafts on the device too, in its own static cache: one-token steps, and a
   two-token step to catch up on what it has not read (the correction after a rejection, or the
   last draft token and the bonus token after a full accept). A host drafter (prompt lookup,
   suffix, anything with a chain proposal) proposes on the CPU and hands its tokens over.
3. Acceptance runs on the device (`greedy_accept_on_device`, `speculative_accept_on_device`); the
   step reads the verdict and the tokens back with one host sync, its only one. Where the γ policy declines to
   draft (γ = 0) and knows the next steps will be plain too (`GammaPolicy.plain_steps`: a cost-aware γ until its
   next probe), up to `PLAIN_RUN` plain steps run back to back on the device, each feeding its token to the next,
   and one sync reads them all, as plain decoding (static.py) does.
4. Commit sets the target cache's length: a chain's accepted draft tokens already sit in the
   slots right after the committed ones, so nothing is copied (a tree would need `commit_path`).

Batch size 1, chain drafters, labkit's own `Transformer` as the target. Greedy output equals
`autoregressive_generate`'s token for token and sampled output has the target's distribution
(tests/test_compiled_speculative.py); scripts/gpu_check.py times it on a GPU.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import torch

from ..core.adaptive import FixedGamma, GammaPolicy, check_gamma
from ..core.sampling import GREEDY, SamplingConfig, probs_from_logits
from ..core.trace import Step
from ..drafters.base import Drafter
from ..models.cuda_graph import capture_graph
from ..models.kv_cache import StaticKVCache
from ..models.transformer import Transformer
from .base import Decoder, Generation, check_drafter
from .host_sync import read_back
from .static import compiled, prefill, static_forward

BUCKETS = (0, 1, 2, 4, 8)   # draft lengths the verify forward is compiled for; K pads up to the next one
MAX_GAMMA = BUCKETS[-1]     # the default longest draft; a decoder built with max_gamma=16 or 32 adds those widths
PLAIN_RUN = 8               # plain steps a policy is sure of, taken at once: one host sync for up to 8 (as StaticDecoder)


def bucket(k: int, buckets: tuple[int, ...] = BUCKETS) -> int:
    """The verify width (in draft tokens) for a draft of k tokens: the smallest bucket that holds it."""
    return next(b for b in buckets if b >= k)


def buckets_up_to(max_gamma: int) -> tuple[int, ...]:
    """The verify widths (in draft tokens) of a decoder that drafts up to `max_gamma` tokens: 0 (a plain step), 1, 2,
    4, ... max_gamma (8, 16 or 32)."""
    if isinstance(max_gamma, bool) or max_gamma not in (8, 16, 32):
        raise ValueError(f"max_gamma must be 8, 16 or 32 (the longest draft the verify is compiled for), "
                         f"got {max_gamma!r}")
    return (0, *(2 ** i for i in range(max_gamma.bit_length())))


def check_static_loop(model, cuda_graph: bool, max_len: int, least: int, eager: str) -> None:
    """What a compiled loop needs, or a ValueError that says what to do: labkit's Transformer (`eager`: the loop for
    other targets), a CUDA device for graphs, a static cache of at least `least` slots."""
    if not isinstance(model, Transformer):
        raise ValueError(f"the compiled loops run labkit's own Transformer (static cache, fixed shapes), got "
                         f"{type(model).__name__}: decode other targets with {eager}")
    if cuda_graph and model.device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs the model on a CUDA device; use cuda_graph=False on "
                         f"{model.device.type}")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or not least <= max_len:
        raise ValueError(f"max_len must be an integer >= {least} (the static cache's slots), got {max_len!r}")


class FixedShapeStep:
    """`static_forward` over T tokens at T slots, every input a buffer filled in place: one shape, so torch.compile
    traces it once and a CUDA graph records it once. Fill `tokens` (1, T), call `at(first_slot)`, then call it.

    tree=True: the positions (T,) and `block` (T, T) are buffers too (a tree's depths and ancestors, filled by the
    caller; the mask over the cache is made from `block` on the device, `tree_mask`), and a call returns
    (features (1, T, F), logits (1, T, V)): the final hidden states, or with `taps` those blocks' outputs too
    (static_forward).
    """

    def __init__(self, model: Transformer, cache: StaticKVCache, width: int, compile: bool | str, cuda_graph: bool,
                 compile_backend: str, compile_options: dict | None, tree: bool = False, taps: tuple[int, ...] = ()):
        device = model.device
        self.cache, self.cuda_graph = cache, cuda_graph
        self.tokens = torch.zeros(1, width, dtype=torch.long, device=device)     # (1, T) valid ids, always
        self.slots = torch.arange(width, device=device)                          # (T,) where they are written
        self.ramp = torch.arange(width, device=device)                           # (T,) 0, 1, ..., T-1
        self.positions = self.block = None
        if tree:
            self.positions = torch.arange(width, device=device)                  # (T,)
            self.block = torch.ones(width, width, dtype=torch.bool, device=device).tril()  # (T, T)
        mask = (lambda: tree_mask(self.block, self.slots, cache.max_len)) if tree else (lambda: None)
        self.forward = compiled(lambda run_block: static_forward(model, cache, self.tokens, self.positions, mask(),
                                                                 run_block, hidden=tree, taps=taps),
                                compile, compile_backend, compile_options)
        self.graph, self.out = None, None

    def at(self, first_slot: int) -> None:
        """Slots first_slot, ..., first_slot + T - 1 (written on the device: no host sync)."""
        torch.add(self.ramp, first_slot, out=self.slots)

    def __call__(self):
        """Logits (1, T, V) of `tokens`, their keys and values written at `slots`; a graph refills its output."""
        self.cache.slots = self.slots          # the slot tensor this shape's compiled code and graph read
        if not self.cuda_graph:
            return self.forward()
        if self.graph is None:                 # compile and record now (warm-up writes these slots again: harmless)
            self.graph, self.out = capture_graph(self.forward, warmups=3)
        self.graph.replay()
        return self.out


def tree_mask(block: torch.Tensor, slots: torch.Tensor, max_len: int) -> torch.Tensor:
    """(T, max_len): the slots each of a step's T tokens sees: every slot before the step's first (the committed
    tokens) and, among the step's own T slots, those `block` (T, T) allows; never a slot after them (stale keys).
    Made on the device from the step's slots, so it costs the host nothing and a CUDA graph records it."""
    T = block.shape[0]
    rel = torch.arange(max_len, device=block.device) - slots[0]                 # (max_len,) slot - first slot
    own = block[:, rel.clamp(0, T - 1)] & ((rel >= 0) & (rel < T))              # (T, max_len) the step's slots
    return own | (rel < 0)                                                       # (T, max_len)


def sample_without_sync(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of probs (..., V), unnormalised is fine -> (..., 1): the exponential race argmax(p / E),
    E ~ Exp(1) per token, which token j wins with probability p_j / sum(p). It is torch.multinomial's own one-sample
    path (the same draws for a seed) without multinomial's check of its input, which reads back to the host: on a
    GPU, a sync. gpt-fast's multinomial_sample_one_no_sync."""
    race = torch.empty_like(probs).exponential_(1, generator=generator)          # (..., V)
    return (probs / race).argmax(-1, keepdim=True)


def fed_steps(step: FixedShapeStep, first_slot: int, token: int, r: int, sampling: SamplingConfig,
              generator: torch.Generator | None, clock: "Clock") -> tuple[torch.Tensor, list[torch.Tensor]]:
    """r one-token forwards of a one-token `step` back to back on the device, the first of `token` at `first_slot`,
    each feeding its pick (or draw) to the next, a clock mark after each: the picks (r,) and, for a tree step, each
    forward's features (1, F) (copied: a graph's output is refilled by the next call). Nothing waits for the device."""
    step.tokens[0, 0].fill_(token)
    picks, features = [], []
    for i in range(r):
        if step.positions is not None:                   # a tree step's RoPE position is a buffer of its own
            step.positions.fill_(first_slot + i)
        step.at(first_slot + i)
        out = step()
        logits = (out[1] if isinstance(out, tuple) else out)[0]                     # (1, V)
        pick = logits.argmax(-1) if sampling.greedy else \
            sample_without_sync(probs_from_logits(logits, sampling), generator)[:, 0]   # (1,)
        step.tokens[0].copy_(pick)                       # the next step's input, without leaving the device
        picks.append(pick)
        if isinstance(out, tuple):
            features.append(out[0][0].clone())
        clock.mark()
    return torch.cat(picks), features


class DeviceAcceptance(NamedTuple):
    n_accepted: torch.Tensor   # () leading draft tokens kept, 0..K
    tokens: torch.Tensor       # (K+1,) the draft's first n_accepted tokens, then the correction or bonus token


def greedy_accept_on_device(draft: torch.Tensor, target_logits: torch.Tensor) -> DeviceAcceptance:
    """`core.acceptance.greedy_accept` without leaving the device. draft (K,), target_logits (K+1, V)."""
    K = draft.shape[0]
    target_tokens = target_logits.argmax(-1)                                     # (K+1,)
    n = (target_tokens[:K] == draft).int().cumprod(0).sum()                      # ()
    return DeviceAcceptance(n, target_tokens)    # its first n equal the draft; token n is the target's own pick


def speculative_accept_on_device(draft: torch.Tensor, q_draft: torch.Tensor, p_target: torch.Tensor,
                                 generator: torch.Generator | None = None) -> DeviceAcceptance:
    """Rejection sampling of Leviathan et al. 2023 / Chen et al. 2023 without leaving the device.

    Keep x_i with probability min(1, p_target(x_i) / q_draft(x_i)); at the first rejection draw from
    norm(max(0, p_target - q_draft)); after K acceptances draw the bonus from p_target[K] (no draft there,
    so the residual against a zero q is p_target itself). draft (K,), q_draft (K, V), p_target (K+1, V).
    """
    K, V = q_draft.shape
    idx = torch.arange(K, device=draft.device)
    p_x, q_x = p_target[idx, draft], q_draft[idx, draft]                         # (K,), (K,)
    u = torch.rand(K, generator=generator, device=draft.device)                  # (K,)
    n = (u * q_x < p_x).int().cumprod(0).sum()                                   # () u < p/q without dividing by 0
    q_after = torch.cat([q_draft, q_draft.new_zeros(1, V)])                      # (K+1, V)
    row = n.view(1)                                                              # (1,) the row to draw from
    p_n = p_target.index_select(0, row)                                          # (1, V)
    residual = (p_n - q_after.index_select(0, row)).clamp(min=0)                 # (1, V)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_n)    # p == q up to rounding: p itself
    next_token = sample_without_sync(residual, generator)[0]                     # (1,); unnormalised is fine
    tokens = torch.cat([draft, draft.new_zeros(1)]).scatter(0, row, next_token)  # (K+1,)
    return DeviceAcceptance(n, tokens)


class Clock:
    """Seconds between marks on the device's timeline: CUDA events on a GPU (read after the step's sync, so timing
    adds none), perf_counter on a CPU, where every op has finished when it returns."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """The time between consecutive marks (call after a sync)."""
        pairs = zip(self.marks, self.marks[1:])
        return [a.elapsed_time(b) / 1e3 if self.cuda else b - a for a, b in pairs]


class StaticDraft:
    """A draft model drafting on the device in its own static cache: K one-token steps with no host sync between
    them, after catching up on the committed tokens it has not read (1 after a rejection, 2 after a full accept:
    the last draft token, never fed, and the bonus; more after plain steps, two at a time)."""

    def __init__(self, model: Transformer, max_len: int, **how):
        a, p = model.args, model.embed_tokens.weight
        self.model = model
        self.cache = StaticKVCache(a.n_layers, 1, a.n_kv_heads, max_len, a.head_dim, p.dtype, p.device)
        self.steps = {t: FixedShapeStep(model, self.cache, t, **how) for t in (1, 2)}

    def warmup(self) -> None:
        for step in self.steps.values():
            step()

    def start(self, prompt: torch.Tensor) -> None:
        """Prefill with the prompt but its last token, as the target's cache is (eagerly: one shape per prompt)."""
        prefill(self.model, self.cache, prompt[:-1])

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k draft tokens (K,) after the committed `tokens`, and the distributions they were drawn from (K, V)
        when sampling (None when greedy)."""
        unseen = tokens[self.cache.length:]
        while unseen:
            step = self.steps[min(2, len(unseen))]
            for i, t in enumerate(unseen[:2]):
                step.tokens[0, i].fill_(t)
            step.at(self.cache.length)
            logits = step()[0, -1]                                               # (V,)
            self.cache.length += min(2, len(unseen))
            unseen = unseen[2:]
        drafted, q_rows, one = [], [], self.steps[1]
        for i in range(k):
            if sampling.greedy:
                x = logits.argmax(-1, keepdim=True)                              # (1,)
            else:
                q_rows.append(probs_from_logits(logits, sampling))              # (V,)
                x = sample_without_sync(q_rows[-1], generator)                  # (1,)
            drafted.append(x)
            if i < k - 1:                                                        # the last draft token is not fed
                one.tokens[0].copy_(x)
                one.at(self.cache.length)
                logits = one()[0, -1]                                            # (V,)
                self.cache.length += 1
        return torch.cat(drafted), (torch.stack(q_rows) if q_rows else None)     # (K,), (K, V)

    def commit(self, n_cached: int) -> None:
        """The target kept the first n_cached committed tokens: forget the draft tokens after them."""
        self.cache.truncate(min(self.cache.length, n_cached))


def device_parts(drafter: Drafter) -> tuple:
    """(a draft model to run on the device with static caches, or None; the drafter whose proposals are read on the
    host, or None). The device-drafting protocol of this loop: a drafter whose needs say device="model" (a draft
    model, drafters/draft_model.py; a drafter paced by one) has device_parts() returning that pair, and raises
    ValueError, saying what would run, where its model cannot run here; any other drafter proposes on the host."""
    return drafter.device_parts() if drafter.needs.device == "model" else (None, drafter)


class CompiledSpeculativeDecoder(Decoder):
    """Chain speculative decoding on static caches: eager, compiled, and/or replayed as CUDA graphs.

        dec = CompiledSpeculativeDecoder(target, DraftModelDrafter(draft), max_len=1024, compile=True, cuda_graph=True)
        gen = dec.generate(prompt_ids, max_new_tokens=256, gamma=4)     # reuses the compiled steps and graphs
        dec.start(prompt_ids, 64); dec.step()                            # or one step at a time
        dec.use_drafter(PromptLookupDrafter())                           # another drafter, the same compiled target

    drafter: a `DraftModelDrafter` drafts on the device (whole context, k tokens a step: no early stop, no window);
    a `PacedDrafter` proposes its host drafter's tokens while its draft model runs for its cost; any other chain
    drafter proposes on the host. gamma: draft tokens a step, 1..max_gamma (or a GammaPolicy, capped there).
    compile: torch.compile every shape (`compile_backend`, default inductor; "eager" only traces, as the CPU tests
    do); cuda_graph: record every shape once (CUDA only). max_len: the static caches' slots, which must hold
    prompt + max_new_tokens + max_gamma (the verify's padding writes up to max_gamma slots past the last token).
    max_gamma: the longest draft, 8 (verify widths 0, 1, 2, 4, 8 draft tokens), 16 or 32 (one or two widths more to
    compile: for drafters that copy long runs, as suffix decoding does).
    """

    def __init__(self, model: Transformer, drafter: Drafter, max_len: int, compile: bool | str = False,
                 cuda_graph: bool = False, compile_backend: str = "inductor", compile_options: dict | None = None,
                 max_gamma: int = MAX_GAMMA):
        self.buckets = buckets_up_to(max_gamma)
        self.max_gamma = max_gamma
        check_static_loop(model, cuda_graph, max_len, max_gamma + 2, "speculative_generate")
        # every shape is a recompile of the same small function: let dynamo keep them all (its default keeps 8)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.compiled = dict(compile=compile, cuda_graph=cuda_graph, compile_backend=compile_backend,
                             compile_options=compile_options)
        a, p = model.args, model.embed_tokens.weight
        self.model, self.max_len = model, max_len
        self.cache = StaticKVCache(a.n_layers, 1, a.n_kv_heads, max_len, a.head_dim, p.dtype, p.device)
        self.verify_steps = {b: FixedShapeStep(model, self.cache, b + 1, **self.compiled) for b in self.buckets}
        # a host drafter's tokens travel from page-locked memory, without waiting for the device (a copy from
        # ordinary memory waits for every queued kernel first: the draft model's, on a paced draft)
        self.draft_host = torch.zeros(max_gamma, dtype=torch.long, pin_memory=p.device.type == "cuda")
        self.use_drafter(drafter)

    def use_drafter(self, drafter: Drafter) -> None:
        """Draft with `drafter` from the next `start` on, keeping the target's compiled shapes and graphs."""
        check_drafter(drafter)
        if drafter.needs.features or drafter.needs.verdict:
            raise ValueError(f"the {drafter.name} drafter needs the tree loop: decode with labkit.decoding.tree")
        draft_model, self.host_drafter = device_parts(drafter)         # raises where the drafter cannot run here
        drafter.check_target(self.model)
        self.drafter = drafter
        self.draft = None if draft_model is None else StaticDraft(draft_model, self.max_len, **self.compiled)

    @torch.no_grad()
    def warmup(self, gammas=None) -> None:
        """Compile the verify shapes of these draft lengths (default: every bucket) and the draft's, and record their
        graphs now, not inside a timed step (otherwise each is compiled when first used). Call it before `start`:
        its forwards write cache slots that the prefill and the steps overwrite before anything reads them."""
        for b in self.buckets if gammas is None else sorted({self.bucket(min(g, self.max_gamma)) for g in gammas}):
            self.verify_steps[b]()
        if self.draft is not None:
            self.draft.warmup()

    @torch.no_grad()
    def start(self, prompt_ids: torch.Tensor, max_new_tokens: int, gamma: int | GammaPolicy = 4,
              sampling: SamplingConfig = GREEDY, eos_token_ids: tuple[int, ...] = (),
              seed: int | None = None) -> "CompiledSpeculativeDecoder":
        """Begin a sequence: check the request, prefill both caches with the prompt but its last token."""
        self.begin(self.model, prompt_ids, max_new_tokens, f"compiled-speculative/{self.drafter.name}",
                   eos_token_ids, seed, sampling)
        if isinstance(gamma, GammaPolicy):
            self.policy = gamma
        elif check_gamma(gamma) > self.max_gamma:
            raise ValueError(f"gamma={gamma}: the compiled verify has shapes for up to {self.max_gamma} draft tokens; "
                             f"pass gamma <= {self.max_gamma} (or build the decoder with max_gamma=16 or 32)")
        else:
            self.policy = FixedGamma(gamma)
        if self.prompt.numel() + max_new_tokens > self.model.max_seq_len:
            raise ValueError(f"{self.prompt.numel()} prompt + {max_new_tokens} new tokens exceed the model's context "
                             f"of {self.model.max_seq_len}: ask for fewer new tokens")
        need = self.prompt.numel() + max_new_tokens + self.max_gamma
        if need > self.max_len:
            raise ValueError(f"{self.prompt.numel()} prompt + {max_new_tokens} new tokens + {self.max_gamma} padding slots "
                             f"exceed max_len={self.max_len}: build the decoder with max_len >= {need}")
        device = self.model.device
        self.device_generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        t0 = time.perf_counter()
        prefill(self.model, self.cache, self.prompt[:-1])      # every committed token but the last
        sync()
        t1 = time.perf_counter()
        if self.draft is not None:
            self.draft.start(self.prompt)
        if self.host_drafter is not None:
            self.host_drafter.start(self.prompt)
        sync()
        self.trace.prefill_time = self.trace.total_time = time.perf_counter() - t0
        self.trace.draft_prefill_time = time.perf_counter() - t1
        return self

    @torch.no_grad()
    def _advance(self) -> Step:
        """propose -> verify -> accept -> commit, once; the one host sync reads the verdict. Where the policy says
        γ = 0, a run of the plain steps it is sure of instead (`plain_run`)."""
        n_before, trace = len(self.tokens), self.trace
        asked, left = self.policy.gamma(), self.max_new_tokens - trace.n_generated
        k = min(asked, self.max_gamma, left - 1)
        if k == 0:
            return self.plain_run(min(self.policy.plain_steps(), PLAIN_RUN, left) if asked == 0 else 1)
        t0, clock = time.perf_counter(), Clock(self.model.device)
        # 1. Propose: a chain of K <= k draft tokens, on the device
        draft, q_draft = self.propose(k)                                             # (K,), (K, V) or None
        clock.mark()
        # 2. Verify: one target forward over [last committed token, draft, padding] at the bucket's width
        logits = self.verify(draft)                                                  # (K+1, V)
        clock.mark()
        # 3. Accept, on the device
        if self.sampling.greedy:
            acc = greedy_accept_on_device(draft, logits)
        else:
            p_target = probs_from_logits(logits, self.sampling)                      # (K+1, V)
            acc = speculative_accept_on_device(draft, q_draft, p_target, self.device_generator)
        got = read_back(n_accepted=acc.n_accepted.view(1), tokens=acc.tokens, proposed=draft)  # the one host sync
        n, tokens, proposed = got.n_accepted[0], got.tokens, got.proposed                # (), (K+1,), (K,)
        K = len(proposed)
        draft_time, verify_time = clock.seconds()
        # 4. Commit: the accepted draft tokens already sit in the slots after the committed ones (a chain is
        #    contiguous), so rolling back is setting the length; the padding's slots are overwritten later
        self.cache.truncate(n_before + n)
        if self.draft is not None:
            self.draft.commit(n_before + n)
        if self.host_drafter is not None:
            self.host_drafter.commit(n_before + n)
        new_tokens = self._commit(tokens[:n + 1])
        step = Step(proposed, n, tokens[n], n == K, draft_time, verify_time, asked=k)
        self.policy.update(step)
        return self._record(step, new_tokens, t0)

    @torch.no_grad()
    def plain_run(self, r: int) -> Step:
        """r plain steps (γ = 0) on the device: each verifies the last token alone, as plain decoding does, and
        feeds its pick (or draw) to the next; one host sync reads all r. A step is recorded, and the policy told,
        for each token; the drafter catches up afterwards. Returns the last step."""
        t0, clock = time.perf_counter(), Clock(self.model.device)
        picks, _ = fed_steps(self.verify_steps[0], len(self.tokens) - 1, self.tokens[-1], r, self.sampling,
                             self.device_generator, clock)
        tokens, seconds = picks.tolist(), clock.seconds()                            # the run's one host sync
        last = self._commit_each(tokens, lambda i, token: Step([], 0, token, True, 0.0, seconds[i], asked=0),
                                 self.policy.update)
        if self.draft is not None:
            self.draft.commit(len(self.tokens) - 1)
        if self.host_drafter is not None:
            self.host_drafter.commit(len(self.tokens) - 1)
        self.trace.total_time += time.perf_counter() - t0
        return last

    def propose(self, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Up to k draft tokens (K,) on the target's device, and their distributions (K, V) when sampling."""
        device, V = self.model.device, self.model.vocab_size
        draft, q_draft = torch.zeros(0, dtype=torch.long, device=device), torch.zeros(0, V, device=device)
        proposal = None
        if k and self.host_drafter is not None:                 # a host drafter proposes on the CPU
            proposal = self.host_drafter.propose(torch.tensor(self.tokens), k, self.sampling, self.generator)
            if not proposal.is_chain:
                raise ValueError(f"the {self.host_drafter.name} drafter proposed a tree: decode it with "
                                 "labkit.decoding.tree.TreeDecoder (or tree_generate)")
            k = min(k, proposal.k)
        if k and self.draft is not None:                        # the draft model's k forwards, queued on the device
            draft, q_draft = self.draft.propose(self.tokens, k, self.sampling, self.device_generator)
        if proposal is not None:                                # the host's tokens, copied over (a paced draft's
            draft = proposal.tokens[:k]                         # own tokens are only its cost)
            if device.type == "cuda":                           # the buffer is free: the last step's copy ended
                draft = self.draft_host[:k].copy_(draft).to(device, non_blocking=True)     # before its sync
            q_draft = (None if self.sampling.greedy else                                    # (K, V)
                       torch.nn.functional.one_hot(draft, V).float() if proposal.q_draft is None else
                       proposal.q_draft[:k].to(device))
        return draft, q_draft

    def verify(self, draft: torch.Tensor) -> torch.Tensor:
        """Target logits (K+1, V) after the last committed token and each of the K draft tokens.

        The forward has the bucket's width B+1 >= K+1. The B-K padding tokens (whatever valid ids the buffer held)
        land in the slots just past the draft; no real token attends to them (the mask shows each token the slots
        at or before its own), their logits are never read, and the next step writes over those slots.
        """
        K, N = draft.shape[0], len(self.tokens)
        step = self.verify_steps[self.bucket(K)]
        step.tokens[0, 0].fill_(self.tokens[-1])       # the last committed token: the cache holds all before it
        step.tokens[0, 1:K + 1].copy_(draft)
        step.at(N - 1)                                 # slots N-1, ..., N-1+B
        self.cache.length = N + K                      # written: N-1 committed + the last one + K drafted
        return step()[0, :K + 1]                       # (K+1, V)

    def bucket(self, k: int) -> int:
        """This decoder's verify width for a draft of k tokens."""
        return bucket(k, self.buckets)

    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, gamma: int | GammaPolicy = 4,
                 sampling: SamplingConfig = GREEDY, eos_token_ids: tuple[int, ...] = (),
                 seed: int | None = None) -> Generation:
        """Decode up to max_new_tokens after prompt_ids (T,): `start`, then step to the end."""
        gen = self.start(prompt_ids, max_new_tokens, gamma, sampling, eos_token_ids, seed).run()
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
        return gen


def compiled_speculative_generate(model: Transformer, drafter: Drafter, prompt_ids: torch.Tensor,
                                  max_new_tokens: int, gamma: int | GammaPolicy = 4,
                                  sampling: SamplingConfig = GREEDY, eos_token_ids: tuple[int, ...] = (),
                                  seed: int | None = None, compile: bool = False, cuda_graph: bool = False,
                                  compile_backend: str = "inductor") -> Generation:
    """One request through a fresh `CompiledSpeculativeDecoder` sized for it (compiles every shape: to time many
    requests, build the decoder once and call its `generate`)."""
    prompt_len = torch.as_tensor(prompt_ids).numel() if not isinstance(prompt_ids, (str, bytes)) else 0
    max_len = max(MAX_GAMMA + 2, prompt_len + (max_new_tokens if isinstance(max_new_tokens, int) else 0) + MAX_GAMMA)
    dec = CompiledSpeculativeDecoder(model, drafter, max_len, compile, cuda_graph, compile_backend)
    return dec.generate(prompt_ids, max_new_tokens, gamma, sampling, eos_token_ids, seed)
