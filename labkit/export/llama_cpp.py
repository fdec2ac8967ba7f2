"""An EAGLE-3 head as llama.cpp runs it: one GGUF file, written by llama.cpp's own converter.

llama.cpp's `convert_hf_to_gguf.py` reads the speculators layout (`eagle3.py`) with the target's directory
beside it (`--target-model-dir`: the tokenizer, the target's width and layer count); the file it writes runs as
`llama-speculative-simple -m TARGET.gguf -md HEAD.gguf --spec-type draft-eagle3`. The converter is the one in
the llama.cpp source `make llama-cpp` fetches (build/llama.cpp/src; LABKIT_LLAMA_CPP_SRC names another), run
with its own gguf-py; converting needs the source only, not the build.

    export_llama_cpp(head_dir, target_dir, out)  -> out/<head>-bf16.gguf
    cached_gguf(head_dir, target_dir)            -> the same file, made once per head version (the bench's)
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..files.shipped import CHECKOUT
from ..files.textfile import writable_dir
from .eagle3 import export_eagle3

CONVERTER = "convert_hf_to_gguf.py"
OUTTYPES = ("bf16", "f16", "f32", "q8_0")


def source_dir() -> Path:
    return Path(os.environ.get("LABKIT_LLAMA_CPP_SRC") or CHECKOUT / "build" / "llama.cpp" / "src")


def check_converter() -> Path:
    script = source_dir() / CONVERTER
    if not script.is_file():
        raise ValueError(f"the llama-cpp format is written by llama.cpp's own {CONVERTER}, not found in "
                         f"{source_dir()}: run `make llama-cpp-src` (the source alone, a minute) or `make llama-cpp`, "
                         "or set LABKIT_LLAMA_CPP_SRC to a llama.cpp checkout")
    return script


def gguf_name(head_dir: str | Path, outtype: str = "bf16") -> str:
    """The file a head's conversion writes: <head folder>-<type>.gguf."""
    return f"{Path(head_dir).resolve().name}-{outtype}.gguf"


def export_llama_cpp(head_dir: str | Path, target_dir: str | Path, out: str | Path, outtype: str = "bf16",
                     steps: int | None = None) -> Path:
    """Convert labkit's EAGLE-3 head in `head_dir` (trained on the target in `target_dir`, a transformers
    directory) into a GGUF in `out`; returns the file's path."""
    if outtype not in OUTTYPES:
        raise ValueError(f"unknown GGUF type {outtype!r}: choose from {', '.join(OUTTYPES)}")
    script = check_converter()
    out = writable_dir(out, "--out")
    gguf = out / gguf_name(head_dir, outtype)
    partial = gguf.with_suffix(".partial")         # renamed once whole: a failed conversion leaves no .gguf
    with tempfile.TemporaryDirectory(prefix="labkit-eagle3-") as tmp:
        export_eagle3(head_dir, target_dir, Path(tmp) / "speculators", "speculators", steps)
        res = subprocess.run([sys.executable, str(script), str(Path(tmp) / "speculators"), "--target-model-dir",
                              str(Path(target_dir).resolve()), "--outtype", outtype, "--outfile", str(partial)],
                             capture_output=True, text=True, stdin=subprocess.DEVNULL,
                             env={k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"})
    if res.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp's {CONVERTER} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    partial.replace(gguf)
    return gguf


def command_line(target_gguf: str | Path, head_gguf: str | Path, steps: int, threads: int = 2) -> str:
    """The llama.cpp command that decodes with the head as its EAGLE-3 draft, greedy."""
    return (f"llama-speculative-simple -m {target_gguf} -md {head_gguf} --spec-type draft-eagle3 "
            f"--spec-draft-n-max {steps} -t {threads} -td {threads} --temp 0 -n 128 -p PROMPT")


def cached_gguf(head_dir: str | Path, target_dir: str | Path) -> Path:
    """The head's GGUF under the cache (<cache>/gguf/heads/<head>-<sha of its weights>/), converted once."""
    from ..models.hub import cache_dir
    head_dir = Path(head_dir)
    digest = hashlib.sha256((head_dir / "model.safetensors").read_bytes()).hexdigest()[:12]
    folder = cache_dir() / "gguf" / "heads" / f"{head_dir.resolve().name}-{digest}"
    made = folder / gguf_name(head_dir)
    return made if made.is_file() else export_llama_cpp(head_dir, target_dir, folder)
