"""The target with some of its layers skipped: a cheaper model that shares every weight with it.

Self-speculative decoding by layer skipping (Draft & Verify, Zhang et al. 2024; SWIFT, Xia et
al. 2025) drafts with the target itself, minus a set of its transformer blocks: the residual
stream simply passes a skipped block by. No second model is loaded; the embedding, the kept
blocks, the final norm and the LM head are the target's own tensors. The skipped model keeps
its own KV cache, one layer per kept block.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from ..core.adaptive import expected_speedup
from .calibrate import time_forwards
from .kv_cache import KVCache
from .layers import rope_cos_sin
from .transformer import Transformer, positions_and_mask


class LayerSkipModel:
    """`target` running only the blocks not in `skip`; a Target (vocab, context, device, cache, forward)."""

    def __init__(self, target: Transformer, skip: tuple[int, ...] | list[int]):
        n = target.args.n_layers
        skip = sorted(set(int(i) for i in skip))
        if any(not 0 <= i < n for i in skip):
            raise ValueError(f"layers to skip must lie in [0, {n}) for a {n}-layer target, got {skip}")
        if len(skip) >= n:
            raise ValueError(f"skipping all {n} layers leaves no model: keep at least one")
        self.target, self.skip = target, tuple(skip)
        self.keep = [i for i in range(n) if i not in self.skip]

    vocab_size = property(lambda self: self.target.vocab_size)
    max_seq_len = property(lambda self: self.target.max_seq_len)
    device = property(lambda self: self.target.device)

    @property
    def layer_fraction(self) -> float:
        """Kept blocks / all blocks (the LM head runs either way)."""
        return len(self.keep) / self.target.args.n_layers

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        a, p = self.target.args, self.target.embed_tokens.weight
        return KVCache(len(self.keep), batch_size, a.n_kv_heads, max_len or a.max_seq_len, a.head_dim, p.dtype,
                       p.device)

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None, num_logits: int | None = None) -> torch.Tensor:
        """Logits (B, T', V) of tokens (B, T) after the cache, through the kept blocks only."""
        t, T = self.target, tokens.shape[1]
        positions, mask = positions_and_mask(tokens, cache, positions, mask)
        cos, sin = rope_cos_sin(positions, t.args.head_dim, t.args.rope_theta, t.embed_tokens.weight.dtype)
        x = t.embed_tokens(tokens)                                                        # (B, T, D)
        for slot, i in enumerate(self.keep):
            x = t.layers[i](x, cos, sin, cache, slot, mask)                               # cache layer = slot
        cache.advance(T)
        h = t.norm(x)                                                                     # (B, T, D)
        if num_logits is not None:
            h = h[:, -num_logits:].clone(memory_format=torch.contiguous_format)
        return t.lm_head(h).float()                                                       # (B, T', V)


GAMMAS = (1, 2, 3, 4, 6, 8)
CALIBRATION_TOKENS = 256          # of Python's textwrap.py, what the search reads teacher-forced


@dataclass
class SkipSearch:
    """What the search found: the skip order, and per depth the agreement, the cost and the predicted speedup."""
    order: list[int]                 # layers in the order the search skipped them
    agreement: list[float]           # [i]: top-1 agreement with the target with order[:i+1] skipped
    cost: list[float]                # [i]: one-token forward with order[:i+1] skipped / the target's
    verify_cost: dict[int, float]    # γ -> a (γ+1)-token target forward / a one-token one
    predicted: list[dict[int, float]] = field(default_factory=list)   # [i]: γ -> Leviathan's speedup
    calibration_tokens: int = 0

    def __post_init__(self):
        if not self.predicted:
            self.predicted = [{g: expected_speedup(min(a, 0.999), g, c, self.verify_cost[g]) for g in self.verify_cost}
                              for a, c in zip(self.agreement, self.cost)]

    @property
    def best(self) -> tuple[int, int]:
        """(layers skipped, γ) with the highest predicted speedup."""
        return max(((i + 1, g) for i, row in enumerate(self.predicted) for g in row),
                   key=lambda ig: self.predicted[ig[0] - 1][ig[1]])

    @property
    def skip(self) -> tuple[int, ...]:
        return tuple(sorted(self.order[: self.best[0]]))

    @property
    def gamma(self) -> int:
        return self.best[1]

    def to_dict(self) -> dict:
        n, g = self.best
        return {**asdict(self), "chosen": {"skip": list(self.skip), "n_skipped": n, "gamma": g,
                                           "agreement": self.agreement[n - 1], "cost": self.cost[n - 1],
                                           "predicted_speedup": self.predicted[n - 1][g]}}


@torch.no_grad()
def agreement(model, ids: torch.Tensor, reference: torch.Tensor) -> float:
    """Teacher-forced top-1 agreement of `model`'s next-token argmax with `reference` (T,) over ids (T,)."""
    cache = model.new_cache(max_len=ids.numel())
    guess = model(ids[None].to(model.device), cache)[0].argmax(-1).cpu()                 # (T,)
    return float((guess == reference).float().mean())


@torch.no_grad()
def search_skip_layers(target: Transformer, calibration_ids: torch.Tensor, max_skip: int | None = None,
                       gammas: tuple[int, ...] = GAMMAS, repeats: int = 3, progress: bool = True) -> SkipSearch:
    """Greedy layer-skip search on this machine: which layers, how many, and γ (see the module docstring).

    calibration_ids: (T,) token ids the target reads teacher-forced (a few hundred are enough);
    max_skip: the deepest skip tried (default: half the layers).
    """
    n = target.args.n_layers
    max_skip = n // 2 if max_skip is None else max_skip
    if not 1 <= max_skip < n:
        raise ValueError(f"max_skip must be in [1, {n - 1}] for a {n}-layer target, got {max_skip}")
    ids = torch.as_tensor(calibration_ids).long().flatten()
    if ids.numel() < 16:
        raise ValueError(f"calibrate on at least 16 tokens, got {ids.numel()}: pass a longer text")
    reference = target(ids[None].to(target.device), target.new_cache(max_len=ids.numel()))[0].argmax(-1).cpu()
    order, agree = [], []
    for _ in tqdm(range(max_skip), desc="layer-skip search", disable=not progress):
        scores = {layer: agreement(LayerSkipModel(target, order + [layer]), ids, reference)
                  for layer in range(n) if layer not in order}
        layer = max(scores, key=lambda i: (scores[i], -i))                 # ties: the lower layer
        order.append(layer)
        agree.append(scores[layer])
    context = min(256, target.max_seq_len // 2)
    full = time_forwards(target, context, tuple(sorted({1, *(g + 1 for g in gammas)})), repeats, progress=False)
    cost = [time_forwards(LayerSkipModel(target, order[: i + 1]), context, (1,), repeats, progress=False)[1] / full[1]
            for i in tqdm(range(max_skip), desc="timing the skipped models", disable=not progress)]
    return SkipSearch(order, agree, cost, {g: full[g + 1] / full[1] for g in gammas},
                      calibration_tokens=ids.numel())


def calibration_ids(tokenizer, n_tokens: int = CALIBRATION_TOKENS) -> torch.Tensor:
    """Calibration text on every machine: Python's own `textwrap.py` (code, and English in its docstrings)."""
    import inspect
    import textwrap
    ids = tokenizer(inspect.getsource(textwrap), add_special_tokens=False)["input_ids"][:n_tokens]
    return torch.tensor(ids)
