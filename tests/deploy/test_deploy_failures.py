"""Start-up failures get messages a learner can act on, and nothing pdlab started is left running: after a
failed start, Ctrl-C, or the owning process being killed outright."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pdlab.config import load_lab
from pdlab.deploy import DeployError, Deployment
from pdlab.deploy.guard import ipc_dir
from tests.conftest import REPO, as_in_a_terminal, make_test_lab, pdlab_processes

START_SCRIPT = """
import sys
from pathlib import Path
from pdlab.config import load_lab
from pdlab.deploy import Deployment
Deployment(load_lab(sys.argv[1]).deployment, run_dir=Path(sys.argv[2]), progress=False).start()
"""


def lab_with(tmp_path: Path, name: str, base_port: int, **instance_patch) -> Path:
    path = make_test_lab(tmp_path, name, base_port)
    lab = yaml.safe_load(path.read_text())
    for inst in lab["deployment"]["instances"]:
        inst.update(instance_patch)
    path.write_text(yaml.safe_dump(lab))
    return path


def wait_until(predicate, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_port_in_use_names_the_instance_and_port(tmp_path):
    spec = load_lab(make_test_lab(tmp_path, "busy-port", 8160)).deployment
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 8161))
        holder.listen()
        with pytest.raises(DeployError, match=r"decode-0: HTTP port 8161 on 127.0.0.1 is already in use"):
            Deployment(spec, run_dir=tmp_path / "run", progress=False).start()
    assert not pdlab_processes("--port 816")


def test_missing_model_is_a_clear_error(tmp_path):
    spec = load_lab(make_test_lab(tmp_path, "no-model", 8162)).deployment
    spec.model.name = str(tmp_path / "no-such-model")
    with pytest.raises(DeployError, match="not found"):
        Deployment(spec, run_dir=tmp_path / "run", progress=False).start()


def test_unavailable_core_is_named(tmp_path):
    lab = lab_with(tmp_path, "no-core", 8164, cores=[4096])
    with pytest.raises(DeployError, match=r"instances\.0\.cores"):
        Deployment(load_lab(lab).deployment, run_dir=tmp_path / "run", progress=False).start()


def test_instance_dying_during_startup_names_it_and_shows_its_log(tmp_path):
    lab = lab_with(tmp_path, "dies", 8166, engine={"extra_args": ["--no-such-vllm-flag"]})
    with pytest.raises(DeployError) as caught:
        Deployment(load_lab(lab).deployment, run_dir=tmp_path / "run", progress=False).start()
    message = str(caught.value)
    assert "exited with code" in message and "-0'" in message
    assert "no-such-vllm-flag" in message  # vLLM's own complaint, from the log tail
    assert wait_until(lambda: not pdlab_processes("--port 816"), 20), "processes left after a failed start"


@pytest.mark.parametrize("how", ["ctrl-c", "sigkill"])
def test_no_orphans_when_the_owner_is_interrupted_or_killed(tmp_path, how):
    """Ctrl-C runs the launcher's own clean-up; SIGKILL leaves it no chance, so the guard process cleans up."""
    lab = make_test_lab(tmp_path, f"owner-{how}", 8180 if how == "ctrl-c" else 8184)
    run_dir = tmp_path / "run"
    owner = subprocess.Popen([sys.executable, "-c", START_SCRIPT, str(lab), str(run_dir)], cwd=REPO,
                             preexec_fn=as_in_a_terminal)
    port_marker = "--port 818"
    try:
        assert wait_until(lambda: len(pdlab_processes(port_marker)) >= 2, 60), "instances never started"
        time.sleep(2)  # let vLLM get into its imports
        owner.send_signal(signal.SIGINT if how == "ctrl-c" else signal.SIGKILL)
        owner.wait(timeout=60)
        assert wait_until(lambda: not pdlab_processes(port_marker), 45), (
            f"processes left after {how}: {[p.cmdline() for p in pdlab_processes(port_marker)]}")
        assert wait_until(lambda: not pdlab_processes(str(run_dir / "process-groups")), 10), "guard left running"
        assert wait_until(lambda: not ipc_dir(run_dir).exists(), 10), f"{how} left the IPC directory behind"
    finally:
        if owner.poll() is None:
            owner.kill()
