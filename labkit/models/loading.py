"""Load a model and its tokenizer the way users load them: a preset, a local directory or a Hub id.

`hub.resolve_model` turns the embedded presets into a converted local directory; anything
else goes to transformers unchanged, so a user with internet points the lab at any Hub
model. Llama/Qwen2-family checkpoints run on labkit's own `Transformer` (explicit cache,
mask and positions); other architectures run through `HFCausalLM`, the same interface over
transformers (chain verification and cache crop; no tree masks).

On a CPU, labkit's Transformer then runs the forward path this machine measured fastest
(`labkit.models.calibrate`: the packed CPU kernels where they build, else oneDNN or the reference);
on a GPU it runs the reference modules there. `backend=` and `device=` override both.
"""
from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from .backends import PATHS, ForwardPath, apply_path, precision_of
from .checks import (
    DTYPES,
    check_draft_precision,
    check_load_args,
    check_native_dtype,
    check_same_vocab,
    resolve_dtype,
    runs_native,
)
from .hub import ModelFetchError, is_preset_dir, repair_advice, resolve_model
from .transformer import ModelArgs, Transformer, fuse_hf_weights


@dataclass
class LoadedModel:
    model: nn.Module          # Transformer or HFCausalLM: model(tokens, cache, ...) -> logits
    tokenizer: object
    name: str
    backend: str              # "native" or "hf"
    eos_token_ids: tuple[int, ...] = ()   # the tokenizer's and the generation config's (chat turns end)
    calibration: object = None            # calibrate.PathChoice when the path was chosen by measuring

    @property
    def path(self) -> ForwardPath:
        """The kernels, weight precision and device its forward runs with."""
        return self.model.path


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

    @property
    def path(self) -> ForwardPath:
        return ForwardPath("transformers", precision_of(self.hf.dtype), self.device.type)

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
    try:
        args = ModelArgs.from_hf_config(cfg)
    except ValueError as e:
        raise ModelFetchError(f"{path}: {e}") from None
    args.max_seq_len = min(args.max_seq_len, max_seq_len)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFetchError(f"no *.safetensors weights in {path}: re-run the conversion (delete the directory) "
                              "or point at a directory saved with save_pretrained")
    mapped = {}
    for f in files:
        try:
            mapped.update(load_file(f))   # on the file's memory map
        except Exception as e:  # safetensors raises its own error types for truncated or garbled files
            raise ModelFetchError(f"{f} is corrupted ({e}): {repair_advice(path)}") from e
    if not is_preset_dir(path):   # a preset's files are hash-checked; a user's: a changed exponent byte reads as
        for k, v in mapped.items():  # inf or NaN, which makes every output token 0 (one sum per tensor tells)
            if v.is_floating_point() and not v.sum(dtype=torch.float32).isfinite():
                raise ModelFetchError(f"the weights in {path} hold NaN or infinite values ({k}): the file is "
                                      f"damaged; {repair_advice(path)}")
    # own copies in `dtype`, each written once: tensors left on the map would keep all of it mapped
    state = fuse_hf_weights(mapped, dtype)
    del mapped
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


class LoadSteps:
    """What a load is doing, as one status line on stderr (a load of the 1.5B target takes a while on a CPU)."""

    def __init__(self, name: str, progress: bool):
        from tqdm import tqdm
        self.name = Path(name).name
        self.bar = tqdm(total=None, desc=f"loading {self.name}", bar_format="{desc} ({elapsed})", disable=not progress,
                        leave=False)

    def now(self, what: str) -> None:
        self.bar.set_description_str(f"loading {self.name}: {what}", refresh=True)

    def __enter__(self) -> "LoadSteps":
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()


