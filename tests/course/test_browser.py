"""A real browser drives JupyterLab: open notebook 04-router, run all cells against the notebooks' shared 1P1D
deployment, move the router threshold slider, and check that the plotly FigureWidget redrew (browser -> kernel
callback -> live router -> load -> browser) and that the router's /admin/config changed. Screenshots go to the
test's tmp directory.

Needs Debian's chromium (`make browser-deps`); Playwright's Python package drives it through
executable_path, and never downloads a browser of its own.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import jupytext
import pytest
from playwright.sync_api import Page, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

import pdlab
from pdlab.course import ATTACH_ENV
from pdlab.deploy import Deployment
from pdlab.experiment.lab import set_router

CHROMIUM = Path("/usr/bin/chromium")
#: Loopback ports the browser tests may use.
PORT_RANGE = range(20800, 20900)
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage"]
NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "04-router.py"
UI_TIMEOUT_MS = 90_000
#: Running 04 top to bottom: two short loads, plus one more after the slider moves.
RUN_TIMEOUT_MS = 300_000
#: An output area holding a traceback.
ERROR_OUTPUT = ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']:has-text('Traceback')"


def free_port() -> int:
    ports = list(PORT_RANGE)
    random.shuffle(ports)
    for port in ports:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {PORT_RANGE}")


@dataclass
class Lab:
    url: str
    token: str
    root: Path
    log: Path

    def open_url(self, notebook: str) -> str:
        return f"{self.url}/lab/tree/{notebook}?token={self.token}"


#: User settings for a fresh JupyterLab: quiet and offline (no news or update pop-ups over the notebook) and no
#: kernel-selection dialog (the notebook names its kernel).
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification": {"checkForUpdates": False, "fetchNews": "false"},
    "@jupyterlab/notebook-extension/tracker": {"autoStartDefaultKernel": True},
}


def write_lab_settings(settings_dir: Path) -> None:
    for plugin, settings in LAB_SETTINGS.items():
        target = settings_dir / f"{plugin}.jupyterlab-settings"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(settings))


@pytest.fixture
def lab(tmp_path: Path, notebook_1p1d: str) -> Iterator[Lab]:
    """JupyterLab on a free loopback port with a token, serving a fresh folder with notebook 04, its kernels
    attached to the shared deployment; stopped (with its kernels) after."""
    root = tmp_path / "lab"
    root.mkdir()
    jupytext.write(jupytext.read(NOTEBOOK), root / "04-router.ipynb")
    write_lab_settings(tmp_path / "lab-settings")
    port, token = free_port(), f"pdlab-test-{random.getrandbits(64):x}"
    source_root = str(Path(pdlab.__file__).resolve().parents[1])
    env = {**os.environ, "PDLAB_QUICK": "1", ATTACH_ENV: notebook_1p1d,
           "JUPYTER_CONFIG_DIR": str(tmp_path / "jupyter-config"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "jupyter-runtime"),
           "PYTHONPATH": os.pathsep.join(p for p in (source_root, os.environ.get("PYTHONPATH")) if p)}
    log = tmp_path / "jupyterlab.log"
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
               f"--ServerApp.root_dir={root}", f"--LabApp.user_settings_dir={tmp_path / 'lab-settings'}",
               f"--LabApp.workspaces_dir={tmp_path / 'lab-workspaces'}",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.news_url=None"]
    if os.geteuid() == 0:  # CI runs as root; Jupyter refuses root unless told
        command.append("--allow-root")
    with log.open("w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                pytest.fail(f"JupyterLab exited with {process.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/api/status", params={"token": token}, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not answer on {url} within 60 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield Lab(url=url, token=token, root=root, log=log)
    finally:
        # SIGTERM lets the server shut its kernels down; the process group catches anything left behind.
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Page]:
    """A page in Debian's headless chromium with a fresh profile; the browser is closed after the test."""
    if not CHROMIUM.exists() or shutil.which("chromedriver") is None:
        pytest.fail(f"{CHROMIUM} or chromedriver is missing: run `make browser-deps` (apt-get install chromium "
                    "chromium-driver)")
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 1000})
        try:
            context.set_default_timeout(UI_TIMEOUT_MS)
            # A new tab: in the persistent context's initial tab, JupyterLab's Run All never reached the kernel.
            page = context.new_page()
            yield page
        finally:
            # Whatever happened, leave a picture of it for whoever reads the failure.
            page.screenshot(path=str(tmp_path / "last-state.png"), full_page=True)
            context.close()


