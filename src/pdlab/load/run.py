"""Running a schedule against a server with locust, as a subprocess, with a progress bar.

Locust is never imported here (it monkey-patches with gevent); `python -m locust -f locustfile.py` runs in its
own process and appends one row per request to the rows file, which this side watches to show progress.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pdlab.load.schedule import read_schedule, schedule_span, users_for

#: The locustfile, passed to the locust subprocess by path.
LOCUSTFILE = Path(__file__).with_name("locustfile.py")

#: Seconds locust gets to stop by itself after SIGTERM before it is killed.
STOP_GRACE_S = 15.0


@dataclass(frozen=True)
class LoadResult:
    """What a load run left behind."""

    rows_path: Path
    """Raw per-request rows (CSV)."""
    locust_csv_prefix: Path
    """Locust's own statistics: `<prefix>_stats.csv`, `_stats_history.csv`, `_failures.csv`."""
    log_path: Path
    """Locust's console output."""
    scheduled: int
    """Requests in the schedule."""
    recorded: int
    """Rows written (sent requests, whatever their outcome)."""
    returncode: int
    interrupted: bool
    """The run was stopped before every scheduled request was sent and answered."""


def count_rows(rows_path: Path) -> int:
    if not rows_path.exists():
        return 0
    with rows_path.open("rb") as rows:
        return max(0, sum(1 for _ in rows) - 1)  # minus the header


def run_load(base_url: str, schedule_path: str | Path, out_dir: str | Path, model: str, *,
             api: str = "completions", users: int | None = None, timeout_s: float = 600.0,
             progress: bool = True, label: str = "load", stop: threading.Event | None = None,
             on_progress: Callable[[int, int], None] | None = None) -> LoadResult:
    """Send the schedule at `base_url` (a router or an instance) and write `rows.csv`, locust's CSVs and
    `locust.log` into `out_dir`. Blocks until every request has ended; Ctrl-C stops locust cleanly (rows of
    requests in flight are written with status `interrupted`) and is re-raised. Setting `stop` (from another
    thread: a widget's Cancel button) stops locust the same way and returns what was recorded, `interrupted`;
    `on_progress(recorded, scheduled)` is called as rows arrive (a widget's progress bar)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    schedule = read_schedule(schedule_path)
    users = users or users_for(schedule, timeout_s)
    rows_path, prefix, log_path = out_dir / "rows.csv", out_dir / "locust", out_dir / "locust.log"
    limit_s = int(schedule_span(schedule) + timeout_s + 30)
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
               # -r: spawn every user at once (locust spreads a spawn over 1 s at rate -r)
               "-u", str(users), "-r", str(users * 1000), "-t", f"{limit_s}s", "--stop-timeout", "0",
               "--host", base_url.rstrip("/"), "--csv", str(prefix), "--csv-full-history",
               "--exit-code-on-error", "0", "--loglevel", "WARNING",
               "--pdlab-schedule", str(schedule_path), "--pdlab-rows", str(rows_path),
               "--pdlab-model", model, "--pdlab-api", api, "--pdlab-timeout", str(timeout_s)]
    interrupted = False
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            interrupted = _watch(process, rows_path, len(schedule), progress, label, stop, on_progress)
            if interrupted:
                _stop(process)
        except KeyboardInterrupt:
            interrupted = True
            _stop(process)
            raise
        finally:
            if process.poll() is None:
                _stop(process)
            recorded = count_rows(rows_path)
            result = LoadResult(rows_path, prefix, log_path, len(schedule), recorded, process.returncode,
                                interrupted or recorded < len(schedule))
            if not interrupted and process.returncode not in (0, None) and recorded == 0:
                raise RuntimeError(f"locust failed (exit {process.returncode}); see {log_path}:\n"
                                   + log_path.read_text()[-2000:])
    return result


def _watch(process: subprocess.Popen, rows_path: Path, total: int, show: bool, label: str,
           stop: threading.Event | None = None, on_progress: Callable[[int, int], None] | None = None) -> bool:
    """Show progress until locust exits; True when `stop` was set first (the caller stops locust)."""
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=not show, transient=False) as bar:
        task = bar.add_task(label, total=total)
        while process.poll() is None:
            recorded = count_rows(rows_path)
            bar.update(task, completed=recorded)
            if on_progress is not None:
                on_progress(recorded, total)
            if stop is not None and stop.wait(0.25):
                return True
            if stop is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=0.25)
        bar.update(task, completed=count_rows(rows_path))
        if on_progress is not None:
            on_progress(count_rows(rows_path), total)
    return False


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM (locust stops its users, which write `interrupted` rows), then SIGKILL after a grace period."""
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
