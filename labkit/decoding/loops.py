"""Which loop decodes a request: on a GPU the compiled one (static caches, torch.compile, CUDA graphs), elsewhere
the eager reference loops, and the reason for the choice.

    gen, loop = decode(target, DraftModelDrafter(draft), prompt_ids, 64, gamma=4)     # loop: ("compiled", why)

On a GPU an eager step launches a few hundred small kernels from Python and is bound by the launches, not by
memory: labkit's compiled loops run many times faster there (docs/hardware.md). On a CPU the eager loops are
the fast ones (a kernel launch costs nothing beside a CPU matmul) and stay the default. The compiled loops cover
greedy plain decoding (`StaticDecoder`), chain drafters greedy or sampled (`CompiledSpeculativeDecoder`, γ <= 8),
and tree drafters that read no other features than the final hidden states, greedy or sampled over trees of top-k
picks (`CompiledTreeDecoder`, up to 64 nodes); a request outside them runs on the eager loop, and the returned
reason says why. loop="eager" or "compiled" forces one (the compiled one raises when it cannot take the request).
The compiled decoders are kept per model and cache size, so a second request reuses their compiled shapes and
graphs.
"""
from __future__ import annotations

import torch

from ..core.adaptive import FixedGamma, GammaPolicy
from ..core.sampling import GREEDY, SamplingConfig
from ..core.tree_budget import BudgetPolicy
from ..drafters.base import Drafter
from ..models.transformer import Transformer
from .autoregressive import autoregressive_generate
from .base import Generation
from .compiled import MAX_GAMMA, CompiledSpeculativeDecoder, device_parts
from .compiled_tree import MAX_NODES, CompiledTreeDecoder, feature_taps
from .speculative import speculative_generate
from .static import StaticDecoder
from .tree import tree_generate

LOOPS = ("auto", "eager", "compiled")
_KEPT: dict = {}                  # kind -> (model, max_len, decoder): the last compiled decoder of each kind


def why_not_compiled(model, drafter: Drafter | None, gamma, sampling: SamplingConfig, tree: bool) -> str | None:
    """None when the compiled loops take this request, else what keeps it on the eager loop."""
    if not isinstance(model, Transformer):
        return f"the target is {type(model).__name__}, not labkit's Transformer (a static cache needs its forward)"
    if drafter is None:
        return None if sampling.greedy else "the compiled plain loop decodes greedily"
    if drafter.needs.verdict:
        return f"the {drafter.name} drafter reads the target's verdict on every node"
    if getattr(gamma, "eager_only", False):
        return f"the {gamma.name} policy proposes unverified on plain steps, which only the eager loops do"
    if tree:
        if not sampling.greedy and drafter.needs.samples_tokens:
            return (f"the {drafter.name} drafter samples its tokens (when sampling, the compiled tree loop accepts "
                    "trees of top-k picks)")
        try:
            feature_taps(model, drafter)
        except ValueError:
            return f"the {drafter.name} drafter reads a target of its own"
        nodes = gamma if isinstance(gamma, int) else gamma.max_budget
        return None if nodes <= MAX_NODES else f"a tree of {nodes} nodes (the compiled verify has up to {MAX_NODES})"
    if drafter.needs.features:
        return f"the {drafter.name} drafter reads the target's features: decode it as a tree (tree=True)"
    try:
        device_parts(drafter)
    except ValueError as e:
        return str(e)
    longest = gamma if isinstance(gamma, int) else gamma.k if isinstance(gamma, FixedGamma) else \
        getattr(gamma, "max_gamma", None)
    if longest is None or longest > MAX_GAMMA:
        return (f"up to {longest or 'any number of'} draft tokens a step (the compiled verify has shapes for up to "
                f"{MAX_GAMMA}: give the γ policy max_gamma <= {MAX_GAMMA})")
    return None


