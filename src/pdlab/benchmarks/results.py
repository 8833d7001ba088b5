"""Where benchmark results go: to `--out`, else to a new file under `runs/`; only `--record` files one under
`data/results/`, always as a new file. Nothing here ever overwrites a result, and nothing writes under `data/`
unless asked to record."""

from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path
from typing import Any

from pdlab import environment
from pdlab.settings import data_dir, runs_dir


def stamp() -> str:
    """The timestamp a result's file is named by."""
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def ensure_new(out: Path | None) -> None:
    """Refuse an `out` that exists, before a benchmark spends its time measuring."""
    if out is not None and out.exists():
        raise FileExistsError(f"{out} exists; pdlab does not overwrite earlier results")


def default_path(name: str, filename: str | None = None) -> Path:
    """A new file for benchmark `name`'s result when no `--out` is given: runs/bench/<name>/<timestamp>.json."""
    return new_path(runs_dir() / "bench" / name, filename or f"{stamp()}.json")


def new_path(directory: Path, filename: str) -> Path:
    """`directory / filename`, or, where that exists, the same name with -2, -3, ... before its suffix."""
    path, number = directory / filename, 1
    while path.exists():
        number += 1
        path = directory / f"{Path(filename).stem}-{number}{Path(filename).suffix}"
    return path


def write(name: str, result: dict[str, Any], out: Path | None = None) -> Path:
    """Write `result` plus the environment to `out`, or to a new file under runs/bench/<name>/."""
    out = out or default_path(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    ensure_new(out)
    payload = {"benchmark": name, **result, "environment": environment.capture()}
    out.write_text(json.dumps(payload, indent=2) + "\n")
    return out


def record(name: str, written: Path, filename: str | None = None) -> Path:
    """File the result at `written` (its environment captured in it) under data/results/<name>/ as a new file,
    named `filename` (default: its own name) or, where that is taken, a name beside it; returns the recorded path."""
    recorded = new_path(data_dir() / "results" / name, filename or written.name)
    recorded.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(written, recorded)
    return recorded
