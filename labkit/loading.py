"""Load a model and its tokenizer the way users load them: a preset, a local directory or a Hub id.

`hub.resolve_model` turns the embedded presets into a converted local directory; anything
else goes to transformers unchanged, so a user with internet points the lab at any Hub
model. Llama/Qwen2-family checkpoints run on labkit's own `Transformer` (explicit cache,
mask and positions); other architectures run through `HFCausalLM`, the same interface over
transformers (chain verification and cache crop; no tree masks).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from .hub import ModelFetchError, resolve_model
from .model import ModelArgs, Transformer, fuse_hf_weights

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}
BACKENDS = ("auto", "native", "hf")


@dataclass
class LoadedModel:
    model: nn.Module          # Transformer or HFCausalLM: model(tokens, cache, ...) -> logits
    tokenizer: object
    name: str
    backend: str              # "native" or "hf"
    eos_token_ids: tuple[int, ...] = ()   # the tokenizer's and the generation config's (chat turns end)


class HFCache:
    """transformers' DynamicCache behind labkit's cache interface (length, truncate, room)."""

    def __init__(self, inner, max_len: int):
        self.inner, self.max_len, self.length = inner, max_len, 0

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.inner.crop(length - self.length)    # transformers 5.x: a negative count of tokens to drop
        self.length = length

    def room(self) -> int:
        return self.max_len - self.length


class HFCausalLM(nn.Module):
    """Any transformers causal LM with labkit's forward signature (chains only)."""

    def __init__(self, hf_model, max_seq_len: int):
        super().__init__()
        self.hf = hf_model.eval()
        self.vocab_size = hf_model.config.vocab_size
        self.max_seq_len = max_seq_len

    @property
    def device(self) -> torch.device:
        return self.hf.device

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> HFCache:
        from transformers import DynamicCache
        return HFCache(DynamicCache(config=self.hf.config), max_len or self.max_seq_len)

    def forward(self, tokens: torch.Tensor, cache: HFCache, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, num_logits: int | None = None) -> torch.Tensor:
        if mask is not None or positions is not None:
            raise NotImplementedError("tree masks and custom positions need the native model (backend='native')")
        if cache.length + tokens.shape[1] > cache.max_len:
            raise ValueError(f"{cache.length} cached + {tokens.shape[1]} new tokens exceed the context of {cache.max_len}")
        out = self.hf(input_ids=tokens, past_key_values=cache.inner, use_cache=True, logits_to_keep=num_logits or 0)
        cache.length += tokens.shape[1]
        return out.logits.float()                                                     # (B, T', V)


def load_native(path: Path, dtype: torch.dtype, max_seq_len: int) -> Transformer:
    """Build labkit's Transformer from a transformers checkpoint directory (safetensors)."""
    from safetensors.torch import load_file
    cfg = json.loads((path / "config.json").read_text())
    args = ModelArgs.from_hf_config(cfg)
    args.max_seq_len = min(args.max_seq_len, max_seq_len)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFetchError(f"no *.safetensors weights in {path}: re-run the conversion (delete the directory) "
                              "or point at a directory saved with save_pretrained")
    state = {}
    for f in files:
        try:
            state.update({k: v.to(dtype) for k, v in load_file(f).items()})
        except Exception as e:  # safetensors raises its own error types for truncated or garbled files
            raise ModelFetchError(f"{f} is corrupted ({e}): delete {path} and run `python -m labkit fetch` "
                                  "again (or re-save the checkpoint)") from e
    state = fuse_hf_weights(state)
    with torch.device("meta"):
        model = Transformer(args)
    if args.tie_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (args.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ModelFetchError(f"weights in {path} do not fit the config: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}; the checkpoint may be corrupted or of another architecture")
    if args.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def load_model(name_or_path: str, dtype: str | torch.dtype = "bf16", backend: str = "auto",
               max_seq_len: int = 4096, device: str = "cpu", progress: bool = True) -> LoadedModel:
    """A preset key (see hub.PRESETS), a local transformers directory, or a Hub id -> model + tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
    source = resolve_model(name_or_path, progress=progress)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        config = AutoConfig.from_pretrained(source).to_dict()
    except OSError as e:
        raise ModelFetchError(f"could not load {name_or_path!r} ({source}): {e}\nUse a preset "
                              "(python -m labkit models), a local directory with config.json, or a Hub id "
                              "(needs internet).") from e
    model, backend_used = None, "native"
    if backend == "native" or (backend == "auto" and config.get("model_type") in ("llama", "qwen2")):
        try:
            model = load_native(_local_dir(source), dtype, max_seq_len)
        except NotImplementedError:   # e.g. RoPE scaling: fall back to transformers under "auto"
            if backend == "native":
                raise
    if model is None:
        hf = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        model, backend_used = HFCausalLM(hf, min(max_seq_len, config.get("max_position_embeddings", max_seq_len))), "hf"
    return LoadedModel(model.to(device), tokenizer, name_or_path, backend_used, _eos_ids(source, tokenizer))


def _local_dir(source: str) -> Path:
    """A local directory for `source`, downloading a Hub id's config and safetensors (needs internet)."""
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download
    return Path(snapshot_download(source, allow_patterns=["*.json", "*.safetensors"]))


def _eos_ids(source: str, tokenizer) -> tuple[int, ...]:
    from transformers import GenerationConfig
    try:
        eos = GenerationConfig.from_pretrained(source).eos_token_id
    except OSError:
        eos = None
    eos = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    return tuple(sorted({i for i in eos + [tokenizer.eos_token_id] if i is not None}))


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft must speak the target's vocabulary token for token; say so clearly when it does not."""
    if target.model.vocab_size != draft.model.vocab_size or target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise ValueError(f"the draft {draft.name!r} uses a different tokenizer than the target {target.name!r} "
                         f"(vocab {draft.model.vocab_size} vs {target.model.vocab_size}): pick a draft model from the "
                         "target's family (same tokenizer), or use --drafter lookup, which needs no model")
