"""EAGLE-3 (Li et al. 2025): fused low, middle and high features, and training-time test.

EAGLE-1/2's head (eagle.py) predicts the target's next final feature and drafts on its own
predictions; one step later those drift, and acceptance falls with depth. EAGLE-3 changes two
things, both kept here:

1. Input: the outputs of three target blocks, low, middle and high, concatenated and fused,
       g_t = fuse(concat(h^low_t, h^mid_t, h^high_t))                  # (3D,) -> (D,)
   in place of the final feature. The head no longer has to reproduce any target feature: it
   is trained on tokens only (the target's greedy next token), and what it feeds itself at the
   next depth is its own layer output a_t (before the final norm), not a feature estimate:
       a_t = Layer(fc(concat(embed(x_{t+1}), g_t or a_{t-1})))          # one decoder layer
       draft logits = norm(a_t) @ lm_rows.T                             # the target's frozen LM-head rows
2. Training-time test (`unrolled_logits`): training unrolls the head K steps on its own outputs,
   so that what it sees in training is what it sees when drafting. Step 0 reads the fused target
   features at every position t; step k reads its own step k-1 output at t with the token
   x_{t+1+k}, at RoPE position t+k, and attends to the target-fed entries up to t and to its own
   entries of steps 1..k at t: exactly what a chain drafted k deep from root t attends to.

Two departures from the reference code, both for a 2-core CPU: the layer is the target's
standard block behind an fc (as in eagle.py) where EAGLE-3 feeds the 2D concatenation to the
attention's projections; and the LM head is the target's own rows over the draft vocabulary,
frozen, where EAGLE-3 trains its own (a 32k-token head alone would be ~100 MB in bf16).

Drafting is EAGLE-2's dynamic tree, unchanged (eagle.EagleDrafter with this head). The tree loop
gives the drafter every committed position's features; `LayerTapsTarget` makes those the three
blocks' outputs (plus the final feature the LM head reads), in the same target forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models.kv_cache import KVCache
from ..models.layers import rope_cos_sin
from ..models.target import TreeTarget
from ..models.transformer import Transformer, positions_and_mask
from .eagle import EagleConfig, EagleHead, load_eagle


def default_layers(n_layers: int) -> tuple[int, int, int]:
    """Low, middle and high block indices (0-based), as EAGLE-3's code picks them: 1, n/2 - 1, n - 4."""
    if n_layers < 5:
        raise ValueError(f"EAGLE-3 taps three distinct blocks below the last three: need >= 5 layers, got {n_layers}")
    return 1, n_layers // 2 - 1, n_layers - 4


def check_layers(layers, n_layers: int) -> tuple[int, int, int]:
    layers = tuple(int(i) for i in layers)
    if len(layers) != 3 or len(set(layers)) != 3 or any(not 0 <= i < n_layers for i in layers):
        raise ValueError(f"EAGLE-3 fuses three distinct blocks of the target's {n_layers} (0-based), e.g. "
                         f"{default_layers(n_layers) if n_layers >= 5 else (0, 1, 2)}; got {list(layers)}")
    return tuple(sorted(layers))


