"""What can be checked about a model load before any weight is read, in one place for the command line, the
bench and the API: the arguments (precision, forward path, device), the names of a target and its draft, and
whether they share a vocabulary, from their config and tokenizer files alone.

    check_models("qwen2.5-coder-1.5b-instruct", "bf16", draft="qwen2.5-coder-0.5b-instruct")   # or a ValueError
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .backends import PATHS, PRECISIONS, QUANTIZED, check_path, precision_of
from .hub import PRESETS, converted_dir, is_converted, resolve_model

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}
# native: labkit's Transformer on the path this machine measured fastest; a path name forces that path
BACKENDS = ("auto", "native", "hf", *PATHS)
DEVICES = ("auto", "cpu", "cuda")


def auto_device() -> str:
    """What device="auto" means: $LABKIT_DEVICE where it is set (cpu or cuda: e.g. the CPU of a GPU machine), else
    the GPU where torch sees one, else the CPU."""
    chosen = os.environ.get("LABKIT_DEVICE", "")
    if chosen and chosen not in ("cpu", "cuda"):
        raise ValueError(f"LABKIT_DEVICE must be cpu or cuda (or unset, for the GPU where there is one), got {chosen!r}")
    if chosen == "cuda" and not torch.cuda.is_available():
        raise ValueError("LABKIT_DEVICE=cuda but torch sees no GPU here: unset it, or set it to cpu")
    return chosen or ("cuda" if torch.cuda.is_available() else "cpu")


def check_load_args(dtype: str | torch.dtype, backend: str, device: str) -> tuple[str, str | None]:
    """(the device, the quantized precision or None): a load's arguments checked before anything is read."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        device = auto_device()
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no GPU here: use device='auto' or 'cpu'")
    if not isinstance(dtype, torch.dtype) and dtype not in (*DTYPES, *QUANTIZED, "auto"):
        raise ValueError(f"dtype must be one of {['auto'] + sorted(DTYPES) + list(QUANTIZED)}, got {dtype!r}")
    dtype = resolve_dtype(dtype, device)
    quantized = dtype if dtype in QUANTIZED else None
    if quantized and backend == "hf":
        raise ValueError(f"{dtype} weights run labkit's model: use backend 'auto' or 'native', not 'hf'")
    if quantized and device != "cpu":
        raise ValueError(f"{dtype} weights run labkit's CPU kernels: on {device} use dtype 'auto' (bf16, or fp16 on "
                         "a GPU without bf16), which the compiled GPU loop decodes at the memory wall; or device='cpu'")
    if device != "cpu" and backend in PATHS and backend != "reference":
        raise ValueError(f"the {backend} path runs on a CPU; on {device} use backend='reference' (or 'auto')")
    if device == "cpu" and backend in PATHS:
        precision = quantized or (precision_of(dtype) if isinstance(dtype, torch.dtype) else precision_of(DTYPES[dtype]))
        if precision in PRECISIONS:
            check_path(backend, precision)
    return device, quantized


def resolve_dtype(dtype: str | torch.dtype, device: str) -> str | torch.dtype:
    """dtype 'auto': bf16, except fp16 on a GPU without bf16 arithmetic (compute capability below 8.0: a T4, a
    V100), where bf16 would be emulated; any other dtype as given."""
    if dtype != "auto":
        return dtype
    if device == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return "fp16"
    return "bf16"


def runs_native(config: dict, backend: str) -> bool:
    """Whether a checkpoint with this config.json runs on labkit's Transformer (else on transformers)."""
    return backend != "hf" and (backend != "auto" or config.get("model_type") in ("llama", "qwen2"))


def check_native_dtype(native: bool, dtype: str | torch.dtype, device: str, what: str = "dtype") -> None:
    """fp16 weights run labkit's model on a GPU only; `what` names the setting (dtype, draft precision)."""
    if native and device == "cpu" and DTYPES.get(dtype, dtype) == torch.float16:
        flag = "--" + what.replace(" ", "-")
        raise ValueError(f"{what} fp16 ({flag} fp16) runs labkit's model on a GPU only: on a CPU use bf16 or fp32 "
                         "(or backend='hf', --backend hf, for transformers' own fp16 on a CPU)")


