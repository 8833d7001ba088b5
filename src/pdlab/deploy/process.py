"""Child processes pdlab owns: each runs in its own process group (so its whole tree can be stopped at once),
logs to a file, and is stopped on exit, error, Ctrl-C, SIGTERM and Jupyter kernel restart.

Three layers keep orphans away:
1. `Deployment.stop()` (context-manager exit, exceptions, Ctrl-C) stops each process group.
2. An atexit hook and a SIGTERM handler stop whatever is still registered when the interpreter ends
   (a Jupyter kernel restart shuts the kernel down this way).
3. A guard process (`python -m pdlab.deploy.guard`) watches the owning process and stops the groups if the owner
   dies without cleaning up (SIGKILL, a crashed kernel).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil


class ManagedProcess:
    """One child process (and all it spawns), in its own process group, logging to `log_path`."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path, cwd: Path | None = None):
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.cwd = cwd
        self.popen: subprocess.Popen[bytes] | None = None
        self.create_time: float | None = None
        self._adopted_pid: int | None = None

    @classmethod
    def adopt(cls, name: str, pid: int, create_time: float, log_path: Path) -> ManagedProcess:
        """A process started by another pdlab process (`pdlab up`), to watch and read; stopping it is explicit."""
        proc = cls(name, [], {}, log_path)
        proc._adopted_pid, proc.create_time = pid, create_time
        return proc

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.cwd, start_new_session=True,  # own session and process group: Ctrl-C is ours to relay
            )
        self.create_time = psutil.Process(self.popen.pid).create_time()
        _register(self)
        return self

    @property
    def pid(self) -> int:
        if self._adopted_pid is not None:
            return self._adopted_pid
        assert self.popen is not None, "process not started"
        return self.popen.pid

    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def alive(self) -> bool:
        if self._adopted_pid is not None:
            try:
                return abs(psutil.Process(self._adopted_pid).create_time() - (self.create_time or 0)) < 0.01
            except psutil.NoSuchProcess:
                return False
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        return tail(self.log_path, lines)

    def release(self) -> None:
        """Let the process outlive this Python process (a detached deployment's): no stop at exit."""
        _unregister(self)

    def kill(self) -> None:
        """SIGKILL the whole process group at once, as a crash would (failure drills)."""
        stop_group(self.pid, self.create_time, graceful=False)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left (the group and any stray descendants)."""
        if self._adopted_pid is not None:
            stop_group(self._adopted_pid, self.create_time, timeout_s)
            return
        if self.popen is None:
            return
        stop_group(self.popen.pid, self.create_time, timeout_s)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=1)
        _unregister(self)


class StartupError(RuntimeError):
    """A process that exited or stayed unhealthy during start-up; the message carries its log tail."""


def wait_healthy(proc: ManagedProcess, health_url: str, timeout_s: float = 60.0) -> None:
    """Block until `health_url` answers 200; raise StartupError if the process exits or the time runs out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if not proc.alive():
            raise StartupError(f"{proc.name} exited with code {proc.returncode()} during start-up; last lines of "
                               f"{proc.log_path}:\n{proc.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(health_url, timeout=1.0).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise StartupError(f"{proc.name}: {health_url} not healthy after {timeout_s:.0f} s; last lines of "
                               f"{proc.log_path}:\n{proc.log_tail()}")
        time.sleep(0.1)


@contextlib.contextmanager
def serving(name: str, argv: list[str], health_url: str, log_path: Path, env: dict[str, str] | None = None,
            timeout_s: float = 60.0) -> Iterator[ManagedProcess]:
    """Run a server (a stand-in, a router, a peer) as a ManagedProcess until the block ends: started, healthy
    before the block runs, and always stopped after it."""
    proc = ManagedProcess(name, argv, {**os.environ, **(env or {})}, log_path).start()
    try:
        wait_healthy(proc, health_url, timeout_s)
        yield proc
    finally:
        proc.stop(timeout_s=10)


