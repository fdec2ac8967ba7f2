"""Save and load Medusa heads: the residual blocks only; the LM head is the target's own.

    <dir>/model.safetensors   blocks.{k}.linear.weight (D, D), .bias (D,), bf16: ~19 MB for 4 heads of D=1536
    <dir>/config.json         n_heads, dim, base_model, topk_accuracy, choices, training record
    <dir>/PROVENANCE.md       how the weights were made and the command that remakes them
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..backends import swap_modules
from .medusa import MedusaHeads

REPO_HEADS = Path(__file__).resolve().parents[2] / "data" / "heads"     # the shipped heads
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
