"""EAGLE's draft heads (Li et al. 2024 and 2025), the modules and their checkpoints.

EAGLE-1/2 (`EagleHead`): the target's final hidden state f_t (the "feature" its LM head reads)
is far more predictable than its next token. The head takes the pair (f_t, x_{t+1}), feature and
the token it led to, and is the layer of the reference code (SafeAILab/EAGLE, `cnets1.py`):
    g_t = fc(concat(embed(x_{t+1}), f_t))             # (D,) a biased fc; the target's embedding, frozen
    u = g_t + Attn(g_{<=t})                           # no input norm: fc's output is already the layer's input
    f̂_{t+1} = u + MLP(post_attention_layernorm(u))   # one decoder layer with its own KV cache, no final norm
and reads the next token off f̂_{t+1} with the target's frozen LM head (f_t is the target's normed
final state, so the prediction needs no norm of its own). Drafting continues on its own predicted
features: (f̂_{t+1}, x_{t+2}) -> f̂_{t+2}, and so on.

EAGLE-3 (`Eagle3Head`) is the layer of the paper's reference code, as vLLM, SGLang and llama.cpp run
it. Its input is the outputs of three target blocks, low, middle and high, concatenated and fused,
    g_t = fc(concat(h^low_t, h^mid_t, h^high_t))                      # (3D,) -> (D,)
in place of the final feature. The token's embedding e and the hidden state h (g_t, or at the next
depth the layer's own output) are normalised apart and attention reads their concatenation:
    u = h + Attn(concat(input_layernorm(e), hidden_norm(h)))         # q, k, v projected from 2D
    a_t = u + MLP(post_attention_layernorm(u))                       # fed back as h at the next depth
    draft logits = lm_head(norm(a_t))                                # its own rows over the draft vocabulary
(`norm_before_residual`: the residual is hidden_norm(h) instead of h, an option speculators and vLLM
read from the checkpoint.) The LM head covers the draft vocabulary only, the tokens the target
produced in training (EAGLE-3's `d2t` map), and starts as the target's rows for them. The head is
trained on tokens only (the target's greedy next token), with training-time test
(labkit.training.eagle_loss).

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
from .eagle3_formats import engine_format, import_eagle3
from .kv_cache import KVCache
from .layers import RMSNorm, rope_cos_sin
from .target import TreeTarget
from .transformer import MLP, Attention, Block, ModelArgs, Transformer, chain_mask


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
    draft_vocab_size: int = 0    # EAGLE-3: rows of its own LM head (0: the target's whole vocabulary)
    norm_before_residual: bool = False                # EAGLE-3: the residual is hidden_norm(h), not h

    @classmethod
    def for_target(cls, target: Transformer, hidden_dim: int = 1024, base_model: str = "",
                   layers: tuple[int, ...] = (), draft_vocab_size: int = 0,
                   norm_before_residual: bool = False) -> "EagleConfig":
        a = target.args
        return cls(a.dim, a.n_heads, a.n_kv_heads, a.head_dim, hidden_dim, a.norm_eps, a.rope_theta, base_model,
                   list(layers), draft_vocab_size, norm_before_residual)

    def block_args(self, vocab_size: int, max_seq_len: int, qkv_bias: bool = True) -> ModelArgs:
        return ModelArgs(vocab_size=vocab_size, dim=self.dim, n_layers=1, n_heads=self.n_heads,
                         n_kv_heads=self.n_kv_heads, hidden_dim=self.hidden_dim, head_dim=self.head_dim,
                         norm_eps=self.norm_eps, rope_theta=self.rope_theta, qkv_bias=qkv_bias,
                         max_seq_len=max_seq_len)


class FeatureHead(nn.Module):
    """What both EAGLE heads share: one decoder layer `block` over pairs (context, token embedding), its own
    KV cache. A head defines `context` (its input from the target's features), `pair_input` (what the layer
    reads of a pair), `output` (what it hands on to the next depth), `readout_input` and `readout_rows` (what
    the LM head reads, and the LM head's rows)."""
    kind = ""
    args: ModelArgs
    block: nn.Module

    def new_cache(self, max_len: int, batch_size: int = 1, dtype=None, device=None) -> KVCache:
        p = self.block.post_attention_layernorm.weight    # (the linear layers may be packed: see backends.py)
        return KVCache(1, batch_size, self.args.n_kv_heads, max_len, self.args.head_dim, dtype or p.dtype,
                       device or p.device)

    def forward(self, context: torch.Tensor, token_embeds: torch.Tensor, cache: KVCache,
                positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """What the head hands on (B, T, D) from pairs (context_t, embed(x_{t+1})): context, token_embeds (B, T, D)."""
        return self.output(self.layer(context, token_embeds, cache, positions, mask))

    def layer(self, context: torch.Tensor, token_embeds: torch.Tensor, cache: KVCache,
              positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder layer's output (B, T, D), before the final norm, for inputs (B, T, D) each."""
        B, T, _ = context.shape
        if positions is None:
            positions = (cache.length + torch.arange(T, device=context.device)).expand(B, T)
        if mask is None and T > 1:
            mask = chain_mask(cache.length, T, context.device)
        cos, sin = rope_cos_sin(positions, self.args.head_dim, self.args.rope_theta, context.dtype)
        x = self.block(self.pair_input(context, token_embeds), cos, sin, cache, 0, mask)   # (B, T, D)
        cache.advance(T)
        return x

    def tree_target(self, target):
        """The tree loop's target: its features are the final hidden states this head reads, as given."""
        return target


class EagleLayer(Block):
    """EAGLE-1's decoder layer: a standard block without its input norm (the reference's first layer has none)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        del self.input_layernorm

    def forward(self, x, cos, sin, cache, layer, mask):
        x = x + self.self_attn(x, cos, sin, cache, layer, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(FeatureHead):
    """fc(concat(embedding, feature)) -> one decoder layer without an input norm: the next feature, with no final
    norm. Embedding and LM head: the target's."""
    kind = "eagle"

    def __init__(self, cfg: EagleConfig, vocab_size: int, max_seq_len: int = 4096):
        super().__init__()
        self.cfg = cfg
        self.args = cfg.block_args(vocab_size, max_seq_len)
        self.fc = nn.Linear(2 * cfg.dim, cfg.dim, bias=True)
        self.block = EagleLayer(self.args)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """The head's input (..., D) for a committed position from the target's features there: f_t itself."""
        return features

    def pair_input(self, context: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """The block's input (..., D): fc(concat(embed(x_{t+1}), f_t))."""
        return self.fc(torch.cat([token_embeds, context], dim=-1))

    def output(self, a: torch.Tensor) -> torch.Tensor:
        """What the head hands on from its layer's output a (..., D): the predicted feature, a itself."""
        return a

    def readout_input(self, out: torch.Tensor) -> torch.Tensor:
        """What the LM head reads from the head's output: the predicted feature itself."""
        return out

    def readout_rows(self, lm_weight: torch.Tensor, draft_vocab: torch.Tensor) -> torch.Tensor:
        """The LM head's rows (Vd, D) over the draft vocabulary: the target's own (lm_weight (V, D))."""
        return lm_weight[draft_vocab]


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer over x = concat(e, h) (B, T, 2D): the token's embedding and the hidden state
    normalised apart, attention projected from their 2D concatenation, h itself the residual."""

    def __init__(self, args: ModelArgs, norm_before_residual: bool = False):
        super().__init__()
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)          # of the embedding
        self.hidden_norm = RMSNorm(args.dim, args.norm_eps)              # of the hidden state
        self.self_attn = Attention(args, in_dim=2 * args.dim)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, cos, sin, cache, layer, mask):
        e, h = x.chunk(2, dim=-1)                                                       # (B, T, D) each
        h_normed = self.hidden_norm(h)
        residual = h_normed if self.norm_before_residual else h
        u = residual + self.self_attn(torch.cat([self.input_layernorm(e), h_normed], dim=-1), cos, sin, cache,
                                      layer, mask)                                      # (B, T, D)
        return u + self.mlp(self.post_attention_layernorm(u))                           # (B, T, D) pre-norm


class Eagle3Head(FeatureHead):
    """EAGLE-3: fc fuses three target blocks; one Eagle3Layer; it feeds itself its layer output, reads out
    lm_head(norm(a)) over the draft vocabulary."""
    kind = "eagle3"

    def __init__(self, cfg: EagleConfig, vocab_size: int, max_seq_len: int = 4096):
        if len(cfg.layers) != 3:
            raise ValueError(f"an EAGLE-3 head fuses three target blocks: set EagleConfig.layers, got {cfg.layers}")
        super().__init__()
        self.cfg = cfg
        self.args = cfg.block_args(vocab_size, max_seq_len, qkv_bias=False)
        self.fc = nn.Linear(3 * cfg.dim, cfg.dim, bias=False)
        self.block = Eagle3Layer(self.args, cfg.norm_before_residual)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.draft_vocab_size or vocab_size, bias=False)

    @torch.no_grad()
    def init_lm_head(self, rows: torch.Tensor) -> None:
        """Start the LM head as the target's rows (Vd, D) of the draft vocabulary (lm_head.weight[draft_vocab])."""
        if rows.shape != self.lm_head.weight.shape:
            raise ValueError(f"the head's LM head is {tuple(self.lm_head.weight.shape)}, the rows given "
                             f"{tuple(rows.shape)}: build it with EagleConfig(draft_vocab_size=...) of their "
                             "vocabulary")
        self.lm_head.weight.copy_(rows)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """g_t (..., D) from the tapped features (..., 3D) or (..., 4D) (the final feature is not used)."""
        return self.fc(features[..., : 3 * self.cfg.dim])

    def pair_input(self, context: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """The layer's input (..., 2D): concat(embed(x_{t+1}), h), normalised apart inside the layer."""
        return torch.cat([token_embeds, context], dim=-1)

    def output(self, a: torch.Tensor) -> torch.Tensor:
        """The layer output a itself: fed back at the next depth; the LM head reads norm(a)."""
        return a

    def readout_input(self, out: torch.Tensor) -> torch.Tensor:
        return self.norm(out)

    def readout_rows(self, lm_weight: torch.Tensor, draft_vocab: torch.Tensor) -> torch.Tensor:
        """The head's own LM-head rows (Vd, D), one per draft-vocabulary token (the target's are not read)."""
        if draft_vocab.numel() != self.lm_head.weight.shape[0]:
            raise ValueError(f"this EAGLE-3 head scores {self.lm_head.weight.shape[0]} draft tokens, the draft "
                             f"vocabulary given has {draft_vocab.numel()}: pass the vocabulary it was saved with "
                             "(load_eagle3 returns it)")
        return self.lm_head.weight

    def tree_target(self, target: TreeTarget) -> TreeTarget:
        if isinstance(target, LayerTapsTarget) and target.layers == tuple(self.cfg.layers):
            return target
        if not isinstance(target.model, Transformer):
            raise TypeError("EAGLE-3 reads three of the target's blocks: decode with labkit's native model")
        return LayerTapsTarget(target.model, tuple(self.cfg.layers))


# --- checkpoints -------------------------------------------------------------------------------------
def save_eagle(head: FeatureHead, draft_vocab: torch.Tensor, out_dir: Path, meta: dict) -> None:
    """Weights (bf16 safetensors, without the target's embedding and, for EAGLE-1, its LM head), the draft
    vocabulary, config."""
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
               ) -> tuple[FeatureHead, torch.Tensor, dict]:
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
    if kind == "eagle" and "norm.weight" in state:
        raise ValueError(f"{path} holds an EAGLE head of labkit's earlier layer (an input norm and a final norm the "
                         "reference has not), which this version does not run: use the shipped head or retrain it "
                         "with `python -m labkit.training.train_eagle` (data/heads/README.md)")
    if kind == "eagle3" and "fuse.weight" in state:
        raise ValueError(f"{path} holds an EAGLE-3 head of labkit's earlier layer (a fuse in front of a standard "
                         "block), which this version does not run: use the shipped head or retrain it with "
                         "`python -m labkit.training.train_eagle --kind eagle3` (data/heads/README.md)")
    if kind == "eagle3":
        cfg.draft_vocab_size = draft_vocab.numel()                 # its LM head's rows
    return build_head(head_class, cfg, state, target), draft_vocab, config


def build_head(head_class: type, cfg: EagleConfig, state: dict[str, torch.Tensor], target: Transformer) -> FeatureHead:
    """The head of `cfg` with weights `state`, in the target's dtype and device, on its forward path."""
    head = head_class(cfg, target.vocab_size, target.max_seq_len)
    head.load_state_dict(state)
    p = target.embed_tokens.weight
    head = head.to(device=p.device, dtype=p.dtype).eval().requires_grad_(False)
    swap_modules(head, target.path, keep=("lm_head",))   # its layer on the target's path; the drafter reads the
    return head                                           # LM head's rows itself (EagleDrafter.readout)


def load_eagle3(path, target: Transformer) -> tuple[Eagle3Head, torch.Tensor, dict]:
    """(head, draft vocabulary (Vd,), config) of an EAGLE-3 head: saved with save_eagle, or in the speculators
    (vLLM) or SpecForge (SGLang) format, as published for many targets (eagle3_formats.py)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no EAGLE-3 head in {path} (no config.json): train one with `python -m "
                                "labkit.training.train_eagle --kind eagle3`, or give a speculators or SpecForge "
                                "head's directory")
    config = json.loads((path / "config.json").read_text())
    keys = ()
    if (path / "model.safetensors").is_file():
        from safetensors import safe_open
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            keys = list(f.keys())
    fmt = engine_format(path, config, keys)
    if fmt is None:
        return load_eagle(path, target, Eagle3Head)
    fields, state, draft_vocab = import_eagle3(path, config, fmt, target)
    cfg = EagleConfig(**fields)
    head = build_head(Eagle3Head, cfg, state, target)
    return head, draft_vocab, {"kind": "eagle3", "format": fmt, **asdict(cfg)}