def tail(path: Path, lines: int = 25) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 64 * 1024))
            text = handle.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid:
                members.append(proc)
        except (ProcessLookupError, psutil.Error, OSError):
            continue
    return members


def stop_group(pgid: int, create_time: float | None, timeout_s: float = 20.0, graceful: bool = True) -> None:
    """Stop process group `pgid` whose leader was created at `create_time` (guards against a recycled pid):
    SIGTERM, then SIGKILL after `timeout_s`; with `graceful=False`, SIGKILL at once."""
    stop_groups([(pgid, create_time)], timeout_s, graceful)


def stop_groups(groups: Sequence[tuple[int, float | None]], timeout_s: float = 20.0, graceful: bool = True) -> None:
    """`stop_group` for several groups at once: every member of every group is signalled, then all are waited for
    together. A vLLM instance takes seconds to shut down; one group after another, a deployment's stop took the sum
    of its instances'."""
    found = [(pgid, _members(pgid, create_time)) for pgid, create_time in groups]
    everyone = [proc for _, members in found for proc in members]
    if not everyone:
        return
    first = signal.SIGTERM if graceful else signal.SIGKILL
    for pgid, members in found:
        if members:
            _signal_all(pgid, members, first)
    alive = wait_exited(everyone, timeout_s if graceful else 5)
    if alive and graceful:
        for pgid, members in found:
            if left := [proc for proc in members if proc in alive]:
                _signal_all(pgid, left, signal.SIGKILL)
        wait_exited(alive, 5)


