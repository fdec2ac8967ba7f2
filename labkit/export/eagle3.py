"""EAGLE-3 heads in the engines' formats, written from labkit's (labkit.models.eagle3_formats reads them back).

One decoder layer, the same tensors everywhere; the formats differ in their names and config:

    speculators (vLLM)   config.json: speculators_model_type "eagle3", speculators_config (the verifier, the
                         proposal), transformer_layer_config (a LlamaConfig of one layer), draft_vocab_size,
                         eagle_aux_hidden_state_layer_ids, norm_before_residual and the other norm flags;
                         weights fc, layers.0.*, norm, lm_head, d2t, t2d
    SpecForge (SGLang)   config.json: a LlamaConfig, architectures ["LlamaForCausalLMEagle3"], draft_vocab_size,
                         eagle_config.eagle_aux_hidden_state_layer_ids; the layer's weights under midlayer.*

    layers.0.input_layernorm.weight     (D,)     block.input_layernorm.weight (of the token's embedding)
    layers.0.hidden_norm.weight         (D,)     block.hidden_norm.weight (of the fused feature)
    layers.0.self_attn.{q,k,v}_proj     (., 2D)  block.self_attn.qkv_proj, split (labkit projects them in one matmul)
    layers.0.mlp.{gate,up}_proj         (F, D)   block.mlp.gate_up_proj, split
    d2t (Vd,) int64: draft id i is target id i + d2t[i];  t2d (V,) bool: the target ids in the draft vocabulary

The speculators directory carries the target's embedding (embed_tokens.weight), as speculators' own
save_pretrained writes it: speculators 0.9.0 with transformers 5 leaves a missing embedding uninitialised rather
than loading the verifier's (its NaN check never fires). The SpecForge directory does not: SGLang shares the
target's.
An auxiliary layer id i is the input of the target's layer i, the output of block i - 1: labkit's blocks
(1, 13, 24) are ids (2, 14, 25), the engines' default for a 28-layer target.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..files.textfile import writable_dir
from ..models.eagle3_formats import FORMATS, LAYER, aux_layer_ids, target_tensor
from ..models.eagle_heads import EagleConfig, read_eagle

SPECULATORS_VERSION = "0.9.0"              # the release whose Eagle3DraftModel this layout is checked against


# --- labkit -> engine names -------------------------------------------------------------------------
def engine_tensors(state: dict[str, torch.Tensor], cfg: EagleConfig, draft_vocab: torch.Tensor, vocab_size: int,
                   layer_prefix: str) -> dict[str, torch.Tensor]:
    """The engines' tensors from a labkit EAGLE-3 state dict (save_eagle's names, no draft_vocab key)."""
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    q, k, v = state["block.self_attn.qkv_proj.weight"].split([q_dim, kv_dim, kv_dim])   # (., 2D) each
    gate, up = state["block.mlp.gate_up_proj.weight"].chunk(2)                          # (F, D) each
    L = layer_prefix
    out = {"fc.weight": state["fc.weight"],
           f"{L}input_layernorm.weight": state["block.input_layernorm.weight"],
           f"{L}hidden_norm.weight": state["block.hidden_norm.weight"],
           f"{L}self_attn.q_proj.weight": q, f"{L}self_attn.k_proj.weight": k, f"{L}self_attn.v_proj.weight": v,
           f"{L}self_attn.o_proj.weight": state["block.self_attn.o_proj.weight"],
           f"{L}post_attention_layernorm.weight": state["block.post_attention_layernorm.weight"],
           f"{L}mlp.gate_proj.weight": gate, f"{L}mlp.up_proj.weight": up,
           f"{L}mlp.down_proj.weight": state["block.mlp.down_proj.weight"],
           "norm.weight": state["norm.weight"], "lm_head.weight": state["lm_head.weight"]}
    draft_vocab = draft_vocab.long()
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_vocab] = True
    return {**{k: v.contiguous() for k, v in out.items()},
            "d2t": draft_vocab - torch.arange(draft_vocab.numel()), "t2d": t2d}


def layer_config(cfg: EagleConfig, vocab_size: int, max_position_embeddings: int) -> dict:
    """The one decoder layer as transformers' LlamaConfig (what speculators and SpecForge build it from)."""
    return {"attention_bias": False, "attention_dropout": 0.0, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "hidden_size": cfg.dim, "intermediate_size": cfg.hidden_dim,
            "max_position_embeddings": max_position_embeddings, "mlp_bias": False, "model_type": "llama",
            "num_attention_heads": cfg.n_heads, "num_hidden_layers": 1, "num_key_value_heads": cfg.n_kv_heads,
            "rms_norm_eps": cfg.norm_eps, "vocab_size": vocab_size}


