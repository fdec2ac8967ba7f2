"""EAGLE-3 heads in the engines' formats, read into labkit's: the names and checks both directions share.

    speculators (vLLM)   config.json: speculators_model_type "eagle3", transformer_layer_config (one Llama layer),
                         draft_vocab_size, eagle_aux_hidden_state_layer_ids; weights fc, layers.0.*, norm, lm_head,
                         d2t, t2d (and the target's embed_tokens, which is checked against the target's)
    SpecForge (SGLang)   config.json: a LlamaConfig, architectures ["LlamaForCausalLMEagle3"], draft_vocab_size,
                         eagle_config.eagle_aux_hidden_state_layer_ids; the layer's weights under midlayer.*

`import_eagle3` returns the EagleConfig fields (labkit.models.eagle_heads builds the head), labkit's state dict
and the draft vocabulary; anything labkit's layer does not compute is refused. labkit.export.eagle3 writes them.
An auxiliary layer id i is the input of the target's layer i, the output of block i - 1.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .adapters import check_layers, default_layers
from .transformer import fuse_hf_weights

FORMATS = ("speculators", "specforge")
LAYER = {"speculators": "layers.0.", "specforge": "midlayer."}
UNSUPPORTED = {"norm_before_fc": "a norm in front of fc", "fc_norm": "a norm after fc",
               "norm_output": "a norm on the layer's output"}


def aux_layer_ids(layers) -> list[int]:
    """The engines' auxiliary hidden-state ids (inputs of target layers) of labkit's tapped blocks (outputs)."""
    return [int(i) + 1 for i in layers]


def target_tensor(target_dir: str | Path, name: str) -> torch.Tensor:
    """One tensor of a transformers checkpoint directory's *.safetensors."""
    from safetensors import safe_open
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if name in st.keys():
                return st.get_tensor(name)
    raise ValueError(f"no {name} in {target_dir}/*.safetensors: give the directory of the target the head was "
                     "trained on")


def engine_format(path: Path, config: dict, keys) -> str | None:
    """'speculators', 'specforge' or None (labkit's own) for a head directory's config and weight names."""
    if config.get("speculators_model_type") is not None or "transformer_layer_config" in config:
        if config.get("speculators_model_type") != "eagle3":
            raise ValueError(f"{path} holds a speculators {config.get('speculators_model_type')} model: labkit "
                             "imports EAGLE-3 heads (speculators_model_type eagle3)")
        return "speculators"
    if any(k.startswith("midlayer.") for k in keys) or "LlamaForCausalLMEagle3" in config.get("architectures", []):
        return "specforge"
    return None


