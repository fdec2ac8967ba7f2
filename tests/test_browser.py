"""The lab as a learner meets it: real JupyterLab, Debian's Chromium driven by Playwright.

Starts JupyterLab headless on a free port, the way `make lab` does (`python -m labkit lab`, which trusts
the notebooks first, here into a fresh Jupyter data directory). Before anything runs, opens the notebooks
with saved widgets (02, 03, 06) and checks that JupyterLab draws the widgets from the state saved in the
notebook (sliders, buttons, the Output widget's plot), not their text repr `VBox(children=(...`. Then
opens the stepper notebook (02), runs all its cells from the Run menu, presses "next step", moves the
γ slider, and checks that the coloured tokens and the matplotlib plot appear in the widget.
Screenshots go to test-artifacts/ (NN_before_run.png, browser_stepper.png).
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
# the notebooks whose saved widgets a learner sees before running anything (the stepper, the sliders)
SAVED_WIDGETS = ["notebooks/02_greedy_speculative.ipynb", "notebooks/03_speculative_sampling.ipynb",
                 "notebooks/06_tree_speculation.ipynb"]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
DRAWN_WIDGET = ".jp-OutputArea-output:has(> .jupyter-widgets)"      # an output that shows a widget view
WIDGET_REPRS = ("VBox(children=", "HBox(children=", "interactive(children=")   # an undrawn widget's text/plain
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
    # a fresh Jupyter data directory: no notebook is trusted but by `python -m labkit lab` itself, and the
    # user's signature database is left alone
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "JUPYTER_DATA_DIR": str(home / "data"), "LAB_TOKEN": token,
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


def play_replay(replay) -> None:
    """Play a recorded run or a figure grid (labkit.viz.replay): step it forward when it has steps, and move each
    parameter (γ, a tree budget, temperature, top-k) to another recorded value; each must change what it shows."""
    label, view = replay.locator(".lk-replay-label"), replay.locator(".lk-replay-view")
    replay.scroll_into_view_if_needed()
    first = re.fullmatch(r"(.+? = [^,]+(?:, .+? = [^,]+)*?)(?:, step 1 of (\d+))?", label.inner_text())
    assert first, f"the replay does not name its setting or did not start at its first step: {label.inner_text()!r}"
    setting, n_steps = first.group(1), int(first.group(2) or 1)
    stepped = replay.locator(".lk-replay-next").count() > 0
    assert stepped == (first.group(2) is not None), f"step controls and label disagree: {label.inner_text()!r}"
    shown = view.inner_html()
    if n_steps > 1:
        replay.locator(".lk-replay-next").click()
        assert label.inner_text() == f"{setting}, step 2 of {n_steps}", label.inner_text()
        assert view.inner_html() != shown, "step ▶ did not change the view"
        shown = view.inner_html()
    for key in replay.locator(".lk-replay-key").all():
        before = label.inner_text()
        key.evaluate("e => { e.value = Number(e.value) === 0 ? e.max : 0; e.dispatchEvent(new Event('input')); }")
        after = label.inner_text()
        assert after != before, f"moving a slider did not change the setting: {after!r}"
        assert not stepped or re.search(r", step 1 of \d+$", after), f"a new setting must start at step 1: {after!r}"
        assert view.inner_html() != shown, f"moving a slider did not change the view ({before!r} -> {after!r})"
        shown = view.inner_html()


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


def saved_widgets(path: Path) -> dict:
    """What the notebook file promises to draw before any run: its widget views, sliders, buttons, Output plots."""
    nb = json.loads(path.read_text())
    state = nb["metadata"].get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    models = [m["model_name"] for m in state.values()]
    views = [out for cell in nb["cells"] for out in cell.get("outputs", []) if WIDGET_VIEW in out.get("data", {})]
    plots = sum("image/png" in out.get("data", {}) for m in state.values() if m["model_name"] == "OutputModel"
                for out in m["state"].get("outputs", []))
    return {"views": len(views), "sliders": sum(m.endswith("SliderModel") for m in models),
            "buttons": models.count("ButtonModel"), "plots": plots, "state": len(state)}


def stop_sessions(url: str, token: str) -> None:
    """Shut down the kernels that opening notebooks started (each holds memory; the run below starts its own)."""
    with urllib.request.urlopen(f"{url}/api/sessions?token={token}", timeout=30) as response:
        sessions = json.loads(response.read())
    for s in sessions:
        request = urllib.request.Request(f"{url}/api/sessions/{s['id']}?token={token}", method="DELETE")
        urllib.request.urlopen(request, timeout=30)


def test_saved_widgets_are_drawn_before_anything_runs(sync_playwright, lab):
    """As a learner opens them from `make lab`: stored outputs, nothing run. JupyterLab draws a widget from the
    state saved in the notebook only when the notebook is trusted; untrusted, it shows `VBox(children=(...`."""
    url, token, log = lab
    ARTIFACTS.mkdir(exist_ok=True)
    def fix_trust() -> str:     # with what the lab said about trust: its start line, the server's warnings
        said = [line.strip() for line in log.read_text().splitlines() if "trust" in line]
        return ("the notebook is not trusted: `make lab` (labkit.lab.trust_notebooks) signs notebooks/*.ipynb before "
                f"the server starts (the lab said: {said[:4]}); by hand: `jupyter trust notebooks/*.ipynb`")
    fix_state = ("its widget state is not saved in the notebook (metadata.widgets): re-run and save it with "
                 "the widget state stored (JupyterLab: Settings > Save Widget State Automatically)")
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1400})
        name = "before"
        try:
            for notebook in SAVED_WIDGETS:
                name = Path(notebook).stem[:2]
                want = saved_widgets(ROOT / notebook)
                assert want["views"] and want["state"], f"{notebook} shows no saved widget: {fix_state}"
                # a workspace per notebook (reset): only this notebook open, no tabs restored from the last one
                page.goto(f"{url}/lab/workspaces/before-{name}/tree/{notebook}?reset&token={token}")
                page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
                notebook_view = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook")
                views = notebook_view.locator(DRAWN_WIDGET)
                try:
                    views.nth(want["views"] - 1).wait_for(state="attached", timeout=30_000)
                except PlaywrightTimeout:
                    pass
                as_text = [t[:80] for t in notebook_view.locator(".jp-OutputArea-output").all_text_contents()
                           if any(r in t for r in WIDGET_REPRS)]
                assert not as_text, f"{notebook}: saved widgets shown as text {as_text}: {fix_trust()}"
                assert views.count() == want["views"], (f"{notebook}: {views.count()} of {want['views']} widget "
                                                        f"outputs drawn: {fix_state}, or {fix_trust()}")
                # the opened notebook starts its kernel: the widgets drawn from the notebook survive its arrival
                page.locator(".jp-StatusBar-TextItem", has_text=re.compile(r"\| Idle$")).first.wait_for(timeout=60_000)
                cell = notebook_view.locator(".jp-Cell").filter(has=page.locator(DRAWN_WIDGET)).first
                cell.scroll_into_view_if_needed()
                page.wait_for_timeout(300)                  # content-visibility: let the cell paint
                for kind, selector in (("sliders", ".widget-slider"), ("buttons", ".widget-button")):
                    drawn = views.locator(selector)
                    assert drawn.count() == want[kind], (f"{notebook}: {drawn.count()} {kind} drawn, the saved state "
                                                         f"has {want[kind]}: {fix_state}")
                    for i in range(want[kind]):
                        drawn.nth(i).scroll_into_view_if_needed()
                        assert drawn.nth(i).is_visible(), f"{notebook}: {kind} {i + 1} is in the page but not visible"
                # an Output widget (interact's plot, the stepper's step) redraws the outputs saved in its state
                plots = views.locator(".widget-output img")
                assert plots.count() >= want["plots"], (f"{notebook}: {plots.count()} plots drawn inside the widgets, "
                                                        f"their saved Output state holds {want['plots']}: {fix_state}")
                for i in range(want["plots"]):
                    assert plots.nth(i).evaluate("img => img.complete && img.naturalWidth > 100"), \
                        f"{notebook}: the saved plot {i + 1} inside the widget did not load"
                cell.locator(".jp-Cell-outputWrapper").screenshot(path=str(ARTIFACTS / f"{name}_before_run.png"))
                for replay in notebook_view.locator(".lk-replay").all():    # a recorded run plays with no kernel
                    play_replay(replay)
                stop_sessions(url, token)
        except Exception:
            page.screenshot(path=str(ARTIFACTS / f"{name}_before_run_failure.png"))
            raise
        finally:
            browser.close()


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


def test_the_book_reads_offline_and_its_recorded_run_plays(sync_playwright, tmp_path):
    """`make book` as a reader without a kernel or a network opens it: every page and figure loads from the folder,
    the mathematics is typeset, 02's recorded run steps and changes γ, 03's figures follow temperature and top-k, 04's
    calculator α and γ, and 06's the tree budget."""
    from labkit.book import build_book
    pages = build_book(ROOT, tmp_path / "book")
    chapters = [f"{p.stem}.html" for p in sorted((ROOT / "notebooks").glob("*.ipynb"))]
    assert [p.name for p in pages[1:]] == chapters + ["glossary.html"]
    ARTIFACTS.mkdir(exist_ok=True)
    remote = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1300, "height": 1200})

        def offline(route):                     # the book reads its own folder; anything else is an error
            if route.request.url.startswith("file://"):
                return route.continue_()
            remote.append(route.request.url)
            return route.abort()
        page.route("**/*", offline)
        try:
            page.goto(pages[0].as_uri())
            links = page.locator("a").evaluate_all("links => links.map(a => a.getAttribute('href'))")
            assert links == [p.name for p in pages[1:]], links
            for p in pages[1:]:
                page.goto(p.as_uri(), wait_until="load")
                figures = page.locator(".jp-OutputArea-output img")
                for i in range(figures.count()):
                    assert figures.nth(i).evaluate("img => img.complete && img.naturalWidth > 50"), \
                        f"{p.name}: figure {i + 1} did not load"
                if p.stem.startswith("00") or p.stem == "glossary":      # MathJax, from the folder, typesets
                    page.wait_for_function("() => document.querySelectorAll('.MathJax, .MathJax_CHTML, "
                                           "mjx-container').length > 0", timeout=30_000)
            for chapter in ("02", "03", "04", "06"):    # the stepper's run (steps, γ), temperature × top-k (03),
                # the calculator's α × γ (04) and the tree budgets (06)
                page.goto(next(p for p in pages if p.stem.startswith(chapter)).as_uri(), wait_until="load")
                replays = page.locator(".lk-replay").all()
                assert replays, f"{chapter}: no recorded run in the page"
                for replay in replays:
                    play_replay(replay)
                replays[0].screenshot(path=str(ARTIFACTS / f"book_replay_{chapter}.png"))
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "book_failure.png"))
            raise
        finally:
            browser.close()
    assert not remote, f"the book asked the network for {remote[:5]}"
