"""Shared fixtures. End-to-end tests share one real 1P1D vLLM deployment per session (start-up is the slow part),
started and stopped through the CLI the way a learner does it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml

from pdlab.deploy import Deployment
from pdlab.deploy.guard import ipc_dir
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


def pdlab_down(name: str | None, port_marker: str) -> None:
    """`pdlab down NAME` (every deployment of this session's state directory when None), then check that no vLLM
    server or router of it (its command line has `port_marker`) is left. A named deployment that an earlier
    `pdlab down` already stopped is fine: what counts is that none of its processes is left."""
    down = run_pdlab("down", *([name] if name else []))
    already = name is not None and f"No deployment named {name!r} is up" in down.stdout
    leftovers = [p for p in pdlab_processes("vllm.entrypoints") + pdlab_processes("pdlab.router")
                 if port_marker in " ".join(p.cmdline())]
    assert down.returncode == 0 or already, f"pdlab down failed:\n{down.stdout}\n{down.stderr}"
    assert not leftovers, f"processes left after `pdlab down`: {[p.cmdline() for p in leftovers]}"


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
    sockets = None
    try:
        dep = Deployment.attach("pytest-1p1d")
        sockets = ipc_dir(dep.run_dir)
        # `pdlab up` warms the P/D pair up: its first KV transfer (and NIXL handshake) is done before anyone measures
        assert scrape_kv_transfer(dep.urls("decode")[0]).transfers >= 1, "pdlab up moved no KV while warming up"
        yield dep
    finally:
        pdlab_down(None, "--port 815")  # as the README says: this session's own state directory holds only its own
    assert sockets is None or not sockets.exists(), f"`pdlab down` left the deployment's IPC sockets in {sockets}"


@pytest.fixture(scope="session")
def notebook_replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`pdlab up` notebook 04's second deployment (labs/local-replicas.yaml: two colocated replicas of the tiny model
    with prefix caching, the router in front) for the session; its name, for $PDLAB_ATTACH. No NIXL: idle, it
    leaves the cores to whatever runs beside it."""
    lab = yaml.safe_load((REPO / "labs" / "local-replicas.yaml").read_text())
    dep = lab["deployment"]
    lab["name"] = dep["name"] = "pytest-replicas"
    dep["model"]["name"] = TEST_MODEL
    for i, inst in enumerate(dep["instances"]):
        inst["port"] = 8170 + i
    dep["router"]["port"] = 8179
    path = tmp_path_factory.mktemp("labs") / "pytest-replicas.yaml"
    path.write_text(yaml.safe_dump(lab))
    up = run_pdlab("up", str(path))
    assert up.returncode == 0, f"pdlab up failed:\n{up.stdout}\n{up.stderr}"
    try:
        yield "pytest-replicas"
    finally:
        pdlab_down("pytest-replicas", "--port 817")


def make_argv(*args: str) -> list[str]:
    """`make ARGS...` as a learner types it in the checkout, with this test run's venv when it is not the checkout's
    own `.venv` (a second worktree sharing one)."""
    venv = Path(sys.prefix)
    own = (REPO / ".venv").resolve()
    return ["make", *args, *([] if venv.resolve() == own else [f"VENV={venv}"])]


@dataclass(frozen=True)
class DemoRun:
    """The quick demo, made once per test session: its run directory and what it printed."""

    dir: Path
    output: str


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """`make demo DEMO_ARGS='--quick --out DIR'`, as the README's first command with its quick flags, once per session
    (the docs test checks what it printed and wrote; notebooks that read a demo run can use it), and nothing of it
    left running afterwards."""
    out = tmp_path_factory.mktemp("demo") / "run"
    result = subprocess.run(make_argv("demo", f"DEMO_ARGS=--quick --out {out}"), cwd=REPO, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, f"make demo failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    leftovers = [p.cmdline() for p in pdlab_processes(str(out)) + pdlab_processes("vllm.entrypoints")
                 if "--port 810" in " ".join(p.cmdline()) or str(out) in " ".join(p.cmdline())]
    assert not leftovers, f"processes left after the demo: {leftovers}"
    return DemoRun(out, result.stdout + result.stderr)


@pytest.fixture(scope="session")
def notebook_1p1d(live_1p1d: Deployment) -> str:
    """The session deployment's name, for the notebooks that attach to one through $PDLAB_ATTACH (and the browser
    test). The same deployment as `live_1p1d`, not a second one: another would cost its start-up and its memory."""
    return live_1p1d.spec.name


#: Tests whose checks compare timings measured in-process (notebook 01 times prefill and decode with torch). They
#: run first, before any session deployment is up (vLLM's own NixlConnector kept a core busy per idle P/D instance,
#: and a 1,024-token prefill beside them measured 2.2x slower; pdlab's runs without that thread, but a quiet machine
#: is still the fair place for a timing check).
QUIET_FIRST = ("test_notebook_runs_top_to_bottom[01-prefill-vs-decode]",)


#: Tests that use the session deployment. They run last, so that it is up (and holds its memory)
#: only while they run, not beside every other test; the notebooks named in test_notebooks.ATTACHED ask for it
#: inside the test, so they are named here by their ids.
SHARED_DEPLOYMENT_FIXTURES = {"live_1p1d", "notebook_1p1d", "notebook_replicas"}


def uses_shared_deployment(item: pytest.Item) -> bool:
    from tests.course.test_notebooks import ATTACHED

    fixtures = set(getattr(item, "fixturenames", ()))
    attaches = getattr(item, "originalname", "") == "test_notebook_runs_top_to_bottom" and any(
        f"[{stem}]" in item.name for stem in ATTACHED)
    return bool(fixtures & SHARED_DEPLOYMENT_FIXTURES) or attaches


#: Tests that restart an instance of the session deployment: they run after every other test that uses it.
RESTARTS_SHARED_DEPLOYMENT = ("test_killing_an_api_server_leaves_no_engine_and_restart_brings_it_back",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # stable: within each group, tests keep their order
    # Among the tests that use a shared deployment, those that use the replicas come first: the replicas (no NIXL)
    # then start before the 1P1D one is up, so their start-up does not share the cores with its idle polling.
    items.sort(key=lambda item: 0 if item.name in QUIET_FIRST else 4 if item.name in RESTARTS_SHARED_DEPLOYMENT
               else 2 if "notebook_replicas" in getattr(item, "fixturenames", ())
               else 3 if uses_shared_deployment(item) else 1)
