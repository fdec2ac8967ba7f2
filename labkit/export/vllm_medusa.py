"""Medusa-1 heads in vLLM's Medusa format, written from labkit's and read back into its drafter.

vLLM's `Medusa` model (model_executor/models/medusa.py) reads a directory with
    config.json          model_type "medusa", hidden_size, vocab_size, num_heads, num_hidden_layers (residual
                         layers per head), medusa_fc_bias, original_lm_head (one LM head for every head)
    model.safetensors    blocks.{k}.layers.0.weight (D, D), .bias (D,); lm_head.weight (V, D)
and computes, for the target's final normed hidden state h, head k's logits as lm_head(h + SiLU(W_k h + b_k)),
which is labkit's MedusaHeads exactly: one biased residual layer per head and the target's own LM head, shared
(original_lm_head). vLLM keeps its own copy of that LM head, so the export carries the target's (V x D).

    vllm serve TARGET --speculative-config '{"method": "medusa", "model": "DIR", "num_speculative_tokens": K}'
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..files.textfile import writable_dir
from ..models.medusa_heads import CONFIG, WEIGHTS, MedusaHeads

FORMAT = "vllm-medusa"


def target_lm_head(target_dir: str | Path) -> torch.Tensor:
    """(V, D) the LM head of a transformers checkpoint directory (its input embedding where the two are tied)."""
    from safetensors import safe_open
    target_dir = Path(target_dir)
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        for f in sorted(target_dir.glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                if name in st.keys():
                    return st.get_tensor(name)
    raise ValueError(f"no lm_head.weight or model.embed_tokens.weight in {target_dir}/*.safetensors: give the "
                     "directory of the target the heads were trained on")


def medusa_config(heads_dir: Path) -> dict:
    """The config.json of labkit's Medusa heads in `heads_dir` (save_medusa's); any other directory refused."""
    if not (heads_dir / CONFIG).is_file() or not (heads_dir / WEIGHTS).is_file():
        raise ValueError(f"{heads_dir} has no {CONFIG} + {WEIGHTS}: give a directory written by labkit's "
                         "save_medusa (the shipped heads: data/heads/medusa-qwen2.5-coder-1.5b)")
    meta = json.loads((heads_dir / CONFIG).read_text())
    if meta.get("kind") is not None or "n_heads" not in meta:
        raise ValueError(f"{heads_dir} holds no Medusa heads ({meta.get('kind', 'no')} heads): vllm-medusa exports "
                         "labkit's Medusa-1 heads")
    return meta


def export_vllm_medusa(heads_dir: str | Path, target_dir: str | Path, out: str | Path,
                       dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the heads saved in `heads_dir` (labkit's save_medusa) with the LM head of the target in `target_dir`
    as a vLLM Medusa directory `out`."""
    from safetensors.torch import load_file, save_file
    heads_dir = Path(heads_dir)
    meta = medusa_config(heads_dir)
    lm_head = target_lm_head(target_dir)                                                  # (V, D)
    V, D = lm_head.shape
    if meta.get("dim") != D:
        raise ValueError(f"the heads in {heads_dir} read hidden states of {meta.get('dim')}, the target in "
                         f"{target_dir} has {D}: give the target they were trained on ({meta.get('base_model')})")
    blocks = load_file(str(heads_dir / WEIGHTS))
    out = writable_dir(out, "--out")
    state = {f"blocks.{k}.layers.0.{p}": blocks[f"blocks.{k}.linear.{p}"].to(dtype).contiguous()
             for k in range(meta["n_heads"]) for p in ("weight", "bias")}
    state["lm_head.weight"] = lm_head.to(dtype).contiguous()
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": D, "vocab_size": V,
              "truncated_vocab_size": V, "num_heads": meta["n_heads"], "num_hidden_layers": 1, "medusa_fc_bias": True,
              "original_lm_head": True, "torch_dtype": str(dtype).removeprefix("torch."),
              "labkit": {"format": FORMAT, "base_model": meta.get("base_model", ""), "heads": str(heads_dir.name),
                         "topk_accuracy": meta.get("topk_accuracy")}}
    (out / CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    return out


def load_vllm_medusa(path: str | Path, lm_head: torch.nn.Linear) -> MedusaHeads:
    """A vLLM Medusa directory as labkit's MedusaHeads on the target's `lm_head` (one residual layer per head, one
    shared LM head: the heads labkit trains; others are refused, naming what differs)."""
    from safetensors.torch import load_file
    path = Path(path)
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise FileNotFoundError(f"{path} has no {CONFIG} + {WEIGHTS}: point at a vLLM Medusa directory")
    config = json.loads((path / CONFIG).read_text())
    if config.get("model_type") != "medusa":
        raise ValueError(f"{path} holds a {config.get('model_type')!r} model, not vLLM's medusa")
    if config.get("num_hidden_layers", 1) != 1 or not config.get("medusa_fc_bias", False):
        raise ValueError(f"{path}'s heads have {config.get('num_hidden_layers', 1)} residual layers "
                         f"(bias: {config.get('medusa_fc_bias', False)}); labkit's Medusa-1 heads have one, biased")
    if config.get("truncated_vocab_size", config["vocab_size"]) != config["vocab_size"]:
        raise ValueError(f"{path}'s heads score a truncated vocabulary (token_map); labkit's score the target's")
    if config["hidden_size"] != lm_head.in_features or config["vocab_size"] != lm_head.out_features:
        raise ValueError(f"{path}'s heads are for hidden size {config['hidden_size']} and {config['vocab_size']} "
                         f"tokens, this target has {lm_head.in_features} and {lm_head.out_features}")
    state = load_file(str(path / WEIGHTS))
    if not config.get("original_lm_head", False):
        raise ValueError(f"{path}'s heads have an LM head each; labkit's heads share the target's (original_lm_head)")
    theirs, ours = state["lm_head.weight"].float(), getattr(lm_head, "weight", None)
    if ours is not None and ours.shape == theirs.shape and not torch.allclose(theirs, ours.float(), rtol=1e-2,
                                                                              atol=1e-3):
        raise ValueError(f"{path}'s LM head is not this target's: the heads were trained on another model")
    heads = MedusaHeads(lm_head, config["num_heads"])
    heads.load_state_dict({f"blocks.{k}.linear.{p}": state[f"blocks.{k}.layers.0.{p}"].to(heads.dtype)
                           for k in range(heads.n_heads) for p in ("weight", "bias")})
    return heads.eval().requires_grad_(False)