@torch.no_grad()
def layer_taps(model: Transformer, tokens: torch.Tensor, cache: KVCache, layers: tuple[int, ...],
               positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T, (len(layers) + 1) D): the outputs of blocks `layers` and the final normed hidden state, of tokens
    (B, T) after the cache (which advances); one forward of the target, on its own forward path."""
    positions, mask = positions_and_mask(tokens, cache, positions, mask)
    cos, sin = rope_cos_sin(positions, model.args.head_dim, model.args.rope_theta, model.embed_tokens.weight.dtype)
    x, taps = model.embed_tokens(tokens), []                                            # (B, T, D)
    for i, block in enumerate(model.layers):
        x = block(x, cos, sin, cache, i, mask)
        if i in layers:
            taps.append(x)
    cache.advance(tokens.shape[1])
    return torch.cat(taps + [model.norm(x)], dim=-1)


class LayerTapsTarget(TreeTarget):
    """labkit's Transformer for the tree loop, with features (T, 4D) = three blocks' outputs and the final one."""

    def __init__(self, model: Transformer, layers: tuple[int, ...]):
        self.model, self.layers = model, check_layers(layers, model.args.n_layers)
        self.feature_dim = (len(self.layers) + 1) * model.args.dim
        self.feature_dtype = model.embed_tokens.weight.dtype

    def features(self, tokens, cache, positions=None, mask=None):
        return layer_taps(self.model, tokens, cache, self.layers, positions, mask)[0]  # (T, 4D)

    def logits(self, features):
        return self.model.lm_head(features[..., -self.model.args.dim:]).float()         # (T, V)


class Eagle3Head(EagleHead):
    """EagleHead + the fusion of three target blocks; feeds itself its layer output, reads out its norm."""
    kind = "eagle3"

    def __init__(self, cfg: EagleConfig, vocab_size: int, max_seq_len: int = 4096):
        if len(cfg.layers) != 3:
            raise ValueError(f"an EAGLE-3 head fuses three target blocks: set EagleConfig.layers, got {cfg.layers}")
        super().__init__(cfg, vocab_size, max_seq_len)
        self.fuse = nn.Linear(3 * cfg.dim, cfg.dim, bias=False)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """g_t (..., D) from the tapped features (..., 3D) or (..., 4D) (the final feature is not used)."""
        return self.fuse(features[..., : 3 * self.cfg.dim])

    def readout_input(self, out: torch.Tensor) -> torch.Tensor:
        return self.norm(out)

    def forward(self, features, token_embeds, cache, positions=None, mask=None):
        """The layer output a (B, T, D): fed back at the next depth; the LM head reads norm(a)."""
        return self.layer(features, token_embeds, cache, positions, mask)

    def tree_target(self, target: TreeTarget) -> TreeTarget:
        if isinstance(target, LayerTapsTarget) and target.layers == tuple(self.cfg.layers):
            return target
        if not isinstance(target.model, Transformer):
            raise TypeError("EAGLE-3 reads three of the target's blocks: decode with labkit's native model")
        return LayerTapsTarget(target.model, tuple(self.cfg.layers))


class GradCache:
    """A one-layer KV cache that grows by concatenation, out of place, so that gradients flow through every
    unrolled step (KVCache writes into a preallocated buffer in place, which autograd cannot differentiate)."""

    def __init__(self):
        self.k = self.v = None
        self.length = 0

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        self.k = k_new if self.k is None else torch.cat([self.k, k_new], dim=2)          # (B, Hkv, S, hd)
        self.v = v_new if self.v is None else torch.cat([self.v, v_new], dim=2)
        return self.k, self.v

    def advance(self, n_tokens: int) -> None:
        self.length += n_tokens


def load_eagle3(path, target: Transformer) -> tuple[Eagle3Head, torch.Tensor, dict]:
    """(head, draft vocabulary (Vd,), config) of an EAGLE-3 head saved with eagle.save_eagle."""
    return load_eagle(path, target, Eagle3Head)


def unrolled_masks(n: int, k: int) -> torch.Tensor:
    """(n, (k+1) n) bool: step k's query at t sees the target-fed entries <= t and its own entries at t of
    steps 1..k (the training-time test's attention: a chain k deep from root t sees exactly these)."""
    t = torch.arange(n)
    causal = t[None, :] <= t[:, None]                                                  # (n, n)
    return torch.cat([causal] + [torch.eye(n, dtype=torch.bool)] * k, dim=1)


def unrolled_logits(head: Eagle3Head, embed: nn.Embedding, lm_rows: torch.Tensor, tokens: torch.Tensor,
                    taps: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Training-time test: [step k's draft logits (B, n, Vd) for k < steps], n = T - 1 roots t = 0..T-2.

    tokens (B, T); taps (B, T, 3D) the target's tapped features. Step k at root t reads x_{t+1+k} (clamped at
    the end; those rows have no label) and predicts the target's token after it, target_next[t+1+k]."""
    if steps < 1:
        raise ValueError(f"steps (training-time test depth) must be >= 1, got {steps}")
    B, T = tokens.shape
    n = T - 1
    t = torch.arange(n, device=tokens.device)
    a = head.context(taps[:, :n])                                                      # (B, n, D) step 0 input
    cache = GradCache()
    out = []
    for k in range(steps):
        ids = tokens[:, (t + 1 + k).clamp(max=T - 1)]                                  # (B, n)
        positions = (t + k).expand(B, n)                                               # (B, n)
        a = head(a, embed(ids).to(a.dtype), cache, positions, unrolled_masks(n, k).to(a.device))  # (B, n, D)
        out.append(head.readout_input(a) @ lm_rows.T.to(a.dtype))                      # (B, n, Vd)
    return out


@dataclass
class TTTLoss:
    loss: torch.Tensor                # the weighted mean over steps of the cross-entropy
    per_step: list[float]             # cross-entropy of each step
    correct: list[int]                # top-1 hits of each step
    count: list[int]                  # labelled rows of each step


def eagle3_loss(head: Eagle3Head, embed: nn.Embedding, lm_rows: torch.Tensor, vocab_map: torch.Tensor,
                tokens: torch.Tensor, taps: torch.Tensor, target_next: torch.Tensor, steps: int = 1,
                decay: float = 0.8) -> TTTLoss:
    """Cross-entropy against the target's greedy tokens at each unrolled step, step k weighted decay**k
    (the reference weights deeper steps less too). labels outside the draft vocabulary are skipped."""
    B, T = tokens.shape
    t = torch.arange(T - 1, device=tokens.device)
    losses, per_step, correct, count = [], [], [], []
    for k, logits in enumerate(unrolled_logits(head, embed, lm_rows, tokens, taps, steps)):
        idx = t + 1 + k                                                                # (n,)
        labels = vocab_map[target_next[:, idx.clamp(max=T - 1)]]                        # (B, n)
        valid = (labels >= 0) & (idx <= T - 1)                                          # (B, n)
        ce = F.cross_entropy(logits[valid].float(), labels[valid])
        losses.append(decay ** k * ce)
        per_step.append(float(ce.detach()))
        correct.append(int((logits.argmax(-1) == labels)[valid].sum()))
        count.append(int(valid.sum()))
    loss = sum(losses) / sum(decay ** k for k in range(steps))
    return TTTLoss(loss, per_step, correct, count)
