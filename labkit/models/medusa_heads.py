"""Medusa-1 heads (Cai et al. 2024): K small residual blocks on the frozen target's last hidden state,
each guessing one token further ahead, read out by the target's own LM head; and their checkpoints.

Head k (0-based) reads the final normed hidden state h_t at position t (the one the target's LM
head turns into token t+1) and predicts token t+2+k:
    h_k = h_t + SiLU(W1_k h_t + b1_k)                 a residual block, W1_k (D, D) zero-initialised
    logits_k = lm_head(h_k)                            the target's LM head, frozen and shared
At initialisation every head therefore says exactly what the LM head says (the token at t+1),
a sane start that training moves one step further per head.

Why W2 is shared: Medusa gives each head its own (V, D) output matrix, initialised from the LM
head. For Qwen2.5-Coder-1.5B that is 151936 x 1536 = 233M parameters (467 MB in bf16) per head:
too big to ship and untrainable in the ~15 CPU minutes this lab spends. Medusa's own code offers
the same shortcut (its heads can reuse the base model's lm_head); only the (D, D) blocks train.

What drafts with them is `labkit.drafters.medusa.MedusaDrafter`; what trains them,
`labkit.training.train_medusa`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..files.shipped import shipped
from .backends import swap_modules, weight_dtype


class ResBlock(nn.Module):
    """h + SiLU(W h + b), zero-initialised: the identity until trained."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.silu(self.linear(h))


class MedusaHeads(nn.Module):
    """K residual blocks over the target's hidden state, read out by the target's frozen LM head."""

    def __init__(self, lm_head: nn.Linear, n_heads: int = 4):
        super().__init__()
        if n_heads < 1:
            raise ValueError(f"n_heads must be >= 1, got {n_heads}")
        self.dim, self.dtype = lm_head.in_features, weight_dtype(lm_head)
        self.blocks = nn.ModuleList(ResBlock(self.dim) for _ in range(n_heads))
        # the target's own module, on whatever forward path it runs: held outside the module tree
        # (not a submodule, so not saved with the heads and not moved or converted with them)
        self.lm_head = (lm_head,)
        self.blocks.to(self.dtype)

    @property
    def n_heads(self) -> int:
        return len(self.blocks)

    def head_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """(K, *, D): each head's state h_k for hidden (*, D)."""
        return torch.stack([block(hidden) for block in self.blocks])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(K, *, V) logits: head k at position t scores token t+2+k."""
        return self.lm_head[0](self.head_states(hidden))


# --- checkpoints -------------------------------------------------------------------------------------
# <dir>/model.safetensors: blocks.{k}.linear.weight (D, D), .bias (D,), bf16 (~19 MB for 4 heads of D=1536);
# <dir>/config.json: n_heads, dim, base_model, topk_accuracy, choices, training record; <dir>/PROVENANCE.md
REPO_HEADS = shipped("heads", must_exist=False)     # the shipped heads (files/shipped.py)
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def save_medusa(heads: MedusaHeads, out_dir: str | Path, meta: dict, provenance: str | None = None,
                dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the blocks' weights (in `dtype`), config.json (meta + n_heads, dim) and PROVENANCE.md."""
    from safetensors.torch import save_file
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in heads.state_dict().items()}
    save_file(state, str(out_dir / WEIGHTS), metadata={"format": "pt"})
    config = {"n_heads": heads.n_heads, "dim": heads.dim, **meta}
    (out_dir / CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    if provenance is not None:
        (out_dir / "PROVENANCE.md").write_text(provenance)
    return out_dir


def load_medusa(path: str | Path, target) -> tuple[MedusaHeads, dict]:
    """(heads on `target`'s LM head, config) from a directory written by save_medusa."""
    from safetensors.torch import load_file
    path = Path(path)
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise FileNotFoundError(f"{path} has no {CONFIG} + {WEIGHTS}: point at a directory written by save_medusa "
                                "(the shipped heads: data/heads/medusa-qwen2.5-coder-1.5b)")
    config = json.loads((path / CONFIG).read_text())
    D = target.args.dim
    if config["dim"] != D:
        raise ValueError(f"heads in {path} were trained for hidden size {config['dim']}, but this target has {D}: "
                         f"they belong to {config.get('base_model', 'another model')}")
    heads = MedusaHeads(target.lm_head, config["n_heads"])
    state = load_file(str(path / WEIGHTS))
    heads.load_state_dict({k: v.to(heads.dtype) for k, v in state.items()})
    heads = heads.to(target.device).eval().requires_grad_(False)
    swap_modules(heads.blocks, target.path)          # the residual blocks on the target's forward path
    return heads, config