def dismiss_dialogs(page: Page) -> list[str]:
    """Accept any modal dialog (on a loaded machine JupyterLab may report a slow theme stylesheet as failed, or ask
    which kernel to start); returns what they said, for the test's output."""
    said = []
    for dialog in page.locator(".jp-Dialog").all():
        said.append(dialog.get_attribute("aria-label") or dialog.inner_text())
        dialog.locator(".jp-Dialog-button.jp-mod-accept").click()
    return said


def open_notebook(page: Page, url: str) -> None:
    page.goto(url)
    page.locator(".jp-Notebook").wait_for()
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", state="attached")
    for message in dismiss_dialogs(page):
        print(f"dismissed a JupyterLab dialog: {message}")


def run_all_cells(page: Page, tries: int = 4) -> None:
    """Run > Run All Cells, until the first code cell shows it was sent to the kernel. A freshly opened notebook can
    report an idle kernel before its connection takes requests, and a Run All in that window is silently lost."""
    started = page.locator(".jp-CodeCell .jp-InputPrompt", has_text=re.compile(r"\[(\*|\d+)\]"))
    for _ in range(tries):
        page.locator(".lm-MenuBar-item", has_text="Run").first.click()
        page.locator('.lm-Menu-item[data-command="runmenu:run-all"]').click()
        try:
            started.first.wait_for(timeout=15_000)
            return
        except PlaywrightTimeoutError:
            continue
    pytest.fail(f"Run All Cells did not start the notebook in {tries} tries")


def notebook_state(page: Page, lab: Lab) -> str:
    """What a failure report needs: each code cell's prompt, the kernel's status, any error output, the server log."""
    prompts = [prompt.inner_text().strip() for prompt in page.locator(".jp-CodeCell .jp-InputPrompt").all()]
    status = page.locator(".jp-Notebook-ExecutionIndicator").first.get_attribute("data-status")
    errors = [error.inner_text()[-1500:] for error in page.locator(ERROR_OUTPUT).all()]
    errors += [widget.inner_text() for widget in page.get_by_text("Error displaying widget").all()]
    return (f"cell prompts: {prompts}\nkernel status: {status}\nerror outputs: {errors or 'none'}\n"
            f"JupyterLab log (tail):\n{lab.log.read_text()[-3000:]}")


def run_until_output(page: Page, lab: Lab, text: str, timeout_ms: int, rerun_after_s: float = 20.0) -> None:
    """Run All, then wait until a cell prints `text`. Fails at once, with the traceback, if a cell raises, and on
    timeout with the notebook's state (which cells ran, the kernel's status, the server's log). If a cell is
    neither run nor queued while the kernel sits idle, Run All again: on a fresh profile JupyterLab may replace the
    notebook's first kernel right after opening it, and what a Run All sent to the one it shut down is lost: all of
    it, or all but the first cell (both seen in CI)."""
    wanted, error = page.get_by_text(text), page.locator(ERROR_OUTPUT)
    broken_widget = page.get_by_text("Error displaying widget")
    prompts = page.locator(".jp-CodeCell .jp-InputPrompt")
    indicator = page.locator(".jp-Notebook-ExecutionIndicator").first
    deadline = time.monotonic() + timeout_ms / 1000
    last_run = -math.inf
    while time.monotonic() < deadline:
        if wanted.count():
            return
        if error.count() or broken_widget.count():
            pytest.fail(f"a cell raised or a widget failed before {text!r}:\n{notebook_state(page, lab)}")
        left_out = any(not re.search(r"[*\d]", prompt.inner_text()) for prompt in prompts.all())
        if left_out and indicator.get_attribute("data-status") == "idle" and \
                time.monotonic() - last_run > rerun_after_s:
            if last_run > -math.inf:
                print("cells left out of Run All: running all again")
            run_all_cells(page)
            last_run = time.monotonic()
        page.wait_for_timeout(1000)
    pytest.fail(f"no cell printed {text!r} within {timeout_ms / 1000:.0f} s:\n{notebook_state(page, lab)}")


