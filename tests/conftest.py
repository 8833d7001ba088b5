"""Shared fixtures. End-to-end tests share one real 1P1D vLLM deployment per session (start-up is the slow part),
started and stopped through the CLI the way a learner does it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from pdlab.deploy import Deployment
from pdlab.metrics.kv import scrape_kv_transfer

REPO = Path(__file__).resolve().parents[1]
TEST_MODEL = "pdlab-tiny"
#: The session deployment's routing threshold: between the tests' short and long prompts.
ROUTER_THRESHOLD = 256
PDLAB = [sys.executable, "-m", "pdlab.cli"]

# This session's `pdlab up` records live in a directory of its own, so another checkout's test run (or a
# learner's own deployment) can never be mistaken for, or stopped as, this one.
os.environ.setdefault("PDLAB_STATE_DIR", tempfile.mkdtemp(prefix="pdlab-test-state-"))


def as_in_a_terminal() -> None:
    """`preexec_fn` for a child that a test will Ctrl-C: SIGINT back to its default, as in a terminal. A test run
    started in the background of a non-interactive shell (`.ci/run &`) ignores SIGINT, children inherit that, and
    Python then installs no KeyboardInterrupt handler: the test would measure the harness, not pdlab."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def pdlab_processes(marker: str) -> list[psutil.Process]:
    """Live processes whose command line mentions `marker` (a run directory, a port, a model path)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if marker in " ".join(proc.info["cmdline"] or []) and proc.pid != os.getpid():
                found.append(proc)
        except psutil.Error:
            continue
    return found


def run_pdlab(*args: str, timeout: float = 900, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*PDLAB, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=env or os.environ.copy())


def make_test_lab(tmp_path: Path, name: str, base_port: int, router: dict | None = None) -> Path:
    """A 1P1D lab spec for tests: the tiny model, its own ports, a core each."""
    lab = yaml.safe_load((REPO / "labs" / "local-1p1d.yaml").read_text())
    dep = lab["deployment"]
    lab["name"] = dep["name"] = name
    dep["model"]["name"] = TEST_MODEL
    for i, inst in enumerate(dep["instances"]):
        inst["port"] = base_port + i
        inst["nixl_side_channel_port"] = base_port + 50 + i
    if router is not None:
        dep["router"] = router
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(lab))
    return path


@pytest.fixture(scope="session")
def live_1p1d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """`pdlab up` a real 1P1D deployment of the tiny model, with the router in front, for the whole session;
    `pdlab down` it after, and check that no process of it is left."""
    lab_path = make_test_lab(tmp_path_factory.mktemp("labs"), "pytest-1p1d", base_port=8150,
                             router={"port": 8159, "threshold": ROUTER_THRESHOLD})
    up = run_pdlab("up", str(lab_path))
    assert up.returncode == 0, f"pdlab up failed:\n{up.stdout}\n{up.stderr}"
    try:
        dep = Deployment.attach("pytest-1p1d")
        # `pdlab up` warms the P/D pair up: its first KV transfer (and NIXL handshake) is done before anyone measures
        assert scrape_kv_transfer(dep.urls("decode")[0]).transfers >= 1, "pdlab up moved no KV while warming up"
        yield dep
    finally:
        down = run_pdlab("down", "pytest-1p1d")
        leftovers = [p for p in pdlab_processes("vllm.entrypoints") + pdlab_processes("pdlab.router")
                     if "--port 815" in " ".join(p.cmdline())]
        assert down.returncode == 0, f"pdlab down failed:\n{down.stdout}\n{down.stderr}"
        assert not leftovers, f"processes left after `pdlab down`: {[p.cmdline() for p in leftovers]}"


#: The notebooks' shared deployment (tests/test_notebooks.py, tests/test_browser.py): its own name and ports
#: (8170-8179, NIXL 8220-8221), clear of `live_1p1d` and of the lab specs' ports, so both can be up at once.
NOTEBOOK_DEPLOYMENT = "pytest-notebooks"
NOTEBOOK_ROUTER = {"port": 8179, "threshold": 512}


@pytest.fixture(scope="session")
def notebook_1p1d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`pdlab up` one 1P1D+router deployment of the tiny model for the notebooks that share one (they attach to
    it through $PDLAB_ATTACH); yields its name. `pdlab down` after, and no process of it may be left."""
    lab = make_test_lab(tmp_path_factory.mktemp("labs"), NOTEBOOK_DEPLOYMENT, base_port=8170, router=NOTEBOOK_ROUTER)
    up = run_pdlab("up", str(lab))
    assert up.returncode == 0, f"pdlab up failed:\n{up.stdout}\n{up.stderr}"
    try:
        yield NOTEBOOK_DEPLOYMENT
    finally:
        down = run_pdlab("down", NOTEBOOK_DEPLOYMENT)
        leftovers = [p for p in pdlab_processes("vllm.entrypoints") + pdlab_processes("pdlab.router")
                     if "--port 817" in " ".join(p.cmdline())]
        assert down.returncode == 0, f"pdlab down failed:\n{down.stdout}\n{down.stderr}"
        assert not leftovers, f"processes left after `pdlab down`: {[p.cmdline() for p in leftovers]}"


#: Tests whose checks compare timings measured in-process (notebook 01 times prefill and decode with torch). They
#: run first, before any session deployment is up: on this machine kind an idle P/D deployment's NIXL progress
#: threads keep a core busy (at idle priority, yet a 1,024-token prefill next to them measured 2.2x slower).
QUIET_FIRST = ("test_notebook_runs_top_to_bottom[01-prefill-vs-decode]",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.name not in QUIET_FIRST)  # stable: everything else keeps its order
