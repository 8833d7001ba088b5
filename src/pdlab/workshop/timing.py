"""How long the course takes: each notebook executed top to bottom as a learner runs it (a fresh kernel, its own
deployment, the notebook's full parameters unless `quick`), timed per cell, with the machine's free memory watched
throughout. `pdlab workshop time` writes the result to runs/course-timings/ (or `--out`); with `--record` it also
files it under data/results/course-timings/, which README's course table quotes."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import jupytext
import psutil
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

import pdlab
from pdlab.benchmarks import results
from pdlab.course import ATTACH_ENV, QUICK_ENV, RUN_ENV
from pdlab.settings import runs_dir
from pdlab.workshop.workbook import find_notebook

#: The name results are filed under: runs/course-timings/, data/results/course-timings/.
NAME = "course-timings"
#: A cell that runs longer than this fails the run (a full-mode load is minutes, a vLLM start-up one or two).
CELL_TIMEOUT_S = 1800
#: How much of each cell's text output a result keeps.
OUTPUT_CHARS = 2000

#: on_cell(notebook stem, code cell index, code cells, the cell's first line), as each code cell starts.
CellHook = Callable[[str, int, int, str], None]


class MemoryWatch:
    """Samples the machine's available memory in a thread; `low` is the least seen."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.start = self.low = psutil.virtual_memory().available
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.low = min(self.low, psutil.virtual_memory().available)

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def as_dict(self) -> dict[str, float]:
        return {"available_start_gib": round(self.start / 2**30, 2), "available_low_gib": round(self.low / 2**30, 2),
                "used_peak_gib": round((self.start - self.low) / 2**30, 2)}


def kernel_env(quick: bool) -> dict[str, str]:
    """The learner's environment: quick or full mode, no shared deployment or shared run, this pdlab's source first
    on the kernel's path."""
    source_root = str(Path(pdlab.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (source_root, os.environ.get("PYTHONPATH", "")) if p)
    env = {k: v for k, v in os.environ.items() if k not in (ATTACH_ENV, RUN_ENV)}
    return {**env, QUICK_ENV: "1" if quick else "0", "PYTHONPATH": path}


def notebook_path(name: str | Path) -> Path:
    """A course notebook by number or stem (`03`, `03-disaggregate`), or any notebook file by its path."""
    path = Path(name)
    return path if path.suffix in (".py", ".ipynb") and path.is_file() else find_notebook(str(name))


def _seconds(cell: Any) -> float | None:
    """A cell's execution time from nbclient's timing metadata."""
    timing = cell.get("metadata", {}).get("execution", {})
    start, end = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
    if not (start and end):
        return None
    parse = datetime.fromisoformat
    return round((parse(end.replace("Z", "+00:00")) - parse(start.replace("Z", "+00:00"))).total_seconds(), 2)


def _text(cell: Any) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if "text" in out:
            parts.append(out["text"])
        elif "data" in out and "text/plain" in out["data"]:
            parts.append(out["data"]["text/plain"])
        elif out.get("output_type") == "error":
            parts.append(f"{out.get('ename')}: {out.get('evalue')}")
    return "".join(parts)[:OUTPUT_CHARS]


def _first_line(source: str, width: int) -> str:
    return (source.splitlines() or [""])[0][:width]


def time_notebook(notebook: str | Path, quick: bool = False, on_cell: CellHook | None = None) -> dict[str, Any]:
    """Execute one notebook top to bottom in a fresh kernel and time it. A failed cell ends the run; the result says
    which and keeps what was timed. `minutes` is the cells' running time; `total_s` adds the kernel's start."""
    path = notebook_path(notebook)
    nb = jupytext.read(path)
    code_index = {i: n for n, i in enumerate(i for i, c in enumerate(nb.cells) if c.cell_type == "code")}
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    if on_cell is not None:
        client.on_cell_start = lambda cell, cell_index: on_cell(
            path.stem, code_index.get(cell_index, 0), len(code_index), _first_line(cell.source, 70))
    error = None
    start = time.perf_counter()
    with MemoryWatch() as memory:
        try:
            client.execute(env=kernel_env(quick))
        except CellExecutionError as exc:  # the cell's own error is read below; this one holds its traceback
            error = f"{exc.ename}: {exc.evalue}"[:500]
    total = time.perf_counter() - start
    code = [nb.cells[i] for i in code_index]
    cells = [{"index": n, "first_line": _first_line(c.source, 80), "seconds": _seconds(c), "output": _text(c)}
             for n, c in enumerate(code)]
    failed = next((n for n, c in enumerate(code) if any(o.get("output_type") == "error" for o in c.outputs)), None)
    cells_s = sum(c["seconds"] or 0 for c in cells)
    return {"notebook": path.stem, "mode": "quick" if quick else "full", "complete": error is None,
            "error": error, "failed_cell": failed, "cells_s": round(cells_s, 1), "minutes": round(cells_s / 60, 1),
            "total_s": round(total, 1),
            "checks_passed": [line for c in cells for line in c["output"].splitlines()
                              if line.startswith("check passed")],
            "memory": memory.as_dict(), "cells": cells}


def default_path(notebooks: list[dict[str, Any]] | list[str]) -> Path:
    """runs/course-timings/<time>-<notebooks>.json, a new file."""
    stems = "-".join(Path(str(n)).stem.split("-", 1)[0] for n in notebooks)
    return results.new_path(runs_dir() / NAME, f"{results.stamp()}-{stems}.json")


def time_course(notebooks: Iterable[str | Path], quick: bool = False, out: Path | None = None,
                on_start: Callable[[str], None] | None = None,
                on_done: Callable[[dict[str, Any]], None] | None = None,
                on_cell: CellHook | None = None) -> tuple[Path, dict[str, Any]]:
    """Time `notebooks` one after another (each in its own kernel) and write the result, with the environment, to
    `out` or a new file under runs/course-timings/; returns (path, result)."""
    names = list(notebooks)
    paths = [notebook_path(n) for n in names]  # every name checked before the first notebook runs
    out = out or default_path([p.stem for p in paths])
    results.ensure_new(out)
    runs = []
    for path in paths:
        if on_start is not None:
            on_start(path.stem)
        runs.append(time_notebook(path, quick=quick, on_cell=on_cell))
        if on_done is not None:
            on_done(runs[-1])
    result = {"mode": "quick" if quick else "full", "notebooks": runs,
              "minutes": round(sum(r["cells_s"] for r in runs) / 60, 1), "complete": all(r["complete"] for r in runs)}
    return results.write(NAME, result, out=out), result


def record(written: Path) -> Path:
    """File a timing result under data/results/course-timings/ (a new file)."""
    return results.record(NAME, written)
