"""Writing benchmark results: timestamped files, never overwriting earlier ones."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from pdlab import environment
from pdlab.settings import data_dir


def ensure_new(out: Path | None) -> None:
    """Refuse an `out` that exists, before a benchmark spends its time measuring."""
    if out is not None and out.exists():
        raise FileExistsError(f"{out} exists; pdlab does not overwrite earlier results")


def write(name: str, result: dict[str, Any], out: Path | None = None) -> Path:
    """Write `result` plus the environment to `out`, or to data/results/<name>/<timestamp>.json."""
    if out is None:
        out = data_dir() / "results" / name / f"{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    ensure_new(out)
    payload = {"benchmark": name, **result, "environment": environment.capture()}
    out.write_text(json.dumps(payload, indent=2) + "\n")
    return out