def wait_exited(procs: Sequence[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until every one of `procs` has exited; returns those still running after `timeout_s`. A zombie counts
    as exited: its memory, cores and ports are free, and reaping it is its parent's business. (An orphan's parent
    is the machine's init, which can take seconds to reap: in some containers ~2 s per process, which
    `psutil.wait_procs`, waiting for the pid to vanish, added to every stop.)"""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [proc for proc in procs if _running(proc)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _members(pgid: int, create_time: float | None) -> list[psutil.Process]:
    """Group `pgid`'s processes, and its leader's descendants that left it (when the leader is still the one
    created at `create_time`)."""
    try:
        leader = psutil.Process(pgid)
        if create_time is not None and abs(leader.create_time() - create_time) > 0.01:
            leader = None  # pid recycled: the group we own is gone, but its members may remain
    except psutil.NoSuchProcess:
        leader = None
    members = group_members(pgid)
    if leader is not None:
        with contextlib.suppress(psutil.NoSuchProcess):
            members += [c for c in leader.children(recursive=True) if c not in members]
    return members


def stop_together(procs: Sequence[ManagedProcess], timeout_s: float = 20.0) -> None:
    """Stop several managed processes at once (`stop_groups`), then forget them as `ManagedProcess.stop` does."""
    groups = [(proc.pid, proc.create_time) for proc in procs if proc.popen is not None or proc._adopted_pid is not None]
    stop_groups(groups, timeout_s)
    for proc in procs:
        if proc.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=1)
        _unregister(proc)


def pin_process_tree(pid: int, cores: list[int]) -> list[int]:
    """Put every thread of `pid` and its descendants back on `cores`; returns the threads that had strayed.

    Why: on CPU, vLLM's NixlConnector moves the worker's thread to "the last core of each NUMA node, reserved for
    KV transfer" (`os.sched_setaffinity` at connector start-up, from /sys, ignoring the instance's own pinning).
    On a laptop that is the same core for every instance, so a prefill instance pinned to core 0 computes on
    core 1 beside the decode instance. There is no setting for it; pdlab re-pins once the instance is up."""
    wanted = set(cores)
    moved = []
    for _, thread in _threads_of(_process_tree(pid)):
        with contextlib.suppress(OSError):
            if os.sched_getaffinity(thread.id) != wanted:
                os.sched_setaffinity(thread.id, wanted)
                moved.append(thread.id)
    return moved


def deprioritize_spinning_threads(pid: int, window_s: float = 0.5, busy_share: float = 0.3) -> list[int]:
    """Move threads that spin while the server is idle to the idle scheduling class (SCHED_IDLE); returns their
    thread ids.

    Why: vLLM's NixlConnector creates its NIXL agent with the progress thread on, and NIXL's Python API sets that
    thread's poll delay to zero, so on an idle instance it busy-polls a whole core. vLLM has no setting for
    either; pdlab's own connector (pdlab.deploy.nixl_connector) starts no such thread, so this is needed only
    with `connector.progress_thread: true` (and LMCache's connector). On a laptop where each instance owns one
    core, that thread halves the instance's compute and adds scheduling delay to every decode step. As an
    idle-class thread it still runs whenever the core is otherwise free (KV transfers progress in the gaps between
    engine steps) but never delays the engine's own threads.
    Measured on 2 cores: nice 19 left decode steps ~70% slower, SCHED_IDLE ~10%."""
    procs = _process_tree(pid)
    if not procs:
        return []
    before = {(proc_id, thread.id): thread.user_time + thread.system_time for proc_id, thread in _threads_of(procs)}
    time.sleep(window_s)
    calmed = []
    for proc_id, thread in _threads_of(procs):
        used = thread.user_time + thread.system_time - before.get((proc_id, thread.id), 0.0)
        if thread.id != proc_id and used > busy_share * window_s:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(thread.id, os.SCHED_IDLE, os.sched_param(0))
                calmed.append(thread.id)
    return calmed


def idle_class_threads(pid: int) -> list[tuple[int, int]]:
    """(process id, thread id) of every thread of `pid` and its descendants in the idle scheduling class: on a P/D
    instance, NIXL's progress thread once `deprioritize_spinning_threads` has moved it."""
    found = []
    for proc_id, thread in _threads_of(_process_tree(pid)):
        with contextlib.suppress(OSError):
            if os.sched_getscheduler(thread.id) == os.SCHED_IDLE:
                found.append((proc_id, thread.id))
    return found


def _process_tree(pid: int) -> list[psutil.Process]:
    """`pid` and its descendants; empty if it is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _threads_of(procs: Iterable[psutil.Process]) -> list[tuple[int, Any]]:
    """(process id, psutil thread) for every thread of `procs` still there."""
    found = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            found += [(proc.pid, thread) for thread in proc.threads()]
    return found


def _signal_all(pgid: int, procs: Iterable[psutil.Process], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
    for proc in procs:  # descendants that left the group (none expected; cheap insurance)
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)


# Process-wide registry: atexit and signal handlers are process-wide too, so this is the one place that must be.
_LIVE: weakref.WeakSet[ManagedProcess] = weakref.WeakSet()
_LOCK = threading.Lock()
_HOOKS_INSTALLED = False


def _register(proc: ManagedProcess) -> None:
    global _HOOKS_INSTALLED
    with _LOCK:
        _LIVE.add(proc)
        if not _HOOKS_INSTALLED:
            atexit.register(stop_all)
            _install_sigterm_handler()
            _HOOKS_INSTALLED = True


def _unregister(proc: ManagedProcess) -> None:
    with _LOCK:
        _LIVE.discard(proc)


def stop_all() -> None:
    """Stop every process this interpreter started and has not stopped yet."""
    with _LOCK:
        procs = list(_LIVE)
    for proc in procs:
        proc.stop(timeout_s=10)


def _install_sigterm_handler() -> None:
    # SIGTERM's default action ends the interpreter without running atexit; turn it into SystemExit instead,
    # but only where nobody else has claimed SIGTERM (servers like uvicorn install their own).
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        def _on_sigterm(signum: int, frame: object) -> None:
            stop_all()
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, _on_sigterm)


def wait_for(predicate, timeout_s: float, interval_s: float = 0.25) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
