"""What the benchmark runs: a registry of methods, each `run(prompt_ids) -> MethodResult`.

A method of labkit's is data: a drafter factory, a γ or tree-budget policy and the loop that runs them
("chain", "tree", or "gated": the chain loop behind a per-workload gate). Its ablations are variants
(`VARIANTS`, `bench --variant NAME`): the same method with one speed choice turned off, named METHOD-NAME.

labkit's decoders run on labkit's own model; the peers run transformers' `generate` on the
same checkpoint (plain, `assistant_model=`, `prompt_lookup_num_tokens=`), and llama.cpp on the
presets' GGUF files where `make llama-cpp` built it (`llama_cpp.py`). A new technique (Medusa,
EAGLE, MTP) plugs in as one more entry in METHODS.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable

import torch

from ..core.adaptive import GammaPolicy, HeuristicGamma
from ..decoding.compiled import MAX_GAMMA
from ..decoding.loops import decode
from ..decoding.speculative import Generation, speculative_generate
from ..drafters import DraftModelDrafter, PromptLookupDrafter
from ..drafters.draft_model import DEFAULT_WINDOW, draft_reading
from ..drafters.opening import chat_opening
from ..drafters.suffix import SuffixDrafter
from ..drafters.window import AutoWindow, WindowCosts
from ..files.shipped import shipped
from ..models.layer_skip import CALIBRATION_TOKENS
from ..tuning import CostAwareBudget, CostAwareGamma, DraftGate, Shadowed, drafting_paid
from ..tuning.gate import one_token_step

BASELINE = "ar"             # every speedup is over this method, measured on the same question
PEER_BASELINE = "hf-generate"
LLAMA_BASELINE = "llama-cpp"


@dataclass
class MethodResult:
    tokens: list[int]                    # new token ids, the prompt excluded
    target_forwards: int                 # target forward passes that produced them (see Trace.n_target_forwards)
    draft_time: float | None             # seconds spent drafting (None: not measurable, e.g. transformers' lookup)
    verify_time: float                   # seconds inside target forwards
    steps: list[list] | None = None      # per step [γ, accepted, bonus, draft s, verify s]; labkit methods only
    seconds: float | None = None         # the method's own clock (llama.cpp: no process start); None: wall time
    prefill_seconds: float | None = None  # reading the prompt, before the first decode step (None: not measured)
    generation: Generation | None = None  # labkit's methods: the whole run, trace included (what the CLI draws)
    gate: dict | None = None             # a gated method's request: whether it drafted, and how that paid


@dataclass
class Models:
    """What the methods run on: labkit's pair, and transformers' copies for the peers (None until needed)."""
    target: object                       # loading.LoadedModel
    draft: object | None = None
    hf_target: torch.nn.Module | None = None
    hf_draft: torch.nn.Module | None = None
    timers: dict = field(default_factory=dict)   # hf module -> ForwardTimer
    draft_name: str | None = None        # the draft preset, for peers that load it themselves (llama.cpp)
    draft_window: int | str | None = None   # tokens the draft model reads besides the sinks (None: the whole
    #                                          context; "auto": per prompt, drafters.window.AutoWindow)
    draft_vocab: int | str | None = None  # ids the draft model scores: the k most frequent and the prompt's (None:
    #                                       all; "auto": drafters.vocab.auto_vocab)
    cross_draft: object | None = None    # loading.LoadedModel of CROSS_DRAFT: a draft with its own tokenizer
    hf_cross: torch.nn.Module | None = None
    loop: str = "auto"                   # decoding.loops: auto = the compiled loop on a GPU where it takes a method
    layer_skip_tokens: int = CALIBRATION_TOKENS   # calibration tokens the layer-skip search reads (models.layer_skip)
    chat_template: bool = True           # the prompts go through the chat template (then drafts copy in its opening)

    window_costs: WindowCosts | None = None   # what the "auto" window weighs, measured on first use
    _opening: torch.Tensor | None = field(default=None, init=False, repr=False)   # chat_opening's, on first use

    @property
    def opening(self) -> torch.Tensor | None:
        """The ids every templated prompt starts with, which the draft model reads once (drafters/opening.py); None
        without the chat template, or on the compiled loops, whose draft reads every prompt whole."""
        if not self.chat_template or self.compiled:
            return None
        if self._opening is None:
            self._opening = chat_opening(self.target.tokenizer)
        return self._opening if len(self._opening) else None

    def window(self, new_tokens: int) -> int | AutoWindow | None:
        """The draft model's window for answers of up to `new_tokens` tokens (an AutoWindow for "auto"; the
        whole context on the compiled loops, whose draft reads it all)."""
        if self.draft_window != "auto":
            return self.draft_window
        if self.compiled:
            return None
        return AutoWindow(self.costs(), new_tokens, DEFAULT_WINDOW, verify_curve=_verify_curve(self))

    def costs(self) -> WindowCosts:
        """The draft's reading and one-token step and the target's step on this machine, measured once."""
        if self.window_costs is None:
            self.window_costs = WindowCosts.measure(self.target.model, self.draft.model)
        return self.window_costs

    @property
    def compiled(self) -> bool:
        """Whether labkit's methods run on the compiled loops (their drafts then draft every token)."""
        return self.loop == "compiled" or (self.loop == "auto" and self.target.model.device.type == "cuda")


