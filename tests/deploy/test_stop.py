"""Stopping process groups (pdlab.deploy.process.stop_groups), on real processes: several groups go at once, and an
exited process its parent has not reaped yet (a zombie) counts as stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from pdlab.deploy.process import stop_groups, wait_exited

#: A process that takes `SLOW_S` to shut down on SIGTERM, as a vLLM instance takes seconds.
SLOW_S = 1.5
#: (A group is signalled as a group and each member again, as insurance: the second SIGTERM must not start a second
#: shutdown, which would measure two.)
SLOW = [sys.executable, "-c", "import signal, sys, time\n"
        "def bye(*_):\n    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"    time.sleep({SLOW_S})\n    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\nprint('ready', flush=True)\ntime.sleep(600)"]


def start_slow() -> subprocess.Popen:
    proc = subprocess.Popen(SLOW, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_groups_are_stopped_at_once_not_one_after_another() -> None:
    procs = [start_slow() for _ in range(3)]
    try:
        started = time.monotonic()
        stop_groups([(p.pid, psutil.Process(p.pid).create_time()) for p in procs], timeout_s=10)
        took = time.monotonic() - started
        assert not wait_exited([psutil.Process(p.pid) for p in procs if p.poll() is None], 0)
        # One after another would take 3 x 1.5 s; at once, about one shutdown.
        assert SLOW_S <= took < 2 * SLOW_S, took
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_zombie_counts_as_exited() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])  # exits at once; not reaped until we wait for it
    try:
        deadline = time.monotonic() + 10
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)
        assert psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE
        assert wait_exited([psutil.Process(child.pid)], timeout_s=5) == []
        assert os.path.exists(f"/proc/{child.pid}")  # still there: stopping it did not need it reaped
    finally:
        child.wait()


def test_a_process_that_ignores_sigterm_is_killed_after_the_timeout() -> None:
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n"
                                 "time.sleep(600)"], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert stubborn.stdout is not None and stubborn.stdout.readline().strip() == "ready"
    try:
        stop_groups([(stubborn.pid, psutil.Process(stubborn.pid).create_time())], timeout_s=0.5)
        assert stubborn.wait(timeout=5) == -signal.SIGKILL
    finally:
        stubborn.kill()
        stubborn.wait()
