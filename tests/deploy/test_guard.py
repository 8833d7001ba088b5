"""The guard process (pdlab.deploy.guard) with real processes: it stops a deployment's process groups once the
owner is gone, including an owner that was killed but not reaped (a zombie), and leaves them while it runs."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def guard_for(owner: subprocess.Popen, groups_file: Path) -> subprocess.Popen:
    created = psutil.Process(owner.pid).create_time()
    return subprocess.Popen([sys.executable, "-m", "pdlab.deploy.guard", str(owner.pid), repr(created),
                             str(groups_file)])


def test_the_guard_stops_the_groups_of_an_owner_killed_but_not_reaped(tmp_path: Path) -> None:
    owner = subprocess.Popen(SLEEPER)
    served = subprocess.Popen(SLEEPER, start_new_session=True)  # an instance: its own process group
    groups = tmp_path / "process-groups"
    groups.write_text(f"{served.pid} {psutil.Process(served.pid).create_time()!r}\n")
    guard = guard_for(owner, groups)
    try:
        time.sleep(1.5)
        assert served.poll() is None and guard.poll() is None  # the owner runs: the guard leaves things be
        owner.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 5
        while psutil.Process(owner.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.1)
        assert psutil.Process(owner.pid).status() == psutil.STATUS_ZOMBIE  # dead, and nobody has reaped it
        assert guard.wait(timeout=20) == 0
        assert served.wait(timeout=5) is not None and not groups.exists()
    finally:
        for proc in (owner, served, guard):
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=5)


#: An instance like vLLM's: a leader (the API server) with a child in its process group (the engine).
LEADER_WITH_CHILD = [sys.executable, "-c", "import subprocess, sys, time; "
                     "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"]


def test_the_guard_stops_what_is_left_of_a_group_whose_leader_was_killed(tmp_path: Path) -> None:
    """Killing only an instance's leading process (vLLM's API server pid) must not leave its engine running: the
    guard stops the rest of the group. With no owner (a `pdlab up` deployment) it keeps watching until the groups
    file goes."""
    leader = subprocess.Popen(LEADER_WITH_CHILD, start_new_session=True)
    groups = tmp_path / "process-groups"
    groups.write_text(f"{leader.pid} {psutil.Process(leader.pid).create_time()!r}\n")
    guard = subprocess.Popen([sys.executable, "-m", "pdlab.deploy.guard", "0", "0", str(groups)])
    try:
        deadline = time.monotonic() + 10
        while not psutil.Process(leader.pid).children() and time.monotonic() < deadline:
            time.sleep(0.1)
        (engine,) = psutil.Process(leader.pid).children()
        time.sleep(1)
        assert engine.is_running() and guard.poll() is None
        leader.send_signal(signal.SIGKILL)
        leader.wait(timeout=5)
        gone, _ = psutil.wait_procs([engine], timeout=5)
        assert gone, "the engine outlived its killed leader"
        assert guard.poll() is None  # no owner: it keeps watching
        groups.unlink()
        assert guard.wait(timeout=5) == 0
    finally:
        for proc in (leader, guard):
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=5)
