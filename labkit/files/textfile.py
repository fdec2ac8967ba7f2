"""Files the user named (a prompt, a question file, an output folder): every failure one clear line."""
from __future__ import annotations

import os
from pathlib import Path

MAX_BYTES = 64 << 20          # far more than any prompt or question set; /dev/zero would otherwise never end


def check_regular(path: Path, what: str) -> None:
    """Refuse what is not a file to read: a directory, a named pipe (reading one blocks until a writer comes) or a
    socket. A character device (/dev/zero, say) is read up to the size limit."""
    if path.is_dir():
        raise ValueError(f"{what} {path} is a directory: give a text file")
    if path.is_fifo():
        raise ValueError(f"{what} {path} is a named pipe, which would wait for a writer: give a regular file"
                         + (" (or --prompt-file - to read standard input)" if what == "--prompt-file" else ""))
    if path.exists() and not path.is_file() and not path.is_char_device():
        raise ValueError(f"{what} {path} is not a regular file: give a text file")


def read_text(path: str | Path, what: str, max_bytes: int = MAX_BYTES) -> str:
    """The UTF-8 text of `path` (a leading byte-order mark dropped); `what` names the argument it came from."""
    path = Path(path)
    check_regular(path, what)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise ValueError(f"{what} {path} holds more than {max_bytes >> 20} MiB: give a text file of a prompt "
                             "or of questions")
        return data.decode("utf-8-sig")
    except FileNotFoundError:
        raise ValueError(f"{what} {path} does not exist") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {e.start}: {e.reason}): give a text file") from None
    except OSError as e:
        raise ValueError(f"{what} {path} cannot be read ({e.strerror})") from None


def writable_dir(out: str | Path, what: str) -> Path:
    """The output folder `out`, created and checked writable before any work; `what` names its argument."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{what} {out} is a file: give a directory (results, tables and plots go there)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".labkit-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{what} {out}: cannot write there ({e.strerror}): give a directory you can write to") from None
    return out
