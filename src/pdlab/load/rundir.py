"""A run directory: where each file of a run lives, and reading them back. The one home of the layout the experiment
runner writes and the report, `pdlab sim validate`, the calibration and the notebooks read:

    runs/<lab>/<timestamp>/
        environment.json   machine, versions, git commit, load average at the start
        workload.json      the workload spec as run
        summary.json       per-point figures, "complete", KV figures
        report.html        the report
        sweep.csv          a sweep's headline figures, one row per value
        <point>/           a scenario, a sweep point (`<scenario>@<value>`) or `baseline`:
            schedule.jsonl  the requests sent (prompts included)
            rows.csv        one row per request (pdlab.load.rows)
            workload.json   where the point ran another workload than the run's
            kv.json         vLLM's KV figures over the point (NIXL transfers, preemptions)
            deployment/deployment.json   what it ran on (a sweep point's is its scenario's)

A run directory is never reused: `new_run_dir` makes a fresh timestamped one, `fresh_run_dir` refuses one that holds a
run already.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from pdlab.load.rows import read_rows
from pdlab.settings import runs_dir

if TYPE_CHECKING:
    import pandas as pd

ENVIRONMENT, WORKLOAD, SUMMARY, REPORT, SWEEP = (
    "environment.json", "workload.json", "summary.json", "report.html", "sweep.csv")
SCHEDULE, ROWS, KV = "schedule.jsonl", "rows.csv", "kv.json"
#: A point's deployment record, under the point's directory.
DEPLOYMENT = Path("deployment") / "deployment.json"


def new_run_dir(lab: str, runs_root: str | Path | None = None, when: dt.datetime | None = None) -> Path:
    """A fresh `runs/<lab>/<timestamp>[-n]/` (created here, so two runs never share one); `when` names it after
    that moment instead of now."""
    base = Path(runs_root) if runs_root is not None else runs_dir()
    stamp = (when or dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
    (base / lab).mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        candidate = base / lab / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run directory under {base / lab}")


def fresh_run_dir(path: Path) -> Path:
    """An explicitly named run directory: created if missing, refused if it already holds a run."""
    path.mkdir(parents=True, exist_ok=True)
    if (path / SUMMARY).exists():
        raise FileExistsError(f"{path} already holds a run ({SUMMARY}); pdlab never overwrites results")
    return path


def write_json(path: Path, data: object) -> Path:
    """Write `data` as indented JSON, all at once: a reader never sees half a file."""
    staging = path.with_suffix(path.suffix + ".tmp")
    staging.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(staging, path)
    return path


def read_summary(run_dir: str | Path) -> dict:
    return json.loads((Path(run_dir) / SUMMARY).read_text())


def read_environment(run_dir: str | Path) -> dict:
    """The run's environment, or {} where it has none."""
    path = Path(run_dir) / ENVIRONMENT
    return json.loads(path.read_text()) if path.exists() else {}


def point_rows(run_dir: str | Path, summary: dict) -> dict[str, pd.DataFrame]:
    """Raw rows of every point of the run that wrote a rows file: its scenarios and sweep points, and the baseline."""
    run_dir = Path(run_dir)
    names = list(summary.get("scenarios") or {}) + (["baseline"] if summary.get("baseline") else [])
    return {name: read_rows(run_dir / name / ROWS) for name in names if (run_dir / name / ROWS).exists()}


def point_dirs(run_dir: str | Path) -> list[Path]:
    """The run's point directories that recorded rows, in name order."""
    return sorted(rows.parent for rows in Path(run_dir).glob(f"*/{ROWS}"))


def read_kv(point_dir: str | Path) -> dict:
    """A point's KV figures (vLLM's over the point), or {} where it recorded none."""
    path = Path(point_dir) / KV
    return json.loads(path.read_text()) if path.exists() else {}


def point_workload(point_dir: str | Path) -> dict | None:
    """The workload a point ran: its own, else its run's; None where neither was recorded."""
    point_dir = Path(point_dir)
    path = next((p for p in (point_dir / WORKLOAD, point_dir.parent / WORKLOAD) if p.exists()), None)
    return json.loads(path.read_text()) if path else None


def point_deployment(point_dir: str | Path) -> dict:
    """The deployment spec (as JSON) a point ran on, or {} where none was recorded. A sweep point
    (`<scenario>@<value>`) ran on its scenario's deployment with one router setting changed live: the setting is
    the column after `scenario` in the run's sweep.csv."""
    point_dir = Path(point_dir)
    path = point_dir / DEPLOYMENT
    if path.exists():
        return json.loads(path.read_text())["spec"]
    scenario, at, value = point_dir.name.partition("@")
    base = point_dir.parent / scenario / DEPLOYMENT
    sweep = point_dir.parent / SWEEP
    if not at or not base.exists() or not sweep.exists():
        return {}
    spec = json.loads(base.read_text())["spec"]
    setting = sweep.open().readline().strip().split(",")[1]
    router = dict(spec.get("router") or {})
    router[setting] = int(value) if setting == "threshold" else value
    return {**spec, "router": router}
