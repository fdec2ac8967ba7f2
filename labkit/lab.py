"""`python -m labkit lab` (what `make lab` runs): JupyterLab on the notebooks, headless.

The login token travels in the server's environment (JUPYTER_TOKEN), which only its own user
(and root) can read, never on a command line that `ps` shows to every user; the URL with the
token is printed once, here. One Ctrl-C stops the server (no "shut down? y/n" question).

The settings are read the same way however the lab is started: `--ip`, `--port`, `--remote`, or
else LAB_IP, LAB_PORT, LAB_REMOTE from the environment (what `make lab LAB_PORT=...` sets). The lab
serves this machine only (a loopback address) unless asked for another address *and* `--remote`.

The server runs as a child of this launcher, which turns Ctrl-C, SIGTERM or a hang-up into the
server's own clean stop (kernels shut down) and then removes the server's runtime files
(jpserver-PID.json, which holds the token, and its -open.html), whatever way the server ended.

The shipped notebooks are trusted first (what `jupyter trust notebooks/*.ipynb` does): JupyterLab draws
the saved ipywidgets (the stepper of 02, the sliders of 03 and 06) only in a trusted notebook, and shows
an untrusted one's as text (`VBox(children=(HBox(...`) until its cells run; it runs the script of a
recorded run (labkit.viz.replay, in 02 and 06) only in a trusted notebook too.
"""
from __future__ import annotations

import errno
import ipaddress
import os
import secrets
import signal
import socket
import subprocess
import sys
from pathlib import Path

NOTEBOOK = "notebooks/00_tour.ipynb"
NOTEBOOKS = "notebooks"
DEFAULT_IP, DEFAULT_PORT = "127.0.0.1", 8888


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


def lab_settings(ip: str | None, port: int | None, remote: bool) -> tuple[str, int, bool]:
    """(ip, port, remote) from the arguments, else LAB_IP / LAB_PORT / LAB_REMOTE, else the defaults (an
    empty variable counts as unset, as make exports the ones it was not given); a ValueError that names the
    setting when one is not usable."""
    env = os.environ
    if ip is None:
        ip = env.get("LAB_IP") or DEFAULT_IP
    if port is None:
        try:
            port = int(env.get("LAB_PORT") or DEFAULT_PORT)
        except ValueError:
            raise ValueError(f"LAB_PORT must be a port number (1..65535), got {env['LAB_PORT']!r}") from None
    remote = remote or remote_setting(env.get("LAB_REMOTE", ""))
    check_address(ip, remote)
    return ip, port, remote


YES, NO = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def remote_setting(value: str) -> bool:
    """LAB_REMOTE: 1 / true / yes / on allow an address other machines reach; empty, 0 / false / no / off do not;
    anything else is refused (a typo must not open the lab to the network)."""
    word = value.strip().lower()
    if word not in YES + NO:
        raise ValueError(f"LAB_REMOTE must be 1 (or true, yes, on) to serve other machines, or 0 (false, no, off), got "
                         f"{value!r}")
    return word in YES


def check_address(ip: str, remote: bool) -> None:
    """Refuse an empty address, and one other machines can reach unless `remote` says that is meant."""
    if not ip.strip():
        raise ValueError("the lab's address is empty (--ip or LAB_IP): give 127.0.0.1 to serve this machine, or "
                         "an address of this machine with --remote (make lab LAB_IP=0.0.0.0 LAB_REMOTE=1)")
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(ip, None, type=socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"cannot listen on {ip!r} ({e}): give an address of this machine (make lab "
                         "LAB_IP=127.0.0.1)") from None
    if not remote and not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise ValueError(f"--ip {ip} lets other machines reach the lab: add --remote to mean it (make lab "
                         f"LAB_IP={ip} LAB_REMOTE=1), or serve this machine only (127.0.0.1)")


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
                             "(make lab LAB_IP=127.0.0.1, or 0.0.0.0 with LAB_REMOTE=1 for every interface)") from None


def server_command(ip: str, port: int, root: Path) -> list[str]:
    """JupyterLab's command line: no secret in it."""
    root_flag = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    return [sys.executable, "-m", "jupyterlab", "--no-browser", *root_flag, f"--ServerApp.root_dir={root}",
            f"--LabApp.default_url=/lab/tree/{NOTEBOOK}", f"--ServerApp.ip={ip}", f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0", "--ServerApp.answer_yes=True"]


def run_lab(ip: str | None, port: int | None, root: Path, remote: bool = False) -> int:
    """Check the settings and the port, print the URL once, serve until Ctrl-C; the server's exit code."""
    ip, port, remote = lab_settings(ip, port, remote)
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
    return serve(server_command(ip, port, root), env)


def serve(cmd: list[str], env: dict) -> int:
    """Run the server as a child in its own process group (Ctrl-C reaches this launcher only, which turns it
    into one SIGTERM: the server's clean stop), wait for it, and remove its runtime files however it ended."""
    server = None

    def stop(signum, frame):
        if server is not None and server.poll() is None:
            server.send_signal(signal.SIGTERM)
    handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        server = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, preexec_fn=_child_setup)
        code = server.wait()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if server is not None:
            remove_runtime_files(server.pid, env)
    if code in (0, -signal.SIGTERM):                # stopped as asked
        return 0
    return 128 - code if code < 0 else code          # killed by signal N: 128 + N, as a shell reports it


def _child_setup() -> None:
    """In the server, before it runs: a process group of its own, and a SIGTERM should the launcher die."""
    os.setpgrp()
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)      # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def remove_runtime_files(pid: int, env: dict) -> list[Path]:
    """The server's jpserver-PID.json (it holds the token) and jpserver-PID-open.html, if it left them."""
    from jupyter_core.paths import jupyter_runtime_dir
    old = os.environ.get("JUPYTER_RUNTIME_DIR")
    try:
        if env.get("JUPYTER_RUNTIME_DIR"):
            os.environ["JUPYTER_RUNTIME_DIR"] = env["JUPYTER_RUNTIME_DIR"]
        runtime = Path(jupyter_runtime_dir())
    finally:
        if old is None:
            os.environ.pop("JUPYTER_RUNTIME_DIR", None)
        else:
            os.environ["JUPYTER_RUNTIME_DIR"] = old
    removed = []
    for f in (runtime / f"jpserver-{pid}.json", runtime / f"jpserver-{pid}-open.html"):
        try:
            f.unlink()
            removed.append(f)
        except FileNotFoundError:
            pass
    return removed