@dataclass(frozen=True)
class Method:
    name: str                            # the key on the command line and in the results
    label: str                           # what tables and plots call it
    needs: frozenset                     # of "draft", "hf", "hf_draft", "heads", "llama-cpp", "arctic", "cross_draft",
                                         # "hf_cross"
    drafter: Callable | None = None      # (Models, max_new_tokens) -> a Drafter (a chain's made per question, a tree's
                                         # once); None: plain decoding or a peer, whose `build` is given
    policy: object = None                # chain: γ -> an int or GammaPolicy; tree: a node budget, or
                                         # (Models, drafter) -> a budget policy made per question
    loop: str = "chain"                  # "chain", "tree", "gated" (chain, behind a DraftGate per workload), "own"
    build: Callable | None = None        # (Models, max_new_tokens, gamma, lookup_tokens) -> run(prompt_ids); made from
                                         # drafter, policy and loop unless given
    reference: str = BASELINE            # the plain decoder of its own stack (exact methods must equal it)
    exact: bool = True                   # greedy output equals plain greedy decoding (in exact arithmetic)

    def __post_init__(self):
        if self.loop not in LOOP_BUILDS and self.loop != "own":
            raise ValueError(f"Method.loop must be one of {(*LOOP_BUILDS, 'own')}, got {self.loop!r}")
        if self.build is None:
            if self.loop == "own" or self.drafter is None:
                raise ValueError(f"method {self.name}: give a drafter (and a policy) for loop {self.loop!r}, or build")
            object.__setattr__(self, "build", LOOP_BUILDS[self.loop](self))

    @property
    def tree(self) -> bool:
        """Proposes trees (its ideal speedup is the tree analogue, report.py)."""
        return self.loop == "tree"

    @property
    def per_workload(self) -> bool:
        """Its run also takes `workload=`: what earlier requests of it taught (the gate)."""
        return self.loop == "gated"


def from_generation(out: Generation) -> MethodResult:
    t = out.trace
    steps = [[s.gamma, s.n_accepted, int(s.bonus), round(s.draft_time, 6), round(s.verify_time, 6)] for s in t.steps]
    return MethodResult(out.tokens, t.n_target_forwards, t.draft_time, t.verify_time, steps,
                        prefill_seconds=t.prefill_time, generation=out)


def _autoregressive(m: Models, n: int, gamma: int, lookup_tokens: int):
    eos = m.target.eos_token_ids
    return lambda ids: from_generation(decode(m.target.model, None, ids, n, eos_token_ids=eos, loop=m.loop)[0])


def _speculative(method: Method):
    """A chain drafter, made per question by `method.drafter(models, max_new_tokens)`, with the γ (policy) of
    `method.policy`."""
    drafter, policy = method.drafter, method.policy

    def build(m: Models, n: int, gamma: int, lookup_tokens: int):
        eos = m.target.eos_token_ids

        def run(ids):
            # an adaptive γ drafts at most the compiled verify's 8 tokens where the compiled loop runs
            capped = m.compiled and isinstance(policy, type) and issubclass(policy, GammaPolicy)
            kw = {"max_gamma": MAX_GAMMA} if capped else {}
            if policy is CostAwareGamma:                 # priced on this machine's verify curve, as the budgets are
                kw["verify_curve"] = _verify_curve(m)
                if "draft" in method.needs and not m.compiled:              # and a draft model's measured step
                    costs = m.costs()
                    kw["known_costs"] = (costs.draft_step_seconds, costs.target_step_seconds)
            chosen, chain_drafter = policy(gamma, **kw), drafter(m, n)
            if policy is CostAwareGamma:
                chosen = _shadowed(m, chosen, chain_drafter)
            return from_generation(decode(m.target.model, chain_drafter, ids, n, chosen, eos_token_ids=eos,
                                          loop=m.loop)[0])
        return run
    return build


