"""A real browser drives JupyterLab through both kinds of panel, as a learner does:

1. notebook 04-router, its kernel attached to the session's two shared deployments (the 1P1D with its router, and
   the two replicas with prefix caching): Run All, every check cell passes; then the threshold slider is dragged to
   its right end and the live panel's plotly FigureWidget gets a new point (browser -> kernel callback -> live
   router -> load -> browser), while the router's /admin/config says the new threshold;
2. notebook 07-at-scale: Run All, every check cell passes; then the simulator panel's decode strategy is switched
   from `prefixaware` to `roundrobin` and its figure redraws: the prefix-cache bar drops, the previous setting
   stays beside it.

These two notebooks run here, in the browser, and not again in tests/course/test_notebooks.py. Screenshots go to the
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
import nbformat
import pytest
from playwright.sync_api import Locator, Page, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

import pdlab
from pdlab.course import ATTACH_ENV
from pdlab.deploy import Deployment
from pdlab.experiment.lab import set_router
from pdlab.workshop import workbook

CHROMIUM = Path("/usr/bin/chromium")
#: Loopback ports the browser tests may use.
PORT_RANGE = range(20800, 20900)
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage"]
NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
#: The notebooks this test runs (and tests/course/test_notebooks.py therefore does not).
BROWSER_NOTEBOOKS = ("04-router", "07-at-scale")
UI_TIMEOUT_MS = 90_000
#: Running 04 top to bottom: four short loads on two deployments, plus one more after the slider moves.
RUN_TIMEOUT_MS = 400_000
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
        """The notebook alone in a workspace of its own, reset: in the default workspace JupyterLab reopens the
        notebooks opened before beside it, and a Run All could go to one of those (in CI, notebook 07 opened after
        04 took no Run All in four tries, and the page then held two `.jp-Notebook`s)."""
        return f"{self.url}/lab/workspaces/{Path(notebook).stem}/tree/{notebook}?reset&token={self.token}"


#: User settings for a fresh JupyterLab: quiet and offline (no news or update pop-ups over the notebook), no
#: kernel-selection dialog (the notebook names its kernel), and every cell rendered (`windowingMode: none`): by
#: default JupyterLab skips rendering cells scrolled out of view, and once the answers run after the check cells
#: those are out of view, their `check passed` outputs unreadable to the page.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification": {"checkForUpdates": False, "fetchNews": "false"},
    "@jupyterlab/notebook-extension/tracker": {"autoStartDefaultKernel": True, "windowingMode": "none"},
}


def write_lab_settings(settings_dir: Path) -> None:
    for plugin, settings in LAB_SETTINGS.items():
        target = settings_dir / f"{plugin}.jupyterlab-settings"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(settings))


@pytest.fixture
def lab(tmp_path: Path, notebook_replicas: str, notebook_1p1d: str) -> Iterator[Lab]:  # replicas first: conftest
    """JupyterLab on a free loopback port with a token, serving a fresh folder with notebooks 04 and 07, its
    kernels attached to the shared deployments; stopped (with its kernels) after."""
    root = tmp_path / "lab"
    root.mkdir()
    for stem in BROWSER_NOTEBOOKS:
        nbformat.write(workbook.with_answers(NOTEBOOKS / f"{stem}.py"), root / f"{stem}.ipynb")
    write_lab_settings(tmp_path / "lab-settings")
    port, token = free_port(), f"pdlab-test-{random.getrandbits(64):x}"
    source_root = str(Path(pdlab.__file__).resolve().parents[1])
    env = {**os.environ, "PDLAB_QUICK": "1", ATTACH_ENV: f"{notebook_1p1d},{notebook_replicas}",
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
    report an idle kernel before its connection takes requests, and a Run All in that window is silently lost.
    Before each try any dialog is answered (a kernel chooser can open late on a loaded machine, and blocks the
    menu); halfway through the page is loaded afresh, which connects the notebook to its kernel again (in CI a
    second notebook opened in the same tab once took no Run All in four tries)."""
    started = page.locator(".jp-CodeCell .jp-InputPrompt", has_text=re.compile(r"\[(\*|\d+)\]"))
    for attempt in range(tries):
        if attempt and attempt == tries // 2:
            print("Run All did not start the notebook: loading its page again")
            open_notebook(page, page.url)
        for message in dismiss_dialogs(page):
            print(f"dismissed a JupyterLab dialog: {message}")
        page.keyboard.press("Escape")  # close a menu left open by a try whose click did not land
        page.locator(".lm-MenuBar-item", has_text="Run").first.click()
        page.locator('.lm-Menu-item[data-command="runmenu:run-all"]').click()
        try:
            started.first.wait_for(timeout=15_000)
            return
        except PlaywrightTimeoutError:
            continue
    status = page.locator(".jp-Notebook-ExecutionIndicator").first.get_attribute("data-status")
    pytest.fail(f"Run All Cells did not start the notebook in {tries} tries (kernel status: {status})")


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


def check_cells_passed(page: Page, lab: Lab, stem: str) -> None:
    """Every code cell ran, no output holds a traceback, and each `course.check` call printed `check passed`."""
    expected = sum(cell.source.count("course.check(") for cell in workbook.with_answers(NOTEBOOKS / f"{stem}.py").cells
                   if cell.cell_type == "code")
    passed = page.locator(".jp-OutputArea-output").filter(has_text="check passed").all_inner_texts()
    count = sum(text.count("check passed") for text in passed)
    assert count == expected, f"{stem}: {count} of {expected} checks passed\n{notebook_state(page, lab)}"
    assert not page.locator(ERROR_OUTPUT).count(), notebook_state(page, lab)


