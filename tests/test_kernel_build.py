"""Building labkit's CPU kernels survives any death of the builder: a build killed with SIGKILL leaves no lock that
blocks the next load, a live build makes others wait (and a wait that runs out names the folder), and a cache
where nothing can be written falls back to the reference path with a one-line note. Each test builds in a cache
of its own (LABKIT_CACHE), in a fresh process, as a second checkout or a notebook would."""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit.kernels import cpu

ROOT = Path(__file__).resolve().parent.parent
ok, why = cpu.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"labkit's CPU kernels do not build here: {why}")
LOAD = "from labkit.kernels.cpu import load; load(); print('loaded')"


def env_with(cache: Path, **extra) -> dict:
    return {**os.environ, "LABKIT_CACHE": str(cache), "PYTHONPATH": str(ROOT), **extra}


def test_a_build_killed_with_sigkill_does_not_block_the_next_load(tmp_path):
    kernels = tmp_path / "kernels"
    builder = subprocess.Popen([sys.executable, "-c", LOAD], env=env_with(tmp_path), cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list(kernels.glob(".*-*/build.ninja")):           # the compiler is running in its own folder
        assert builder.poll() is None and time.monotonic() < deadline, builder.communicate()
        time.sleep(0.2)
    time.sleep(2)
    builder.send_signal(signal.SIGKILL)                          # the builder only: its compilers run on, orphaned
    builder.wait()
    lock_file = next(kernels.glob("*.lock"))
    with open(lock_file) as f:                                   # the operating system released its lock
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.killpg(builder.pid, signal.SIGKILL)                       # now stop the orphans too (they only cost time)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", LOAD], env=env_with(tmp_path), cwd=tmp_path, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0 and res.stdout.strip() == "loaded", res.stderr[-2000:]
    assert "compiling labkit's CPU kernels" in res.stderr and "waiting" not in res.stderr
    assert not list(kernels.glob(".*-*")), "the dead build's folder was removed"
    assert len(list(kernels.glob("*/labkit_cpu_*.so"))) == 1
    again = subprocess.run([sys.executable, "-c", LOAD], env=env_with(tmp_path), cwd=tmp_path, capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0 and again.stderr == "", "a finished build is imported, not built again"
    print(f"rebuilt in {time.monotonic() - t0:.0f} s")


def test_a_live_build_makes_a_second_load_wait_and_a_long_wait_names_the_folder(tmp_path):
    tag = cpu._build_tag()
    (tmp_path / "kernels").mkdir()
    with open(tmp_path / "kernels" / f"{tag}.lock", "w") as lock:   # as a live builder in another process holds it
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.write("4242\n")
        lock.flush()
        code = ("from labkit.kernels.cpu import available; ok, why = available(); print(ok); print(why)")
        res = subprocess.run([sys.executable, "-c", code], env=env_with(tmp_path, LABKIT_BUILD_TIMEOUT="3"),
                             cwd=tmp_path, capture_output=True, text=True, timeout=60)
    out = res.stdout.splitlines()
    assert res.returncode == 0 and out[0] == "False", res.stderr
    assert f"process 4242 has been building labkit's CPU kernels in {tmp_path / 'kernels' / tag}" in out[1]
    assert "LABKIT_BUILD_TIMEOUT" in out[1] and "reference path runs instead" in out[1]
    assert res.stderr.count("\n") == 1 and "waiting for process 4242" in res.stderr


def test_a_cache_where_nothing_can_be_written_falls_back_to_the_reference_path(tmp_path):
    (tmp_path / "kernels").write_text("a file where the kernels' folder goes")
    code = "from labkit.models.calibrate import candidates; print(','.join(candidates('fp32')))"
    res = subprocess.run([sys.executable, "-c", code], env=env_with(tmp_path), cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and "packed" not in res.stdout and "reference" in res.stdout, res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert f"cannot write labkit's kernel cache {tmp_path / 'kernels'}" in res.stderr and "LABKIT_CACHE" in res.stderr