def _gated(method: Method):
    """The chain method behind one DraftGate per workload (tuning/gate.py): a request drafts only where drafting
    paid on the workload's last drafted request, the draft's reading of the prompt counted; the others decode
    plain. The runner names the workload: the question's category, within one round."""
    def build(m: Models, n: int, gamma: int, lookup_tokens: int):
        speculative, plain = _speculative(method)(m, n, gamma, lookup_tokens), \
            _autoregressive(m, n, gamma, lookup_tokens)
        gates: dict = {}

        def run(ids, workload=None):
            gate = gates.setdefault(workload, DraftGate())
            if not gate.drafts():
                result = plain(ids)
                gate.record(None)
                result.gate = {"drafted": False}
                return result
            result = speculative(ids)
            trace = result.generation.trace
            step = one_token_step(trace, _verify_curve(m)) or m.costs().target_step_seconds
            verdict = drafting_paid(trace, step)
            gate.record(verdict)
            result.gate = {"drafted": True, "paid": verdict.paid, "seconds": round(verdict.seconds, 6),
                           "plain_seconds": round(verdict.plain_seconds, 6)}
            return result
        return run
    return build


def _draft_model(m: Models, n: int, window: bool = True, vocab: bool = True, opening: bool = True):
    """The draft model with the run's speed choices: its window of the context, its vocabulary, the chat opening
    read once (each off with False, as the variants measure what it saves; the compiled loops' draft has none)."""
    eos = () if m.compiled else m.target.eos_token_ids
    draft = draft_reading(m.draft.model, m.window(n) if window else None,
                          m.draft_vocab if vocab and not m.compiled else None, m.opening if opening else None, eos)
    return DraftModelDrafter(draft, eos_token_ids=eos)


CROSS_DRAFT = "smollm2-135m-instruct"         # a draft with a tokenizer of its own (49,152 tokens)


def _cross_tokenizer(m: Models, n: int):
    from ..drafters.cross_tokenizer import CrossTokenizerDrafter
    return CrossTokenizerDrafter(m.cross_draft.model, m.cross_draft.tokenizer, m.target.tokenizer)


def _token_intersection(m: Models, n: int):
    from ..drafters.cross_tokenizer import TokenIntersectionDrafter
    return TokenIntersectionDrafter(m.cross_draft.model, m.cross_draft.tokenizer, m.target.tokenizer)


def _lookup(m: Models, n: int):
    return PromptLookupDrafter()


def _suffix(remember: bool, spec_factor: float = 2.0):
    """Suffix decoding; remember=True also indexes the answers to the earlier questions of the same run."""
    return lambda m, n=None: SuffixDrafter(spec_factor=spec_factor, remember=remember)


def _arctic_suffix(m: Models, n=None):
    """Arctic Inference's SuffixDecodingCache (`make arctic`) with labkit's suffix settings (bench/arctic.py)."""
    from ..drafters.arctic_suffix import ArcticSuffixDrafter
    return ArcticSuffixDrafter()


def _lookahead(window: int, ngram: int, max_verify: int, from_prompt: bool = False):
    """Lookahead decoding (W, N, G); from_prompt: the pool starts with the prompt's n-grams."""
    from ..drafters.lookahead import LookaheadDrafter
    return lambda m, n=None: LookaheadDrafter(window, ngram, max_verify, pool_from_prompt=from_prompt)


_SKIP_SEARCHES: dict[int, object] = {}       # target model id -> its layer-skip search, run once a process