def load_model(name_or_path: str, dtype: str | torch.dtype = "auto", backend: str = "auto",
               max_seq_len: int = 4096, device: str = "auto", progress: bool = True) -> LoadedModel:
    """A preset key (see hub.PRESETS), a local transformers directory, or a Hub id -> model + tokenizer.

    dtype: the weights' precision: auto (bf16, or fp16 on a GPU without bf16 arithmetic), fp32 / bf16 /
    fp16, or int8 / int4, quantized at load (labkit's Transformer on a CPU only). int4 on the packed path runs labkit's 4-bit kernel (int8 activations,
    batch invariant), elsewhere torch's weight-only kernels with bf16 activations. A quantized model
    is a model of its own, as a draft or as a target: speculation on it reproduces its own plain
    decoding (its distance from bf16: scripts/precision_quality.py).
    backend: auto (labkit's Transformer where it covers the architecture, else transformers),
    native, hf, or a forward path (reference / onednn / packed) to skip the calibration.
    device: auto ($LABKIT_DEVICE where it is set, else CUDA when torch sees a GPU, else the CPU), cpu or cuda.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 2:
        raise ValueError(f"max_seq_len must be an integer >= 2, got {max_seq_len!r}")
    device, quantized = check_load_args(dtype, backend, device)
    dtype = DTYPES["bf16"] if quantized else DTYPES.get(resolve_dtype(dtype, device), dtype)
    source = resolve_model(name_or_path, progress=progress)
    with LoadSteps(name_or_path, progress) as steps:
        steps.now("tokenizer and config")
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
            config = AutoConfig.from_pretrained(source).to_dict()
        except OSError as e:
            raise ModelFetchError(f"could not load {name_or_path!r} ({source}): {e}\nUse a preset "
                                  "(python -m labkit models), a local directory with config.json, or a Hub id "
                                  "(needs internet).") from e
        native = runs_native(config, backend)
        check_native_dtype(native, dtype, device)
        model, backend_used, choice = None, "native", None
        steps.now("weights")
        if native:
            try:
                model = load_native(_local_dir(source), dtype, max_seq_len)
            except NotImplementedError:   # e.g. RoPE scaling: fall back to transformers under "auto"
                if backend != "auto" or quantized:
                    raise
        if model is None:
            hf = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
            model, backend_used = HFCausalLM(hf, min(max_seq_len, config.get("max_position_embeddings",
                                                                               max_seq_len))), "hf"
        elif device == "cpu":
            precision = quantized or precision_of(dtype)
            path = backend if backend in PATHS else None
            if path is None:
                from .calibrate import choose_path
                steps.now(f"choosing the forward path for {precision} (timed once per machine, then cached)")
                choice = choose_path(model.args, precision)
                path = choice.path
            steps.now(f"the {path} path")
            apply_path(model, path, precision)
        elif backend not in ("auto", "native", "reference"):
            raise ValueError(f"the {backend} path runs on a CPU, not on {device}")
        steps.now(f"on {device}")
        model = model.to(device)
    return LoadedModel(model, tokenizer, name_or_path, backend_used, _eos_ids(source, tokenizer), choice)


def draft_precision(name_or_path: str, target: LoadedModel, asked: str = "auto") -> str:
    """The precision to load a draft model in: `asked`, or for "auto" the one whose one-token forward
    is fastest on this machine (calibrate.choose_precision) where labkit's model runs it on a CPU, else
    the target's. A draft only has to be approximately right: the target decides every token."""
    if check_draft_precision(asked) != "auto":
        return asked
    target_precision = target.path.precision if target.path.precision in DTYPES else "bf16"
    if target.backend != "native" or target.path.device != "cpu":
        return target_precision
    cfg = json.loads((Path(_local_dir(resolve_model(name_or_path, progress=False))) / "config.json").read_text())
    try:
        args = ModelArgs.from_hf_config(cfg)
    except NotImplementedError:
        return target_precision
    from .calibrate import choose_precision
    return choose_precision(args).precision


def load_draft(name_or_path: str, target: LoadedModel, precision: str = "auto", backend: str = "auto",
               max_seq_len: int = 4096, progress: bool = True) -> LoadedModel:
    """A draft model for `target`: its own precision (see draft_precision), the target's device and tokenizer."""
    precision = draft_precision(name_or_path, target, precision)
    draft = load_model(name_or_path, precision, backend, max_seq_len, target.path.device, progress)
    check_same_tokenizer(target, draft)
    return draft


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
    check_same_vocab(draft.name, draft.model.vocab_size, draft.tokenizer,
                     target.name, target.model.vocab_size, target.tokenizer)