def plot_state(plot: Locator) -> dict:
    """What plotly.js is drawing now in one figure: its title and each trace's name, x and y."""
    return plot.evaluate("""p => ({title: p.layout.title.text,
        traces: p.data.map(t => ({name: t.name, x: Array.from(t.x || []), y: Array.from(t.y || [])}))})""")


def wait_for_plot(plot: Locator, condition: str, timeout_ms: int = RUN_TIMEOUT_MS) -> None:
    """Wait until `condition` (a JS expression over the plot `p`) holds; while a widget redraws, the figure can
    hold no trace for a moment: wait on, do not fail."""
    plot.page.wait_for_function(f"p => {{ try {{ return Boolean({condition}); }} catch (e) {{ return false; }} }}",
                                arg=plot.element_handle(), timeout=timeout_ms)


def run_notebook(page: Page, lab: Lab, stem: str, last_check: str) -> None:
    open_notebook(page, lab.open_url(f"{stem}.ipynb"))
    # Once more, now that its kernel runs: on a loaded machine the first page's kernel websocket can fail while the
    # server is still setting the kernel up (a 500 in its log, seen in CI); the client reconnects, but the widget
    # manager has lost the comm and every widget reads "Error displaying widget: model not found".
    open_notebook(page, lab.open_url(f"{stem}.ipynb"))
    run_until_output(page, lab, f"check passed: {last_check}", RUN_TIMEOUT_MS)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", state="attached",
                           timeout=RUN_TIMEOUT_MS)
    check_cells_passed(page, lab, stem)


def test_both_panels_move_what_they_say(lab: Lab, page: Page, tmp_path: Path, notebook_1p1d: str) -> None:
    dep = Deployment.attach(notebook_1p1d)
    threshold = set_router(dep)["threshold"]  # restored after: later tests share the deployment
    try:
        run_notebook(page, lab, "04-router", "prefix-aware routing found more")
        # The threshold panel: the VBox with sliders and a figure (shown twice in 04: take the last).
        panel = page.locator(".widget-vbox:has(.js-plotly-plot):has(.widget-slider)").last
        panel.scroll_into_view_if_needed()
        plot = panel.locator(".js-plotly-plot").first
        wait_for_plot(plot, "p.data[0].x.length >= 2")
        page.screenshot(path=str(tmp_path / "01-04-ran.png"), full_page=True)
        before = plot_state(plot)
        assert before["traces"][0]["x"][0] == 8192 and before["traces"][0]["x"][1] < 8192, before
        assert before["title"].startswith(f"threshold {before['traces'][0]['x'][1]}:"), before

        # Drag the threshold slider's handle (the panel's first slider) past the right end of its track, as a
        # learner would: on release the kernel applies 8192 to the live router and runs a short load.
        slider = panel.locator(".widget-slider").first
        handle = slider.locator(".noUi-handle").bounding_box()
        track = slider.locator(".noUi-target").bounding_box()
        assert handle and track
        page.mouse.move(handle["x"] + handle["width"] / 2, handle["y"] + handle["height"] / 2)
        page.mouse.down()
        page.mouse.move(track["x"] + track["width"] + 20, handle["y"] + handle["height"] / 2, steps=10)
        page.mouse.up()
        wait_for_plot(plot, "p.data[0].x.length >= 3")
        page.screenshot(path=str(tmp_path / "02-threshold-moved.png"), full_page=True)
        after = plot_state(plot)
        assert after["traces"][0]["x"] == [*before["traces"][0]["x"], 8192], after
        assert after["title"].startswith("threshold 8192:"), after
        assert slider.locator(".widget-readout").inner_text().strip() == "8192"
        live = httpx.get(dep.router_url + "/admin/config", headers={"Authorization": f"Bearer {dep.admin_token}"},
                         timeout=10).json()
        assert live["threshold"] == 8192, live
    finally:
        set_router(dep, threshold=threshold)  # leave the shared deployment as the other tests expect it

    run_notebook(page, lab, "07-at-scale", "on 8 replicas")
    # The shared-prefix panel: the last simulator panel (a VBox with a figure and a `decode pool` dropdown).
    panel = page.locator(".widget-vbox:has(.js-plotly-plot):has(.widget-dropdown)").last
    panel.scroll_into_view_if_needed()
    plot = panel.locator(".js-plotly-plot").first
    before = plot_state(plot)
    assert "prefixaware" in before["title"], before
    hits_before = before["traces"][3]["y"][1]  # "now" shares: SLO attainment, prefix-cache hits
    dropdown = panel.locator(".widget-dropdown", has_text="decode pool").locator("select")
    dropdown.select_option("roundrobin")
    wait_for_plot(plot, "p.layout.title.text.includes('roundrobin')", UI_TIMEOUT_MS)
    page.screenshot(path=str(tmp_path / "03-strategy-switched.png"), full_page=True)
    after = plot_state(plot)
    assert after["traces"][3]["y"][1] < hits_before - 20, (before, after)  # percent of prompt tokens
    assert after["traces"][1]["y"] == before["traces"][3]["y"], "the previous setting stays beside the new one"
    print(f"screenshots: {tmp_path}")