def choose_loop(model, drafter: Drafter | None, gamma, sampling: SamplingConfig = GREEDY, tree: bool = False,
                loop: str = "auto") -> tuple[str, str]:
    """("eager" or "compiled", the reason) for this request: `loop`, or for "auto" compiled on a GPU where it can."""
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {LOOPS}, got {loop!r}")
    blocker = why_not_compiled(model, drafter, gamma, sampling, tree)
    if loop == "compiled":
        if blocker:
            raise ValueError(f"the compiled loop cannot decode this request: {blocker}; use loop='eager'")
        return "compiled", "asked for"
    if loop == "eager":
        return "eager", "asked for"
    device = getattr(model, "device", torch.device("cpu"))
    if device.type != "cuda":
        return "eager", f"on {'a CPU' if device.type == 'cpu' else device.type}, where launching a kernel costs little"
    if blocker:
        return "eager", blocker
    return "compiled", "on a GPU: static caches, torch.compile a block at a time, CUDA graphs"


def decode(model, drafter: Drafter | None, prompt_ids: torch.Tensor, max_new_tokens: int,
           gamma: int | GammaPolicy | BudgetPolicy = 4, sampling: SamplingConfig = GREEDY,
           eos_token_ids: tuple[int, ...] = (), seed: int | None = None, tree: bool = False, loop: str = "auto",
           compile_backend: str = "inductor") -> tuple[Generation, tuple[str, str]]:
    """Decode one request on the loop `choose_loop` picks: (the generation, (loop, reason)).

    drafter None: plain decoding. tree: the drafter proposes trees and `gamma` is the node budget (an int or a
    budget policy). On CUDA the compiled loops compile a block at a time and record CUDA graphs; on a CPU
    (loop="compiled") they compile with `compile_backend` (inductor), without graphs.
    """
    chosen = choose_loop(model, drafter, gamma, sampling, tree, loop)
    if chosen[0] == "eager":
        if drafter is None:
            gen = autoregressive_generate(model, prompt_ids, max_new_tokens, sampling, eos_token_ids, seed)
        elif tree:
            gen = tree_generate(model, drafter, prompt_ids, max_new_tokens, gamma, sampling, eos_token_ids, seed)
        else:
            gen = speculative_generate(model, drafter, prompt_ids, max_new_tokens, gamma, sampling, eos_token_ids,
                                       seed)
        return gen, chosen
    n = torch.as_tensor(prompt_ids).numel() + max_new_tokens + MAX_NODES
    max_len = 1 << max(10, (n - 1).bit_length())                 # a few cache sizes, so a few compiles
    how = dict(compile="blocks", cuda_graph=model.device.type == "cuda", compile_backend=compile_backend)
    if drafter is None:
        max_len = min(max_len, model.max_seq_len)
        dec = _kept("plain", model, max_len, lambda: StaticDecoder(model, max_len, **how))
        return dec.generate(prompt_ids, max_new_tokens, eos_token_ids=eos_token_ids), chosen
    if tree:
        dec = _kept("tree", model, max_len, lambda: CompiledTreeDecoder(model, drafter, max_len, **how))
        dec.use_drafter(drafter)
        return dec.generate(prompt_ids, max_new_tokens, gamma, sampling, eos_token_ids, seed), chosen
    dec = _kept("chain", model, max_len, lambda: CompiledSpeculativeDecoder(model, drafter, max_len, **how))
    dec.use_drafter(drafter)
    policy = gamma if isinstance(gamma, GammaPolicy) else FixedGamma(gamma)
    return dec.generate(prompt_ids, max_new_tokens, policy, sampling, eos_token_ids, seed), chosen


def _kept(kind: str, model, max_len: int, build):
    """The last compiled decoder of this kind when it decodes this model at this cache size, else a new one
    (keeping one decoder a kind keeps at most one model alive beyond its user)."""
    kept = _KEPT.get(kind)
    if kept is None or kept[0] is not model or kept[1] != max_len:
        _KEPT[kind] = (model, max_len, build())
    return _KEPT[kind][2]