def engine_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a head directory: model.safetensors (or shards) or pytorch_model.bin (as published)."""
    from safetensors.torch import load_file
    files = sorted(path.glob("*.safetensors"))
    if files:
        return {k: v for f in files for k, v in load_file(str(f)).items()}
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ValueError(f"{path} has no *.safetensors or pytorch_model.bin: give an EAGLE-3 head's directory")


def import_config(path: Path, config: dict, fmt: str, target) -> dict:
    """labkit's EagleConfig fields of an engine's config, anything labkit's layer does not compute refused."""
    layer = config["transformer_layer_config"] if fmt == "speculators" else config
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(f"{path}: {key} is set ({what}), which labkit's EAGLE-3 layer does not compute")
    if layer.get("model_type", "llama") != "llama":
        raise ValueError(f"{path}: the draft layer is a {layer['model_type']} layer; labkit runs EAGLE-3's "
                         "Llama-style layer (no q/k norms)")
    if layer.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{path}: the draft has {layer['num_hidden_layers']} layers; labkit's EAGLE-3 has one")
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        raise ValueError(f"{path}: the draft layer has biases (attention_bias / mlp_bias); EAGLE-3's has none")
    if layer.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act {layer['hidden_act']}; labkit's layer is SwiGLU (silu)")
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"{path}: rope {rope.get('rope_type', rope.get('type'))} scaling; labkit's head uses "
                         "plain RoPE")
    theta = rope.get("rope_theta", layer.get("rope_theta", 10000.0))
    D = layer["hidden_size"]
    if D != target.args.dim or config.get("target_hidden_size") not in (None, target.args.dim):
        raise ValueError(f"{path}: the head reads {config.get('target_hidden_size') or D}-wide features, the target "
                         f"is {target.args.dim} wide: load it with the target it was trained for")
    if layer.get("vocab_size", target.vocab_size) != target.vocab_size:
        raise ValueError(f"{path}: the head was trained on a {layer['vocab_size']}-token vocabulary, the target has "
                         f"{target.vocab_size}: load it with the target it was trained for")
    ids = (config.get("eagle_aux_hidden_state_layer_ids")
           or (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
    layers = [i - 1 for i in ids] if ids else list(default_layers(target.args.n_layers))   # ids (2, n/2, n-3)
    check_layers(layers, target.args.n_layers)
    heads = layer["num_attention_heads"]
    return dict(dim=D, n_heads=heads, n_kv_heads=layer.get("num_key_value_heads", heads),
                head_dim=layer.get("head_dim") or D // heads, hidden_dim=layer["intermediate_size"],
                norm_eps=layer.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
                base_model=(config.get("speculators_config", {}).get("verifier", {}).get("name_or_path", "")),
                layers=layers, norm_before_residual=bool(config.get("norm_before_residual", False)))


def labkit_state(tensors: dict[str, torch.Tensor], fmt: str, path: Path, target) -> tuple[dict, torch.Tensor]:
    """(labkit's state dict, draft vocabulary (Vd,)) from an engine's tensors."""
    L = LAYER[fmt]
    if f"{L}hidden_norm.weight" not in tensors:
        raise ValueError(f"{path} has no {L}hidden_norm.weight: not an EAGLE-3 layer in the {fmt} layout")
    embed = tensors.pop("embed_tokens.weight", tensors.pop("model.embed_tokens.weight", None))
    if embed is not None:
        mine = target.embed_tokens.weight
        if embed.shape != mine.shape or not torch.allclose(embed.float(), mine.detach().float().cpu(), atol=2e-2):
            raise ValueError(f"{path} carries an embedding that is not the target's: the head was trained for "
                             "another target; load it with that one")
    V = target.vocab_size
    Vd = tensors["lm_head.weight"].shape[0]
    if "d2t" in tensors:
        draft_vocab = tensors.pop("d2t").long() + torch.arange(Vd)
    elif "t2d" in tensors:
        draft_vocab = tensors["t2d"].nonzero().flatten()
    elif Vd == V:
        draft_vocab = torch.arange(V)
    else:
        raise ValueError(f"{path}: a {Vd}-row LM head with no d2t map to the target's vocabulary")
    tensors.pop("t2d", None)
    if draft_vocab.numel() != Vd or draft_vocab.min() < 0 or draft_vocab.max() >= V:
        raise ValueError(f"{path}: d2t maps {Vd} draft tokens outside the target's {V}-token vocabulary")
    state = {}
    for k, v in tensors.items():
        if k.startswith(L):
            state["block." + k.removeprefix(L)] = v
        elif k in ("fc.weight", "norm.weight", "lm_head.weight"):
            state[k] = v
        else:
            raise ValueError(f"{path}: tensor {k} is not part of EAGLE-3's layer as labkit runs it")
    return fuse_hf_weights(state), draft_vocab


def import_eagle3(path: str | Path, config: dict, fmt: str, target) -> tuple[dict, dict, torch.Tensor]:
    """(EagleConfig fields, labkit state dict, draft vocabulary) of a speculators or SpecForge directory."""
    path = Path(path)
    fields = import_config(path, config, fmt, target)
    state, draft_vocab = labkit_state(engine_weights(path), fmt, path, target)
    return {**fields, "draft_vocab_size": draft_vocab.numel()}, state, draft_vocab