def _layer_skip(m: Models, n: int, gamma: int, lookup_tokens: int):
    """Layer-skip self-speculation with the layers and γ that the search on this machine chose."""
    from ..drafters.layer_skip import LayerSkipDrafter
    from ..models.layer_skip import calibration_ids, search_skip_layers
    model, eos = m.target.model, m.target.eos_token_ids
    if id(model) not in _SKIP_SEARCHES:
        calibration = calibration_ids(m.target.tokenizer, m.layer_skip_tokens)
        _SKIP_SEARCHES[id(model)] = search_skip_layers(model, calibration, progress=False)
    search = _SKIP_SEARCHES[id(model)]
    drafter = LayerSkipDrafter(model, search.skip, eos_token_ids=eos)
    return lambda ids: from_generation(speculative_generate(model, drafter, ids, n, search.gamma, eos_token_ids=eos))


_VERIFY_CURVES: dict[int, dict[int, float]] = {}     # target model id -> its verify-cost curve, measured once


def _verify_curve(m: Models) -> dict[int, float]:
    return verify_curve(m.target.model)


def verify_curve(model) -> dict[int, float]:
    """This machine's t(T)/t(1) for the target, T = 1..64, 256 cached tokens (a few seconds, once a process)."""
    from ..bench.verify_cost import TOKENS
    from ..models.calibrate import time_forwards
    if id(model) not in _VERIFY_CURVES:
        t = time_forwards(model, 256, TOKENS, repeats=3, progress=False)
        _VERIFY_CURVES[id(model)] = {T: t[T] / t[1] for T in TOKENS}
    return _VERIFY_CURVES[id(model)]


def _shadowed(m: Models, policy, drafter):
    """A cost-aware policy with shadows on its plain steps (tuning/shadow.py) where the eager loops run."""
    return policy if m.compiled else Shadowed(policy, drafter)


def _cost_aware(max_budget: int):
    """A fresh cost-aware budget per question, on this machine's verify-cost curve."""
    return lambda m, drafter: _shadowed(m, CostAwareBudget(max_budget=max_budget, verify_curve=_verify_curve(m)),
                                        drafter)


def _tree(method: Method):
    """A tree drafter with `method.policy` nodes a step (or a fresh budget policy per question, made by
    `policy(m, drafter)`); the drafter is built once, its heads loaded once."""
    budget = method.policy

    def build(m: Models, n: int, gamma: int, lookup_tokens: int):
        eos, tree_drafter = m.target.eos_token_ids, method.drafter(m, n)
        return lambda ids: from_generation(decode(m.target.model, tree_drafter, ids, n,
                                                  budget(m, tree_drafter) if callable(budget) else budget,
                                                  eos_token_ids=eos,
                                                  tree=True, loop=m.loop)[0])
    return build


LOOP_BUILDS = {"chain": _speculative, "tree": _tree, "gated": _gated}


def _llama_cpp(speculative: bool = False, eagle3: bool = False):
    """llama.cpp's programs on the presets' GGUF files (tokens: its new text in the target's tokenizer); eagle3:
    the shipped EAGLE-3 head, converted by llama.cpp's own converter, drafting a chain as deep as eagle3-chain's."""
    def build(m: Models, n: int, gamma: int, lookup_tokens: int):
        from . import llama_cpp
        llama_cpp.check_available()
        tokenizer, target = m.target.tokenizer, llama_cpp.gguf_file(m.target.name)
        if eagle3:
            _check_heads_target(m)
            from ..export.llama_cpp import cached_gguf
            from ..models.hub import resolve_model
            draft = cached_gguf(shipped("heads", "eagle3-qwen2.5-coder-1.5b"), resolve_model(m.target.name))
            gamma = EAGLE_DEPTH                                          # as deep as eagle3-chain's chain
        else:
            draft = llama_cpp.gguf_file(m.draft_name) if speculative else None
        spec_type = "draft-eagle3" if eagle3 else "draft-simple"

        def run(ids: torch.Tensor) -> MethodResult:
            prompt = tokenizer.decode(ids, skip_special_tokens=False)                  # the chat-templated text
            threads = torch.get_num_threads()
            r = llama_cpp.speculative(target, draft, prompt, n, gamma, threads, spec_type) if draft is not None \
                else llama_cpp.completion(target, prompt, n, threads)
            tokens = tokenizer(r.text, add_special_tokens=False)["input_ids"]
            # its speculative program may commit a few tokens past n: keep n, and the time of the tokens kept
            share = min(n, len(tokens)) / len(tokens) if tokens else 1.0
            forwards = max(1, round(r.target_forwards * share))
            prefill = r.prefill_seconds
            return MethodResult(tokens[:n], forwards, None, r.seconds * share, None,
                                prefill + (r.seconds - prefill) * share, prefill)
        return run
    return build


