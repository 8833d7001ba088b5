"""The guard: a tiny process beside a deployment that keeps its process groups from being orphaned.

1. If the deployment's owner dies without stopping it (SIGKILLed, a crashed Jupyter kernel), the guard stops every
   group. A deployment started by `pdlab up` outlives its starter on purpose: it has no owner (`0 0`).
2. If a group's leader dies while other members live on (someone killed a vLLM instance's API-server pid: its
   EngineCore and worker would keep running, holding a core and the instance's ports), the guard stops the rest of
   that group. vLLM's engine process does not watch its parent for this (no PR_SET_PDEATHSIG), so pdlab does.
In case 1 it also removes the deployment's IPC socket directory (`ipc_dir`), as a clean stop does.

    python -m pdlab.deploy.guard OWNER_PID OWNER_CREATE_TIME GROUPS_FILE
GROUPS_FILE holds one `pgid create_time` pair per line (the launcher adds a line per process it starts and rewrites
the file when an instance restarts). The guard exits when the file is removed (the deployment stopped cleanly).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil

from pdlab.deploy.process import stop_group

#: The groups file's name in a deployment's run directory.
GROUPS_FILE = "process-groups"
#: Seconds between the guard's looks.
INTERVAL_S = 0.5


def ipc_dir(run_dir: Path | str) -> Path:
    """Where a deployment's vLLM and LMCache processes put their IPC sockets (VLLM_RPC_BASE_PATH): a directory of
    its own, made at start and removed at stop, instead of files left in /tmp. Short (a Unix socket path holds 107
    bytes and LMCache's names take ~60), so derived from the run directory rather than inside it."""
    digest = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"pdlab-ipc-{digest}"


def owner_alive(pid: int, create_time: float) -> bool:
    """The owner runs: same pid and start time, and not a zombie (killed, but not yet reaped by its parent, e.g.
    a test harness or a notebook server that is itself stuck: it will never stop its deployment)."""
    try:
        owner = psutil.Process(pid)
        return abs(owner.create_time() - create_time) < 0.01 and owner.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def read_groups(path: Path) -> list[tuple[int, float]]:
    groups = []
    for line in path.read_text().splitlines():
        if line.strip():
            pgid, created = line.split()
            groups.append((int(pgid), float(created)))
    return groups


def leader_gone(pgid: int, create_time: float) -> bool:
    """The group's leader (the process pdlab started) has exited, or is a zombie nobody reaped yet."""
    try:
        leader = psutil.Process(pgid)
        return abs(leader.create_time() - create_time) > 0.01 or leader.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def orphaned(groups: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The groups whose leader is gone while some member still runs (one pass over the process table)."""
    headless = {pgid: created for pgid, created in groups if leader_gone(pgid, created)}
    if not headless:
        return []
    found = set()
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            pgid = os.getpgid(proc.pid)
        except (ProcessLookupError, PermissionError, OSError):
            continue
        if pgid in headless and proc.pid != pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.add(pgid)
    return [(pgid, headless[pgid]) for pgid in sorted(found)]


def main(argv: list[str]) -> int:
    owner_pid, owner_created, groups_file = int(argv[0]), float(argv[1]), Path(argv[2])
    while True:
        if not groups_file.exists():
            return 0
        try:
            groups = read_groups(groups_file)
        except (OSError, ValueError):  # being rewritten (an instance restarting): look again next time
            groups = []
        if owner_pid and not owner_alive(owner_pid, owner_created):
            for pgid, created in groups:
                stop_group(pgid, created, timeout_s=10)
            groups_file.unlink(missing_ok=True)
            shutil.rmtree(ipc_dir(groups_file.parent), ignore_errors=True)
            return 0
        for pgid, created in orphaned(groups):
            print(f"[pdlab guard] the leader of process group {pgid} is gone: stopping the rest of the group",
                  flush=True)
            stop_group(pgid, created, timeout_s=5)
        time.sleep(INTERVAL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