def figure_state(page: Page) -> dict:
    """What plotly.js is drawing now: the figure's title and its first trace's x values (one per run)."""
    return page.evaluate("""() => {
        const plot = Array.from(document.querySelectorAll('.js-plotly-plot')).pop();
        return {title: plot.layout.title.text, x: Array.from(plot.data[0].x || [])};
    }""")


def wait_for_runs(page: Page, runs: int) -> None:
    page.wait_for_function(f"""() => {{
        const plot = Array.from(document.querySelectorAll('.js-plotly-plot')).pop();
        // While the widget redraws, the figure can hold no trace for a moment: wait on, do not fail.
        return (plot?.data?.[0]?.x?.length ?? 0) >= {runs};
    }}""", timeout=RUN_TIMEOUT_MS)


def test_threshold_slider_reconfigures_the_live_router(lab: Lab, page: Page, tmp_path: Path,
                                                       notebook_1p1d: str) -> None:
    dep = Deployment.attach(notebook_1p1d)
    threshold = set_router(dep)["threshold"]  # restored after: later tests share the deployment
    open_notebook(page, lab.open_url("04-router.ipynb"))
    # Once more, now that its kernel runs: on a loaded machine the first page's kernel websocket can fail while the
    # server is still setting the kernel up (a 500 in its log, seen in CI); the client reconnects, but the widget
    # manager has lost the comm and every widget reads "Error displaying widget: model not found".
    open_notebook(page, lab.open_url("04-router.ipynb"))
    # The notebook's own two settings (everything direct, then the lab's threshold) ran when its first check did.
    run_until_output(page, lab, "check passed: the router followed the live threshold", RUN_TIMEOUT_MS)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", state="attached",
                           timeout=RUN_TIMEOUT_MS)
    # 04 shows the panel twice, the second time near its end, where Run All leaves the view: use that one.
    panel = page.locator(".widget-vbox", has=page.locator(".js-plotly-plot")).last
    panel.scroll_into_view_if_needed()
    panel.locator(".js-plotly-plot .main-svg").first.wait_for()
    wait_for_runs(page, 2)
    page.screenshot(path=str(tmp_path / "01-notebook-ran.png"), full_page=True)
    before = figure_state(page)
    assert before["x"][0] == 8192 and before["x"][1] < 8192, before
    assert before["title"].startswith(f"threshold {before['x'][1]}:"), before

    # Drag the threshold slider's handle (the panel's first slider) past the right end of its track, as a learner
    # would: on release the kernel applies 8192 to the live router and runs a short load.
    slider = panel.locator(".widget-slider").first
    handle = slider.locator(".noUi-handle").bounding_box()
    track = slider.locator(".noUi-target").bounding_box()
    assert handle and track
    page.mouse.move(handle["x"] + handle["width"] / 2, handle["y"] + handle["height"] / 2)
    page.mouse.down()
    page.mouse.move(track["x"] + track["width"] + 20, handle["y"] + handle["height"] / 2, steps=10)
    page.mouse.up()

    try:
        wait_for_runs(page, 3)
        page.screenshot(path=str(tmp_path / "02-slider-moved.png"), full_page=True)
        after = figure_state(page)
        assert after["x"] == [*before["x"], 8192], after
        assert after["title"].startswith("threshold 8192:"), after
        assert slider.locator(".widget-readout").inner_text().strip() == "8192"
        live = httpx.get(dep.router_url + "/admin/config", headers={"Authorization": f"Bearer {dep.admin_token}"},
                         timeout=10).json()
        assert live["threshold"] == 8192, live
    finally:
        set_router(dep, threshold=threshold)  # leave the shared deployment as the other tests expect it
    print(f"screenshots: {tmp_path}")