def speculators_config(cfg: EagleConfig, vocab_size: int, draft_vocab_size: int, max_pos: int, verifier: str,
                       verifier_architecture: str, steps: int, dtype: str) -> dict:
    layer = layer_config(cfg, vocab_size, max_pos)
    layer["rope_parameters"] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    return {"architectures": ["Eagle3DraftModel"], "auto_map": {"": "config.Eagle3SpeculatorConfig"},
            "draft_vocab_size": draft_vocab_size, "dtype": dtype,
            "eagle_aux_hidden_state_layer_ids": aux_layer_ids(cfg.layers), "embed_requires_grad": False,
            "fc_norm": False, "norm_before_fc": False, "norm_before_residual": cfg.norm_before_residual,
            "norm_output": False, "speculators_model_type": "eagle3", "speculators_version": SPECULATORS_VERSION,
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": steps,
                                      "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                "verifier": {"architectures": [verifier_architecture], "name_or_path": verifier}},
            "target_hidden_size": None, "tie_word_embeddings": False, "transformer_layer_config": layer}


def specforge_config(cfg: EagleConfig, vocab_size: int, draft_vocab_size: int, max_pos: int, dtype: str) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle3"], **layer_config(cfg, vocab_size, max_pos),
            "rope_scaling": None, "rope_theta": cfg.rope_theta, "tie_word_embeddings": False, "torch_dtype": dtype,
            "draft_vocab_size": draft_vocab_size, "norm_before_residual": cfg.norm_before_residual,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layer_ids(cfg.layers),
                             "use_aux_hidden_state": True}}


def export_eagle3(head_dir: str | Path, target_dir: str | Path, out: str | Path, fmt: str = "speculators",
                  steps: int | None = None, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write labkit's EAGLE-3 head in `head_dir` (save_eagle's) for the target in `target_dir` (a transformers
    directory: speculators names it as the verifier and loads the embedding from it) as `fmt` in `out`."""
    from safetensors.torch import save_file
    if fmt not in FORMATS:
        raise ValueError(f"unknown EAGLE-3 format {fmt!r}: choose from {', '.join(FORMATS)}")
    config, state = read_eagle(head_dir)
    if config.get("kind") != "eagle3":
        raise ValueError(f"{head_dir} holds an {config.get('kind', 'eagle')} head: the {fmt} format carries EAGLE-3 "
                         "heads (the shipped one: data/heads/eagle3-qwen2.5-coder-1.5b)")
    if "fuse.weight" in state:
        raise ValueError(f"{head_dir} holds an EAGLE-3 head of labkit's earlier layer, which no engine runs: "
                         "retrain it (python -m labkit.training.train_eagle --kind eagle3)")
    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    V, max_pos = target_config["vocab_size"], target_config.get("max_position_embeddings", 32768)
    cfg = EagleConfig(**{k: config[k] for k in EagleConfig.__dataclass_fields__ if k in config})
    if cfg.dim != target_config["hidden_size"]:
        raise ValueError(f"the head is {cfg.dim} wide, the target in {target_dir} {target_config['hidden_size']}: "
                         "give the target it was trained on (--target)")
    draft_vocab = state.pop("draft_vocab")
    tensors = {k: v.to(dtype) if v.is_floating_point() else v
               for k, v in engine_tensors(state, cfg, draft_vocab, V, LAYER[fmt]).items()}
    name = str(dtype).removeprefix("torch.")
    if fmt == "speculators":
        tensors["embed_tokens.weight"] = target_tensor(target_dir, "model.embed_tokens.weight").to(dtype)
        meta = speculators_config(cfg, V, draft_vocab.numel(), max_pos, str(Path(target_dir).resolve()),
                                  (target_config.get("architectures") or ["Qwen2ForCausalLM"])[0],
                                  steps or config.get("ttt_steps") or 5, name)
    else:
        meta = specforge_config(cfg, V, draft_vocab.numel(), max_pos, name)
    out = writable_dir(out, "--out")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out
