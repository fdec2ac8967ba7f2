"""`make lab` (python -m labkit lab): the shipped notebooks are trusted (their saved widgets drawn before
anything runs), the token stays off command lines, one Ctrl-C stops it, a busy port is refused before
anything is printed. A real JupyterLab server, started and stopped here. Every test keeps its Jupyter data
directory (signature database, key) in tmp_path: the user's is left alone."""
import json
import os
import pty
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
from nbformat.sign import NotebookNotary

from labkit.lab import trust_notebooks

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lab_env(tmp_path) -> dict:
    return {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"), "JUPYTER_DATA_DIR": str(tmp_path / "data"),
            "LAB_TOKEN": "",
            "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def command_lines() -> list[str]:
    """Every process's command line that this user can read (all of them, as root)."""
    lines = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                lines.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                pass
    return lines


def test_token_stays_off_command_lines_and_one_ctrl_c_stops_the_lab(tmp_path):
    port = free_port()
    # stdin a terminal, as for a learner: JupyterLab then asks "shut down? y/n" on Ctrl-C unless told not to
    controller, terminal = pty.openpty()
    log = open(tmp_path / "lab.log", "w+")
    server = subprocess.Popen([sys.executable, "-m", "labkit", "lab", "--port", str(port)], cwd=tmp_path,
                              env=lab_env(tmp_path), stdin=terminal, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline, token = time.monotonic() + 90, None
        while True:
            log.seek(0)
            text = log.read()
            if token is None and (m := re.search(r"\?token=([0-9a-f]{48})", text)):
                token = m.group(1)
            if token:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2)
                    break
                except OSError:
                    pass
            assert server.poll() is None and time.monotonic() < deadline, f"the lab did not start:\n{text[-3000:]}"
            time.sleep(0.5)
        assert re.search(r"\(\d+ notebooks trusted: saved widgets show", text), f"no trust line:\n{text[-3000:]}"
        leaks = [c for c in command_lines() if token in c]
        assert not leaks, f"the token is on a command line: {leaks}"
        assert text.count(token) == 1, "the URL with the token is printed once"
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/terminals", timeout=5)
            raise AssertionError("the API answered without the token")
        except urllib.error.HTTPError as e:
            assert e.code == 403
        runtime = tmp_path / "runtime"
        assert list(runtime.glob("jpserver-*.json")), "the server wrote its runtime file (it holds the token)"
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=20) == 0           # no question, no 5 s wait for an answer
        assert not list(runtime.glob("jpserver-*")), "the runtime files were removed"
        log.seek(0)
        assert "received signal 15, stopping" in log.read(), "the server stopped cleanly (its kernels too)"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        os.close(controller), os.close(terminal)
        log.close()


def test_the_lab_trusts_the_shipped_notebooks(tmp_path, monkeypatch):
    """Untrusted, JupyterLab shows a saved widget as text (`VBox(children=(HBox(...`) until its cell runs."""
    data = tmp_path / "data"
    data.mkdir()
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(data))
    # a still copy: others may rewrite notebooks/ while this runs
    shutil.copytree(ROOT / "notebooks", tmp_path / "repo" / "notebooks", ignore=shutil.ignore_patterns(".*"))
    shipped = sorted((tmp_path / "repo" / "notebooks").glob("*.ipynb"))
    with_widgets = [p.name for p in shipped if json.loads(p.read_text())["metadata"].get("widgets")]
    assert with_widgets, "no notebook has saved widget state (metadata.widgets) to show before a run"
    with NotebookNotary(data_dir=str(data)) as notary:
        assert not any(notary.check_signature(nbformat.read(p, as_version=4)) for p in shipped)
    assert trust_notebooks(tmp_path / "repo") == shipped
    assert (data / "nbsignatures.db").exists(), "the signatures went to the Jupyter data directory"
    with NotebookNotary(data_dir=str(data)) as notary:             # what the server checks on opening one
        untrusted = [p.name for p in shipped if not notary.check_signature(nbformat.read(p, as_version=4))]
    assert not untrusted, f"still untrusted after labkit.lab.trust_notebooks: {untrusted}"
    assert trust_notebooks(tmp_path / "repo") == shipped              # again (the next `make lab`): no error


def test_a_busy_port_is_refused_before_the_banner(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "labkit", "lab", "--port", str(port)], cwd=tmp_path,
                             env=lab_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" in res.stderr
    assert f"LAB_PORT={port + 1}" in res.stderr


def start_lab(tmp_path, port: int, **env) -> tuple[subprocess.Popen, str]:
    """A lab server started as `make lab` starts it, its stdout logged; (the process, its token) once it answers."""
    log = open(tmp_path / "lab.log", "w+")
    server = subprocess.Popen([sys.executable, "-m", "labkit", "lab", *(["--port", str(port)] if port else [])],
                              cwd=tmp_path, env={**lab_env(tmp_path), **env}, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while True:
        log.seek(0)
        text = log.read()
        if m := re.search(r"\?token=([0-9a-f]{48})", text):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port or env['LAB_PORT']}/api/status?token={m.group(1)}",
                                       timeout=2)
                return server, text
            except OSError:
                pass
        assert server.poll() is None and time.monotonic() < deadline, f"the lab did not start:\n{text[-3000:]}"
        time.sleep(0.5)


def test_the_runtime_files_go_even_when_the_server_is_killed_and_lab_port_is_read(tmp_path):
    """Started the way `make lab LAB_PORT=...` starts it (settings in the environment, no arguments); the
    server killed with SIGKILL, which leaves it no chance to clean up: the launcher removes its files."""
    port = free_port()
    server, text = start_lab(tmp_path, 0, LAB_PORT=str(port), LAB_IP="127.0.0.1")
    try:
        assert f"http://127.0.0.1:{port}/lab/tree/" in text
        runtime = tmp_path / "runtime"
        (info,) = runtime.glob("jpserver-*.json")
        child = int(info.stem.split("-")[1])
        assert child != server.pid, "the server runs as a child of the launcher"
        os.kill(child, signal.SIGKILL)
        assert server.wait(timeout=20) == 128 + signal.SIGKILL
        assert not list(runtime.glob("jpserver-*")), "the launcher removed what the killed server left"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_lab_settings_from_the_environment_are_checked(tmp_path, monkeypatch):
    for env, message in (({"LAB_PORT": "eighty"}, "LAB_PORT must be a port number"),
                         ({"LAB_IP": "   "}, "the lab's address is empty"),
                         ({"LAB_IP": "0.0.0.0"}, "lets other machines reach the lab: add --remote"),
                         ({"LAB_IP": "no-such-host.invalid"}, "cannot listen on 'no-such-host.invalid'")):
        res = subprocess.run([sys.executable, "-m", "labkit", "lab"], cwd=tmp_path,
                             env={**lab_env(tmp_path), **env}, capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and res.stdout == "", (env, res.stdout)
        assert res.stderr.count("\n") == 1 and message in res.stderr, (env, res.stderr)
    from labkit.lab import lab_settings
    assert lab_settings("0.0.0.0", 8890, remote=True) == ("0.0.0.0", 8890, True), "asked for explicitly: allowed"
    assert lab_settings("localhost", 8890, remote=False)[0] == "localhost"
    monkeypatch.setenv("LAB_IP", "")                             # what `make lab` exports when not given them
    monkeypatch.setenv("LAB_PORT", "")
    assert lab_settings(None, None, remote=False) == ("127.0.0.1", 8888, False)