def encode_prompt(tokenizer, text: str | list[dict], chat_template: bool) -> torch.Tensor:
    """Token ids of the prompt, through the model's chat template unless told not to.

    With the template, the user's text stays text: a control-token string typed in it (say
    "<|im_start|>system") is tokenized as its characters, never as the control token, so a
    prompt cannot open a turn of its own. Raw mode (chat_template=False, --no-chat-template)
    tokenizes control-token strings as control tokens: the way to type a whole chat by hand.

    `text` may be a conversation instead, chat messages ({"role", "content"}) ending with the
    user's turn to answer; it needs the chat template, and no message may type a control token.
    """
    if isinstance(text, list):
        return _encode_conversation(tokenizer, text, chat_template)
    if not text or not text.strip():
        raise ValueError("the prompt is empty: pass --prompt \"...\" or --prompt-file FILE")
    if not (chat_template and getattr(tokenizer, "chat_template", None)):
        return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)

    def render(content: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)

    def template_ids(s: str) -> list[int]:
        return tokenizer(s, add_special_tokens=False)["input_ids"] if s else []
    sentinel = "\x00labkit-user-text\x00"
    before, sep, after = render(sentinel).partition(sentinel)
    if not sep:
        raise ValueError("the model's chat template drops the user's text: use --no-chat-template")
    real = render(text)
    ids, frame = template_ids(real), template_ids(before) + template_ids(after)
    control = set(tokenizer.added_tokens_decoder)       # <|im_start|> and friends
    if sum(i in control for i in ids) == sum(i in control for i in frame):
        return torch.tensor(ids, dtype=torch.long)       # the text typed no control token: as transformers does
    fits = real.startswith(before) and real.endswith(after) and len(real) >= len(before) + len(after)
    content = real[len(before):len(real) - len(after)] if fits else text   # as the template wrote it (trimmed?)
    return torch.tensor(template_ids(before) + text_ids(tokenizer, content) + template_ids(after), dtype=torch.long)


_PLAIN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def text_ids(tokenizer, text: str) -> list[int]:
    """The token ids of `text` as characters: no added token (special or not, such as <|im_start|> or
    <tool_call>) is matched, so a control string typed in it stays the characters it is made of."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:                                  # a slow tokenizer: its special tokens split, at least
        return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    if (plain := _PLAIN.get(tokenizer)) is None:
        from tokenizers import Tokenizer
        spec = json.loads(backend.to_str())
        spec["added_tokens"] = []                        # the model's own vocabulary and merges only
        plain = _PLAIN[tokenizer] = Tokenizer.from_str(json.dumps(spec))
    return plain.encode(text, add_special_tokens=False).ids


def _encode_conversation(tokenizer, messages: list[dict], chat_template: bool) -> torch.Tensor:
    """A conversation's token ids through the chat template, the assistant's next turn opened."""
    if not (chat_template and getattr(tokenizer, "chat_template", None)):
        raise ValueError("a conversation (several turns) goes through the model's chat template: this tokenizer has "
                         "none or it was turned off; pass one prompt text instead")
    if not messages or messages[-1].get("role") != "user" or any(not str(m.get("content", "")).strip() for m in messages):
        raise ValueError("a conversation must be non-empty messages ending with the user's turn to answer")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(ids, add_special_tokens=False)["input_ids"]
    blank = [{**m, "content": "x"} for m in messages]
    frame = tokenizer(tokenizer.apply_chat_template(blank, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)["input_ids"]
    control = set(tokenizer.added_tokens_decoder)
    if sum(i in control for i in ids) != sum(i in control for i in frame):
        raise ValueError("a message of the conversation types a control token (such as <|im_start|>): remove it, "
                         "or pass the conversation as one raw prompt with --no-chat-template")
    return torch.tensor(ids, dtype=torch.long)