HEADS_TARGET = "qwen2.5-coder-1.5b-instruct"      # the target the shipped heads (data/heads/) were trained on


def check_target(methods: list[str], target: str) -> None:
    """The methods that only run on some targets, checked before any model loads."""
    if target != HEADS_TARGET and any("heads" in method(n).needs for n in methods):
        raise ValueError(f"the shipped Medusa/EAGLE heads were trained on {HEADS_TARGET}, not {target}: "
                         "leave medusa/eagle-* out of --methods, or train heads for this target "
                         "(data/heads/README.md)")
    if any("llama-cpp" in method(n).needs for n in methods):
        from .llama_cpp import check_model
        check_model(target)


def _check_heads_target(m: Models) -> None:
    check_target(["medusa"], m.target.name)


def _eagle(top_k: int, depth: int, kind: str = "eagle"):
    """The shipped EAGLE-1 head (kind "eagle") or EAGLE-3 head ("eagle3"), drafting a tree or a chain; of a long
    prompt it reads the first 4 pairs and the last HEAD_WINDOW (drafters/eagle.py). On a GPU it drafts on the
    device, compiled and replayed as CUDA graphs (drafters/eagle_device.py)."""
    def make(m: Models, n=None):
        _check_heads_target(m)
        from ..drafters.eagle import HEAD_WINDOW, EagleDrafter
        from ..drafters.eagle_device import DeviceEagleDrafter
        from ..models.eagle_heads import load_eagle, load_eagle3
        model = m.target.model
        head, vocab, _ = (load_eagle3 if kind == "eagle3" else load_eagle)(
            shipped("heads", f"{kind}-qwen2.5-coder-1.5b"), model)
        if model.device.type == "cuda":
            return DeviceEagleDrafter(head, model, vocab, top_k=top_k, depth=depth, window=HEAD_WINDOW,
                                      compile="blocks", cuda_graph=True)
        return EagleDrafter(head, model, vocab, top_k=top_k, depth=depth, window=HEAD_WINDOW)
    return make


def _medusa(m: Models, n=None):
    _check_heads_target(m)
    from ..drafters.medusa import MedusaDrafter
    from ..models.medusa_heads import load_medusa
    heads, config = load_medusa(shipped("heads", "medusa-qwen2.5-coder-1.5b"), m.target.model)
    return MedusaDrafter(heads, [tuple(c) for c in config["choices"]])


class ForwardTimer:
    """Counts a module's forward calls and the seconds spent in them (hooks; the module is untouched)."""

    def __init__(self, module: torch.nn.Module):
        self.calls, self.seconds, self._t0 = 0, 0.0, 0.0
        module.register_forward_pre_hook(self._start)
        module.register_forward_hook(self._stop)

    def _start(self, module, args):
        self._t0 = time.perf_counter()

    def _stop(self, module, args, output):
        self.calls += 1
        self.seconds += time.perf_counter() - self._t0

    def reset(self) -> None:
        self.calls, self.seconds = 0, 0.0


def _timer(m: Models, module) -> ForwardTimer:
    if module not in m.timers:
        m.timers[module] = ForwardTimer(module)
    return m.timers[module]


def _transformers(assisted: bool = False, lookup: bool = False, cross: bool = False):
    """transformers' generate: plain, with the draft (`assisted`), with the draft of another tokenizer
    (`cross`: its universal assisted generation), or with prompt lookup."""
    def build(m: Models, n: int, gamma: int, lookup_tokens: int):
        eos = list(m.target.eos_token_ids)
        target_timer = _timer(m, m.hf_target)
        assisted_ = assisted or cross
        draft_timer = _timer(m, m.hf_cross if cross else m.hf_draft) if assisted_ else None
        extra = ({"assistant_model": m.hf_cross, "tokenizer": m.target.tokenizer,
                  "assistant_tokenizer": m.cross_draft.tokenizer} if cross else
                 {"assistant_model": m.hf_draft} if assisted else
                 {"prompt_lookup_num_tokens": lookup_tokens} if lookup else {})

        @torch.no_grad()
        def run(ids: torch.Tensor) -> MethodResult:
            for t in (target_timer, draft_timer):
                if t:
                    t.reset()
            out = m.hf_target.generate(ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=n,
                                       do_sample=False, eos_token_id=eos, pad_token_id=eos[0], **extra)  # (1, T+n)
            return MethodResult(out[0, ids.numel():].tolist(), target_timer.calls,
                                draft_timer.seconds if assisted_ else (None if lookup else 0.0), target_timer.seconds)
        return run
    return build


