"""EAGLE's draft heads (Li et al. 2024 and 2025), the modules and their checkpoints.

EAGLE-1/2 (`EagleHead`): the target's final hidden state f_t (the "feature" its LM head reads)
is far more predictable than its next token. The head takes the pair (f_t, x_{t+1}), feature and
the token it led to,
    g_t = fc(concat(embed(x_{t+1}), f_t))             # (D,) the target's embedding, frozen
    f̂_{t+1} = norm(Block(g_{<=t}))                   # one decoder layer with its own KV cache
and reads the next token off f̂_{t+1} with the target's frozen LM head. Drafting continues on
its own predicted features: (f̂_{t+1}, x_{t+2}) -> f̂_{t+2}, and so on.

EAGLE-3 (`Eagle3Head`) changes the input: the outputs of three target blocks, low, middle and
high, concatenated and fused,
    g_t = fuse(concat(h^low_t, h^mid_t, h^high_t))                  # (3D,) -> (D,)
in place of the final feature. It is trained on tokens only (the target's greedy next token),
with training-time test (labkit.training.eagle_loss), and what it feeds itself at the next depth
is its own layer output a_t (before the final norm), not a feature estimate:
    a_t = Layer(fc(concat(embed(x_{t+1}), g_t or a_{t-1})))          # one decoder layer
    draft logits = norm(a_t) @ lm_rows.T                             # the target's frozen LM-head rows
Two departures from the reference code, both for a 2-core CPU: the layer is the target's
standard block behind an fc where EAGLE-3 feeds the 2D concatenation to the attention's
projections; and the LM head is the target's own rows over the draft vocabulary, frozen, where
EAGLE-3 trains its own (a 32k-token head alone would be ~100 MB in bf16).

Both draft through `labkit.drafters.eagle.EagleDrafter` (EAGLE-2's dynamic tree).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from .adapters import LayerTapsTarget
from .backends import swap_modules
from .kv_cache import KVCache
from .layers import RMSNorm, rope_cos_sin
from .target import TreeTarget
from .transformer import Block, ModelArgs, Transformer, chain_mask


@dataclass
class EagleConfig:
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int              # the head's own SwiGLU width (the target's is 8,960; 1,024 trains on a CPU)
    norm_eps: float
    rope_theta: float
    base_model: str = ""
    layers: list[int] = field(default_factory=list)   # EAGLE-3: the target blocks whose outputs are fused

    @classmethod
    def for_target(cls, target: Transformer, hidden_dim: int = 1024, base_model: str = "",
                   layers: tuple[int, ...] = ()) -> "EagleConfig":
        a = target.args
        return cls(a.dim, a.n_heads, a.n_kv_heads, a.head_dim, hidden_dim, a.norm_eps, a.rope_theta, base_model,
                   list(layers))

    def block_args(self, vocab_size: int, max_seq_len: int) -> ModelArgs:
        return ModelArgs(vocab_size=vocab_size, dim=self.dim, n_layers=1, n_heads=self.n_heads,
                         n_kv_heads=self.n_kv_heads, hidden_dim=self.hidden_dim, head_dim=self.head_dim,
                         norm_eps=self.norm_eps, rope_theta=self.rope_theta, qkv_bias=True, max_seq_len=max_seq_len)


class EagleHead(nn.Module):
    """fc(concat(embedding, feature)) -> one decoder layer -> RMSNorm: the next feature. Embedding/LM head: the target's."""
    kind = "eagle"

    def __init__(self, cfg: EagleConfig, vocab_size: int, max_seq_len: int = 4096):
        super().__init__()
        self.cfg = cfg
        self.args = cfg.block_args(vocab_size, max_seq_len)
        self.fc = nn.Linear(2 * cfg.dim, cfg.dim, bias=True)
        self.block = Block(self.args)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def new_cache(self, max_len: int, batch_size: int = 1, dtype=None, device=None) -> KVCache:
        p = self.norm.weight                     # (the linear layers may be packed: see backends.py)
        return KVCache(1, batch_size, self.args.n_kv_heads, max_len, self.args.head_dim, dtype or p.dtype,
                       device or p.device)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """The head's input (..., D) for a committed position from the target's features there: f_t itself."""
        return features

    def readout_input(self, out: torch.Tensor) -> torch.Tensor:
        """What the LM head reads from the head's output: the predicted feature itself."""
        return out

    def tree_target(self, target):
        """The tree loop's target: its features are the final hidden states this head reads, as given."""
        return target

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, cache: KVCache,
                positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Next features (B, T, D) from pairs (f_t, embed(x_{t+1})): features, token_embeds (B, T, D)."""
        return self.output(self.layer(features, token_embeds, cache, positions, mask))

    def output(self, a: torch.Tensor) -> torch.Tensor:
        """What the head hands on from its layer's output a (..., D): the predicted feature, norm(a)."""
        return self.norm(a)

    def layer(self, features: torch.Tensor, token_embeds: torch.Tensor, cache: KVCache,
              positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder layer's output (B, T, D), before the final norm, for inputs (B, T, D) each."""
        B, T, _ = features.shape
        if positions is None:
            positions = (cache.length + torch.arange(T, device=features.device)).expand(B, T)
        if mask is None and T > 1:
            mask = chain_mask(cache.length, T, features.device)
        cos, sin = rope_cos_sin(positions, self.args.head_dim, self.args.rope_theta, features.dtype)
        x = self.fc(torch.cat([token_embeds, features], dim=-1))                       # (B, T, D)
        x = self.block(x, cos, sin, cache, 0, mask)                                     # (B, T, D)
        cache.advance(T)
        return x


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

    def output(self, a: torch.Tensor) -> torch.Tensor:
        """The layer output a itself: fed back at the next depth; the LM head reads norm(a)."""
        return a

    def tree_target(self, target: TreeTarget) -> TreeTarget:
        if isinstance(target, LayerTapsTarget) and target.layers == tuple(self.cfg.layers):
            return target
        if not isinstance(target.model, Transformer):
            raise TypeError("EAGLE-3 reads three of the target's blocks: decode with labkit's native model")
        return LayerTapsTarget(target.model, tuple(self.cfg.layers))


# --- checkpoints -------------------------------------------------------------------------------------
def save_eagle(head: EagleHead, draft_vocab: torch.Tensor, out_dir: Path, meta: dict) -> None:
    """Weights (bf16 safetensors, without the target's embedding and LM head), draft vocabulary, config."""
    from safetensors.torch import save_file
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    state["draft_vocab"] = draft_vocab.to(torch.int32).contiguous()
    save_file(state, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps({"kind": head.kind, **asdict(head.cfg), **meta}, indent=1) + "\n")


def read_eagle(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, weights with "draft_vocab") as `save_eagle` wrote them, as stored (bf16)."""
    from safetensors.torch import load_file
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no EAGLE head in {path}: train one with `python -m labkit.training.train_eagle` "
                                "(see data/heads/README.md)")
    return json.loads((path / "config.json").read_text()), load_file(path / "model.safetensors")


def load_eagle(path: str | Path, target: Transformer, head_class: type = EagleHead
               ) -> tuple[EagleHead, torch.Tensor, dict]:
    """(head in the target's dtype and device, draft vocabulary (Vd,), config) from `save_eagle`'s directory.

    head_class: the head the directory holds (its config's "kind"); eagle3.load_eagle3 passes Eagle3Head."""
    path = Path(path)
    config, state = read_eagle(path)
    fields = EagleConfig.__dataclass_fields__
    cfg = EagleConfig(**{k: config[k] for k in fields if k in config})
    if cfg.dim != target.args.dim:
        raise ValueError(f"this EAGLE head was trained for features of width {cfg.dim} ({cfg.base_model}), "
                         f"the target's are {target.args.dim}: train a head for this target")
    draft_vocab = state.pop("draft_vocab").long()
    kind = config.get("kind", "eagle")
    if kind != head_class.kind:
        loader = "labkit.models.eagle_heads.load_eagle3" if kind == "eagle3" else "labkit.models.eagle_heads.load_eagle"
        raise ValueError(f"{path} holds an {kind} head, not {head_class.kind}: load it with {loader}")
    head = head_class(cfg, target.vocab_size, target.max_seq_len)
    head.load_state_dict(state)
    p = target.embed_tokens.weight
    head = head.to(device=p.device, dtype=p.dtype).eval().requires_grad_(False)
    swap_modules(head, target.path)                  # its layer on the target's forward path
    return head, draft_vocab, config


def load_eagle3(path, target: Transformer) -> tuple[Eagle3Head, torch.Tensor, dict]:
    """(head, draft vocabulary (Vd,), config) of an EAGLE-3 head saved with eagle.save_eagle."""
    return load_eagle(path, target, Eagle3Head)
