"""The guard: a tiny process that stops a deployment's process groups if its owner dies without doing so
(the owner was SIGKILLed, or a Jupyter kernel crashed). The owner removes the groups file when it stops cleanly;
the guard then exits too.

    python -m pdlab.deploy.guard OWNER_PID OWNER_CREATE_TIME GROUPS_FILE
GROUPS_FILE holds one `pgid create_time` pair per line, appended as processes start.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil

from pdlab.deploy.process import stop_group


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
        pgid, created = line.split()
        groups.append((int(pgid), float(created)))
    return groups


def main(argv: list[str]) -> int:
    owner_pid, owner_created, groups_file = int(argv[0]), float(argv[1]), Path(argv[2])
    while True:
        if not groups_file.exists():
            return 0
        if not owner_alive(owner_pid, owner_created):
            for pgid, created in read_groups(groups_file):
                stop_group(pgid, created, timeout_s=10)
            groups_file.unlink(missing_ok=True)
            return 0
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