# tree sizes: chosen where a wide verify cost little more than a one-token pass; on other CPUs it costs far more
# (docs/forward-paths.md), which the cost-aware budgets price
MEDUSA_BUDGET, EAGLE_TOP_K, EAGLE_DEPTH, EAGLE_BUDGET, SUFFIX_BUDGET = 32, 8, 6, 32, 24
# lookahead (W Jacobi columns, n-grams of N, G verified: (N-1)(W+G) tree nodes at most): 12 nodes, which cost about
# one 1-token forward on the AVX-512 CPUs measured (verify-cost), and a wider window nearer the paper's GPU settings
LOOKAHEAD, LOOKAHEAD_WIDE = (3, 3, 3), (5, 4, 4)
def _given(gamma: int) -> int:
    """The run's --gamma, fixed."""
    return gamma


_D, _HF, _HFD, _H = frozenset({"draft"}), frozenset({"hf"}), frozenset({"hf", "hf_draft"}), frozenset({"heads"})
_LC = frozenset({"llama-cpp"})
_AR = frozenset({"arctic"})
_X, _HFX = frozenset({"cross_draft"}), frozenset({"hf", "hf_cross", "cross_draft"})
_OWN = dict(loop="own")
METHODS: dict[str, Method] = {m.name: m for m in [
    Method("ar", "labkit autoregressive", frozenset(), build=_autoregressive, **_OWN),
    Method("draft", "labkit draft model, γ={gamma}", _D, _draft_model, _given),
    Method("draft-heuristic", "labkit draft, heuristic γ", _D, _draft_model, HeuristicGamma),
    Method("draft-cost-aware", "labkit draft, cost-aware γ", _D, _draft_model, CostAwareGamma),
    Method("lookup", "labkit prompt lookup, γ={gamma}", frozenset(), _lookup, _given),
    Method("lookup-cost-aware", "labkit prompt lookup, cost-aware γ", frozenset(), _lookup, CostAwareGamma),
    Method("cross-tokenizer", "labkit draft with another tokenizer (SmolLM2-135M), γ={gamma}", _X,
           _cross_tokenizer, _given),
    Method("token-intersection", "labkit draft with another tokenizer, shared tokens only (SmolLM2-135M), γ={gamma}",
           _X, _token_intersection, _given),
    Method("layer-skip", "labkit layer-skip self-speculation (layers, γ searched here)", frozenset(),
           build=_layer_skip, **_OWN),
    Method("suffix", "labkit suffix decoding (this request)", frozenset(), _suffix(False), SUFFIX_BUDGET, "tree"),
    Method("arctic-suffix", "Arctic Inference suffix decoding (this request), labkit's verify", _AR,
           _arctic_suffix, SUFFIX_BUDGET, "tree"),
    Method("suffix-global", "labkit suffix decoding (+ earlier answers)", frozenset(), _suffix(True), SUFFIX_BUDGET,
           "tree"),
    Method("suffix-cost-aware", "labkit suffix decoding, trees up to 64 nodes, cost-aware budget", frozenset(),
           _suffix(False, spec_factor=6.0), _cost_aware(64), "tree"),
    Method("lookahead", "labkit lookahead decoding (W={}, N={}, G={})".format(*LOOKAHEAD), frozenset(),
           _lookahead(*LOOKAHEAD), 64, "tree"),
    Method("lookahead-wide", "labkit lookahead decoding (W={}, N={}, G={})".format(*LOOKAHEAD_WIDE), frozenset(),
           _lookahead(*LOOKAHEAD_WIDE), 64, "tree"),
    Method("lookahead-prompt", "labkit lookahead decoding (W={}, N={}, G={}), pool seeded with the prompt's "
           "n-grams".format(*LOOKAHEAD), frozenset(), _lookahead(*LOOKAHEAD, from_prompt=True), 64, "tree"),
    Method("medusa", "labkit Medusa-1 heads, static tree", _H, _medusa, MEDUSA_BUDGET, "tree"),
    Method("medusa-cost-aware", "labkit Medusa-1 heads, trees up to 40 nodes, cost-aware budget", _H,
           _medusa, _cost_aware(40), "tree"),
    # a chain of EAGLE_DEPTH on the tree loop (which gives the features): not a tree method for the report
    Method("eagle-chain", "labkit EAGLE head, chain of 6", _H, _eagle(top_k=1, depth=EAGLE_DEPTH), EAGLE_DEPTH,
           "tree"),
    Method("eagle-tree", "labkit EAGLE-2 dynamic tree", _H, _eagle(top_k=EAGLE_TOP_K, depth=EAGLE_DEPTH),
           EAGLE_BUDGET, "tree"),
    Method("eagle-cost-aware", "labkit EAGLE-2 dynamic tree, up to 64 nodes, cost-aware budget", _H,
           _eagle(top_k=EAGLE_TOP_K, depth=EAGLE_DEPTH), _cost_aware(64), "tree"),
    Method("eagle3-chain", "labkit EAGLE-3 head, chain of 6", _H, _eagle(top_k=1, depth=EAGLE_DEPTH, kind="eagle3"),
           EAGLE_DEPTH, "tree"),
    Method("eagle3-tree", "labkit EAGLE-3 head, EAGLE-2 dynamic tree", _H,
           _eagle(top_k=EAGLE_TOP_K, depth=EAGLE_DEPTH, kind="eagle3"), EAGLE_BUDGET, "tree"),
    Method("eagle3-cost-aware", "labkit EAGLE-3 head, dynamic tree up to 64 nodes, cost-aware budget", _H,
           _eagle(top_k=EAGLE_TOP_K, depth=EAGLE_DEPTH, kind="eagle3"), _cost_aware(64), "tree"),
    Method("hf-generate", "transformers generate", _HF, build=_transformers(), reference=PEER_BASELINE, **_OWN),
    Method("hf-assisted", "transformers assisted", _HFD, build=_transformers(assisted=True),
           reference=PEER_BASELINE, **_OWN),
    Method("hf-assisted-uag", "transformers assisted, another tokenizer (SmolLM2-135M)", _HFX,
           build=_transformers(cross=True), reference=PEER_BASELINE, **_OWN),
    Method("hf-lookup", "transformers prompt lookup, {lookup_tokens} tokens", _HF, build=_transformers(lookup=True),
           reference=PEER_BASELINE, **_OWN),
    Method("llama-cpp", "llama.cpp autoregressive (Q4_K_M)", _LC, build=_llama_cpp(), reference=LLAMA_BASELINE,
           **_OWN),
    Method("llama-cpp-draft", "llama.cpp draft model, γ={gamma} (Q4_K_M)", _LC, build=_llama_cpp(speculative=True),
           reference=LLAMA_BASELINE, **_OWN),
    Method("llama-cpp-eagle3", "llama.cpp EAGLE-3 head (labkit's, exported), chain of 6 (Q4_K_M)", _LC | _H,
           build=_llama_cpp(eagle3=True), reference=LLAMA_BASELINE, **_OWN),
]}


