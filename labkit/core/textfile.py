"""Reading a text file the user named (a prompt, a question file): every failure one clear line."""
from __future__ import annotations

from pathlib import Path


def read_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of `path` (a leading byte-order mark dropped); `what` names the argument it came from."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path} is a directory: give a text file")
    try:
        return path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise ValueError(f"{what} {path} does not exist") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {e.start}: {e.reason}): give a text file") from None
    except OSError as e:
        raise ValueError(f"{what} {path} cannot be read ({e.strerror})") from None
