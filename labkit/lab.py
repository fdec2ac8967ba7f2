"""`python -m labkit lab` (what `make lab` runs): JupyterLab on the notebooks, headless.

The login token travels in the server's environment (JUPYTER_TOKEN), which only its own user
(and root) can read, never on a command line that `ps` shows to every user; the URL with the
token is printed once, here. One Ctrl-C stops the server (no "shut down? y/n" question).

The shipped notebooks are trusted first (what `jupyter trust notebooks/*.ipynb` does): JupyterLab draws
the saved ipywidgets (the stepper of 02, the sliders of 03 and 06) only in a trusted notebook, and shows
an untrusted one's as text (`VBox(children=(HBox(...`) until its cells run.
"""
from __future__ import annotations

import errno
import os
import secrets
import socket
import sys
from pathlib import Path

NOTEBOOK = "notebooks/00_tour.ipynb"
NOTEBOOKS = "notebooks"


def trust_notebooks(root: Path) -> list[Path]:
    """Sign every notebooks/*.ipynb under `root` in this user's signature database, as `jupyter trust` does.

    The database and key are the ones the server will check (the Jupyter data directory: JUPYTER_DATA_DIR
    when set, else ~/.local/share/jupyter); each notebook is read as the server reads it, so the
    signatures match. Returns the notebooks trusted.
    """
    import nbformat
    from jupyter_core.paths import jupyter_data_dir
    from nbformat.sign import NotebookNotary

    data_dir = Path(jupyter_data_dir())
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    paths = sorted((root / NOTEBOOKS).glob("*.ipynb"))
    with NotebookNotary(data_dir=str(data_dir)) as notary:
        for path in paths:
            nb = nbformat.read(path, as_version=4)
            if not notary.check_signature(nb):
                notary.sign(nb)
        if getattr(notary.store, "db_file", None) == ":memory:":      # nbformat's fallback: nothing kept
            raise OSError(f"the signature database {notary.db_file} could not be written")
    return paths


def check_port_free(ip: str, port: int) -> None:
    """Raise ValueError, before anything is printed or started, when `ip:port` is taken."""
    if not 0 < port < 65536:
        raise ValueError(f"port must be in 1..65535, got {port}")
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
        try:
            s.bind((ip, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"cannot listen on {ip}:{port} ({e.strerror}): stop what uses it, or choose "
                                 f"another port (make lab LAB_PORT={port + 1})") from None
            raise ValueError(f"cannot listen on {ip}:{port} ({e.strerror or e}): give an address of this machine "
                             "(make lab LAB_IP=127.0.0.1, or 0.0.0.0 for every interface)") from None


def server_command(ip: str, port: int, root: Path) -> list[str]:
    """JupyterLab's command line: no secret in it."""
    root_flag = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    return [sys.executable, "-m", "jupyterlab", "--no-browser", *root_flag, f"--ServerApp.root_dir={root}",
            f"--LabApp.default_url=/lab/tree/{NOTEBOOK}", f"--ServerApp.ip={ip}", f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0", "--ServerApp.answer_yes=True"]


def run_lab(ip: str, port: int, root: Path) -> None:
    """Check the port, print the URL once, then become the JupyterLab server (exec: Ctrl-C reaches it)."""
    check_port_free(ip, port)
    try:
        trusted = f"{len(trust_notebooks(root))} notebooks trusted: saved widgets show before anything runs"
    except Exception as e:      # noqa: BLE001 (the lab still works: the widgets appear once their cells run)
        trusted = f"could not trust the notebooks ({e}): `jupyter trust {NOTEBOOKS}/*.ipynb` does it"
    token = os.environ.pop("LAB_TOKEN", None) or secrets.token_hex(24)
    env = {**os.environ, "JUPYTER_TOKEN": token}
    host = f"[{ip}]" if ":" in ip else ip
    print(f"\n  labkit is starting. Open this URL in a browser (Ctrl-C here stops the lab):\n\n"
          f"      http://{host}:{port}/lab/tree/{NOTEBOOK}?token={token}\n\n  ({trusted})\n", flush=True)
    cmd = server_command(ip, port, root)
    os.execve(cmd[0], cmd, env)