@dataclass(frozen=True)
class Variant:
    """An ablation: a method with one speed choice changed, run beside it so that what the choice buys is measured
    in the same run (`bench --variant NAME`). Its results are keyed METHOD-NAME."""
    name: str
    label: str                           # added to the method's label
    of: tuple[str, ...]                  # the methods it varies
    drafter: dict = field(default_factory=dict)   # keyword arguments of the method's drafter factory
    loop: str | None = None              # another loop for the method (None: its own)

    def apply(self, method: Method) -> Method:
        if method.name not in self.of:
            raise ValueError(f"the {self.name} variant varies {', '.join(self.of)}, not {method.name}")
        drafter = partial(method.drafter, **self.drafter) if self.drafter else method.drafter
        return replace(method, name=f"{method.name}-{self.name}", label=f"{method.label}, {self.label}",
                       drafter=drafter, loop=self.loop or method.loop, build=None)


_DRAFTS = ("draft", "draft-heuristic", "draft-cost-aware")
VARIANTS: dict[str, Variant] = {v.name: v for v in [
    Variant("gated", "gated per category", ("draft-cost-aware",), loop="gated"),
    Variant("all-ids", "scoring every token id", _DRAFTS, {"vocab": False}),
    Variant("whole", "reading the whole context", _DRAFTS, {"window": False}),
    Variant("rereads", "rereading the chat opening", _DRAFTS, {"opening": False}),
]}