def check_models(target: str, dtype: str = "bf16", backend: str = "auto", device: str = "auto",
                 draft: str | None = None, draft_precision: str = "auto") -> None:
    """What can be checked about a target (and its draft) before either loads, in one place for the command
    line, the bench and the API: the arguments, both names, and the vocabularies from their files alone."""
    device, _ = check_load_args(dtype, backend, device)
    check_model_name(target)
    target_dir = on_disk(target)
    if target_dir is not None:
        check_native_dtype(runs_native(_config(target_dir), backend), dtype, device)
        check_native_config(target_dir, backend)
    if draft is None:
        return
    if draft_precision != "auto":
        check_load_args(check_draft_precision(draft_precision), backend, device)
    check_model_name(draft)
    draft_dir = on_disk(draft)
    if draft_dir is not None:
        check_native_config(draft_dir, backend)
    if draft_dir is not None and draft_precision != "auto":
        check_native_dtype(runs_native(_config(draft_dir), backend), draft_precision, device, "draft precision")
    if draft in PRESETS and target in PRESETS and PRESETS[draft].tokenizer != PRESETS[target].tokenizer:
        raise ValueError(f"the draft {draft!r} uses a different tokenizer than the target {target!r} "
                         f"({PRESETS[draft].tokenizer} vs {PRESETS[target].tokenizer}): pick a draft model from the "
                         "target's family (same tokenizer), or use --drafter lookup, which needs no model")
    if target_dir and draft_dir:
        from transformers import AutoTokenizer
        same_files = same_tokenizer_files(draft_dir, target_dir)      # then the same vocabulary: nothing to load
        check_same_vocab(draft, _config(draft_dir).get("vocab_size"),
                         None if same_files else AutoTokenizer.from_pretrained(draft_dir),
                         target, _config(target_dir).get("vocab_size"),
                         None if same_files else AutoTokenizer.from_pretrained(target_dir))


def check_native_config(folder: Path, backend: str) -> None:
    """A config.json labkit's Transformer would run must give the shape it reads (the keys and their types)."""
    config = _config(folder)
    if not config or not runs_native(config, backend):
        return
    from .transformer import ModelArgs
    try:
        ModelArgs.from_hf_config(config)
    except NotImplementedError:
        return                                            # transformers runs it instead (under auto)
    except ValueError as e:
        raise ValueError(f"{folder}: {e}") from None


def check_model_name(name: str) -> None:
    """A preset's name, a local model directory or a reachable Hub id; nothing is downloaded or converted."""
    if not isinstance(name, str):
        raise ValueError(f"a model is named by a string (a preset, a local directory or a Hub id), got {name!r}")
    if name not in PRESETS:
        resolve_model(name, progress=False)


def on_disk(name: str) -> Path | None:
    """The local directory of a converted preset or a local model folder, else None (nothing is fetched)."""
    if name in PRESETS:
        return converted_dir(name) if is_converted(name) else None
    return Path(name).expanduser() if Path(name).expanduser().is_dir() else None


def _config(folder: Path) -> dict:
    """A local model's config.json ({} where it cannot be read: loading says why)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def check_draft_precision(asked: str) -> str:
    if asked not in ("auto", "fp32", "bf16", "fp16", *QUANTIZED):
        raise ValueError(f"draft precision must be auto, fp32, bf16, fp16, int8 or int4, got {asked!r}")
    return asked


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def same_tokenizer_files(a: Path, b: Path) -> bool:
    """Whether two model folders hold byte-identical tokenizer files (so the same vocabulary, without loading
    either tokenizer: a second or two each); False where either lacks them, and the tokenizers are compared."""
    try:
        return all((a / f).read_bytes() == (b / f).read_bytes() for f in TOKENIZER_FILES)
    except OSError:
        return False


def check_same_vocab(draft: str, draft_vocab: int | None, draft_tokenizer, target: str, target_vocab: int | None,
                     target_tokenizer) -> None:
    """The same vocabulary: the configs' sizes and the tokenizers' ids (None for both tokenizers: known equal)."""
    differ = draft_tokenizer is not None and draft_tokenizer.get_vocab() != target_tokenizer.get_vocab()
    if draft_vocab != target_vocab or differ:
        raise ValueError(f"the draft {draft!r} uses a different tokenizer than the target {target!r} "
                         f"(vocab {draft_vocab} vs {target_vocab}): pick a draft model from the "
                         "target's family (same tokenizer), or use --drafter lookup, which needs no model")
