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