def method(name: str) -> Method:
    """The method of this name: a registered one, or a variant of one (METHOD-VARIANT); KeyError where neither."""
    if name in METHODS:
        return METHODS[name]
    for v in VARIANTS.values():
        base = name.removesuffix(f"-{v.name}")
        if base != name and base in v.of:
            return v.apply(METHODS[base])
    raise KeyError(name)


def with_variants(names: list[str], variants: list[str]) -> list[str]:
    """`names` and, after each method a variant varies, that variant of it (bench --variant)."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    out = []
    for n in names:
        out.append(n)
        out += [f"{n}-{v}" for v in variants if n in VARIANTS[v].of and f"{n}-{v}" not in names]
    if variants and out == names:
        raise ValueError(f"--variant {','.join(variants)} varies none of the chosen methods: it varies "
                         + "; ".join(f"{v}: {', '.join(VARIANTS[v].of)}" for v in variants))
    return out


HF_NEEDS = frozenset({"hf", "hf_draft", "hf_cross"})


def default_methods(target: str, dtype: str = "bf16") -> list[str]:
    """Every method that runs on `target`: the trained-head methods only on the target they were trained on,
    llama.cpp's where it is built and the target is a preset (it reads the preset's GGUF), the draft with another
    tokenizer for the presets other than that draft itself, Arctic's suffix cache where `make arctic` built it,
    transformers' peers unless the target is quantized."""
    from ..drafters.arctic_suffix import available as arctic_available
    from ..models.backends import QUANTIZED
    from ..models.hub import PRESETS
    from .llama_cpp import available
    return [n for n, m in METHODS.items() if ("heads" not in m.needs or target == HEADS_TARGET)
            and ("llama-cpp" not in m.needs or (target in PRESETS and available()))
            and ("arctic" not in m.needs or arctic_available())
            and ("cross_draft" not in m.needs or (target in PRESETS and target != CROSS_DRAFT))
            and not (dtype in QUANTIZED and m.needs & HF_NEEDS)]


def check_dtype(names: list[str], dtype: str) -> None:
    """transformers' peers run the target as its checkpoint stores it: not a labkit-quantized model."""
    from ..models.backends import QUANTIZED
    peers = [n for n in names if method(n).needs & HF_NEEDS]
    if dtype in QUANTIZED and peers:
        raise ValueError(f"{', '.join(peers)} run transformers' model, which has no {dtype} weights of labkit's: "
                         f"with --dtype {dtype} leave them out of --methods (llama.cpp's rows are the 4-bit peers)")


def check_methods(names: list[str]) -> list[str]:
    """The chosen methods in run order, the baseline first (speedups need it), or a clear error."""
    if not names:
        raise ValueError(f"--methods names no method: choose one or more of {', '.join(METHODS)} (comma-separated), "
                         "or leave --methods out to run every method")
    unknown = [n for n in names if not known(n)]
    if unknown:
        raise ValueError(f"unknown methods {unknown}: choose from {', '.join(METHODS)}, or a variant of one, "
                         "METHOD-VARIANT (python -m labkit methods lists them)")
    chosen = {n: method(n) for n in names}
    if any("llama-cpp" in m.needs for m in chosen.values()):
        from .llama_cpp import check_available
        check_available()
    if any("arctic" in m.needs for m in chosen.values()):
        from ..drafters.arctic_suffix import check_available as check_arctic
        check_arctic()
    wanted = {BASELINE, *names, *(m.reference for m in chosen.values())}
    return sorted(wanted, key=run_order)       # registry order (each reference before its family), variants after


def run_order(name: str) -> tuple[int, int]:
    """(the registry's place of the method, 0; or of the method a variant varies, 1 + the variant's place)."""
    registry, variants = list(METHODS), list(VARIANTS)
    if name in METHODS:
        return registry.index(name), 0
    v = next(v for v in variants if name.endswith(f"-{v}") and name[:-len(v) - 1] in METHODS)
    return registry.index(name[:-len(v) - 1]), 1 + variants.index(v)


def known(name: str) -> bool:
    try:
        method(name)
    except KeyError:
        return False
    return True
