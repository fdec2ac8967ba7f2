"""Where the lab's files are. Shipped: `data/` (trained heads, question sets, benchmark results) and `build/` (a
peer built from source) sit beside the package in a checkout of the repository; `LABKIT_DATA` points at another
`data/` folder, for a package installed elsewhere, and a missing file is an error that says so. Made here: the
cache (converted models, compiled kernels, calibration), `cache_dir()`."""
from __future__ import annotations

import os
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]          # the repository root, when labkit runs from a checkout


def shipped(*parts: str, must_exist: bool = True) -> Path:
    """data/<parts...>: e.g. shipped("heads", "medusa-qwen2.5-coder-1.5b")."""
    root = Path(os.environ["LABKIT_DATA"]) if os.environ.get("LABKIT_DATA") else CHECKOUT / "data"
    path = root.joinpath(*parts)
    if must_exist and not path.exists():
        raise FileNotFoundError(f"{path} is not here: the lab's shipped data (data/: heads, questions, benchmark "
                                "results) comes with a checkout of the repository (git clone); where labkit is "
                                "installed without one, set LABKIT_DATA to a checkout's data/ folder")
    return path


def cache_dir() -> Path:
    """$LABKIT_CACHE, else $XDG_CACHE_HOME/labkit, else ~/.cache/labkit; a folder (made when first written)."""
    if os.environ.get("LABKIT_CACHE"):
        path, what = Path(os.environ["LABKIT_CACHE"]).expanduser(), "LABKIT_CACHE"
    else:
        path, what = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "labkit", \
            "labkit's cache"
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} is not a folder: point LABKIT_CACHE at a folder (the converted models, "
                         "compiled kernels and calibration are kept there), or move that file away")
    return path
