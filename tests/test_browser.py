"""The lab as a learner meets it: real JupyterLab, Debian's Chromium driven by Playwright.

Starts JupyterLab headless on a free port, opens the stepper notebook (02), runs all its cells
from the Run menu, presses "next step", moves the γ slider, and checks that the coloured
tokens and the matplotlib plot appear in the widget. A screenshot goes to test-artifacts/.
Outside CI a machine without chromium or playwright skips it; in CI (CI=true) that fails.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "notebooks/02_greedy_speculative.ipynb"
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# The settings a learner's lab gets from `make venv` (no news pop-up), and no autosave: the test
# runs the committed notebook and must leave it as it was.
LAB_SETTINGS = {"@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
                "@jupyterlab/docmanager-extension/plugin": {"autosave": False}}
RUN_TIMEOUT_MS = 600_000     # loading the pair and running every cell (about 1.5 min on a quiet 2-core CPU)

pytestmark = pytest.mark.integration


def need(what: str, fix: str):
    message = f"the browser test needs {what}: {fix}"
    if os.environ.get("CI") == "true":
        pytest.fail(message + " (CI must run it: `make test` installs chromium as root or with sudo)")
    pytest.skip(message)


@pytest.fixture(scope="module")
def sync_playwright():
    if not Path(CHROMIUM).exists():
        need("Debian's chromium at /usr/bin/chromium", "run `sudo apt-get install chromium` (make test does)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        need("playwright", "run `make venv` (it is pinned in requirements.txt)")
    return sync_playwright


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(log: Path) -> str:
    return log.read_text()[-3000:]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server rooted at the repository: yields its base URL and token, then stops it."""
    home = tmp_path_factory.mktemp("lab")
    for plugin, values in LAB_SETTINGS.items():
        f = home / "settings" / f"{plugin}.jupyterlab-settings"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(values))
    port, token = free_port(), secrets.token_hex(16)
    cmd = [sys.executable, "-m", "labkit", "lab", "--port", str(port)]      # what `make lab` runs
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "LAB_TOKEN": token,
           "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces")}
    log = open(home / "lab.log", "w")
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not start:\n{log_tail(home / 'lab.log')}")
                time.sleep(0.5)
        yield url, token, home / 'lab.log'
    finally:
        try:   # stops the server and its kernels (the kernel holds the model pair: several GB)
            urllib.request.urlopen(urllib.request.Request(f"{url}/api/shutdown?token={token}", method="POST"), timeout=10)
        except OSError:
            pass
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def stepper_head(page, text: str = ""):
    """The stepper's header line inside the widget's output (the notebook also shows a static step above it)."""
    return page.locator(".jp-OutputArea-output .widget-output .lk-step-head", has_text=text or None).last


def server_state(url: str, token: str, log: Path) -> str:
    """What the server knew when the test failed: its kernels and the end of its log (for CI's output)."""
    try:
        with urllib.request.urlopen(f"{url}/api/kernels?token={token}", timeout=30) as response:
            kernels = [(k["id"][:8], k["execution_state"]) for k in json.loads(response.read())]
    except OSError as error:
        kernels = f"unavailable ({error})"
    return f"kernels: {kernels}\nJupyterLab log (end):\n{log_tail(log)}"


def run_all_cells(page):
    page.get_by_role("menuitem", name="Run", exact=True).click()            # Run > Run All Cells
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()


def cells_pending(page) -> int:
    """Cells queued or running (their prompt shows [*])."""
    return page.locator(".jp-Notebook .jp-InputPrompt", has_text="[*]").count()


def tracebacks(page) -> list[str]:
    """The error outputs (stderr with a traceback or an error) shown in the notebook."""
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    return [t for t in errors.all_inner_texts() if "Traceback" in t or "Error" in t]


def test_stepper_notebook_runs_in_jupyterlab_and_chromium(sync_playwright, lab):
    url, token, log = lab
    before = hashlib.sha256((ROOT / NOTEBOOK).read_bytes()).hexdigest()
    ARTIFACTS.mkdir(exist_ok=True)
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1400})
        try:
            # Should JupyterLab still ask for a kernel, answer as a person would: keep the running kernel
            # ("Cancel") when the notebook has one, else take its own kernel ("Select")
            def answer(dialog):
                cancel = dialog.locator(".jp-mod-reject")
                (cancel if cancel.inner_text().strip() == "Cancel" else dialog.locator(".jp-mod-accept")).click()
            page.add_locator_handler(page.locator(".jp-Dialog", has_text="Select Kernel"), answer)
            page.goto(f"{url}/lab/tree/{NOTEBOOK}?token={token}")
            page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
            # the kernel connected and idle: the status bar says so (the toolbar's execution indicator shows
            # "idle" already while the notebook has no kernel yet, and Run All then asks for one)
            idle = page.locator(".jp-StatusBar-TextItem", has_text=re.compile(r"^Python 3 \(ipykernel\) \| Idle$")).first
            idle.wait_for(timeout=90_000)
            run_all_cells(page)
            # Run All again if the queue empties without the stepper appearing (a kernel change drops the
            # queued cells); give up after RUN_TIMEOUT_MS
            head, runs, quiet = stepper_head(page), 1, 0
            deadline = time.monotonic() + RUN_TIMEOUT_MS / 1000
            while not head.is_visible():
                assert time.monotonic() < deadline, (f"the stepper did not appear after {runs} Run All (see the "
                                                     f"failure screenshot)\n{server_state(url, token, log)}")
                errors = tracebacks(page)
                assert not errors, errors[0][-2000:]
                try:
                    head.wait_for(timeout=15_000)
                except PlaywrightTimeout:
                    # nothing queued, kernel idle, no stepper: twice in a row (not a render lagging behind)
                    quiet = quiet + 1 if cells_pending(page) == 0 and idle.is_visible() else 0
                    if quiet == 2 and not head.is_visible():
                        run_all_cells(page)
                        runs, quiet = runs + 1, 0
            assert head.inner_text().startswith("step 1: γ = 4")

            widget = page.locator(".jp-OutputArea-output").filter(has=page.get_by_role("button", name="next step")).last
            widget.get_by_role("button", name="next step").click()
            stepper_head(page, "step 2: γ = 4").wait_for(timeout=60_000)
            coloured = widget.locator(".lk-accepted, .lk-rejected, .lk-correction, .lk-bonus")
            assert coloured.count() > 0, "no coloured tokens in the stepper"
            assert coloured.first.evaluate("e => getComputedStyle(e).backgroundColor") != "rgba(0, 0, 0, 0)"
            plot = widget.locator("img").last
            plot.wait_for(timeout=30_000)
            assert plot.evaluate("img => img.complete && img.naturalWidth > 100"), "the plot image did not load"

            handle = widget.locator(".widget-slider .noUi-handle").first         # γ slider: one step right
            handle.click()
            handle.press("ArrowRight")
            stepper_head(page, "step 1: γ = 5").wait_for(timeout=60_000)        # a new γ restarts the decode
            assert widget.locator("img").last.evaluate("img => img.naturalWidth > 100")
            widget.locator("img").last.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "browser_stepper.png"))
            errors = tracebacks(page)
            assert not errors, errors[0][-2000:]
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "browser_stepper_failure.png"))
            raise
        finally:
            browser.close()
    assert hashlib.sha256((ROOT / NOTEBOOK).read_bytes()).hexdigest() == before, "the browser run changed the notebook"
