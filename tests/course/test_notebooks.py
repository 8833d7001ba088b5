"""Execute every course notebook top to bottom in quick mode, with a real kernel from this Python environment.

The sources are jupytext percent-format `.py` files; each is converted to a notebook in memory and run with
nbclient. Any cell error (a failing check cell included) fails the test and shows the cell's traceback.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from pdlab.course import ATTACH_ENV, RUN_ENV
from pdlab.netlab import unavailable_reason
from pdlab.workshop import timing, workbook
from tests.course.test_browser import BROWSER_NOTEBOOKS

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]-*.py"))

#: Per-notebook time limit for one cell, seconds (quick mode keeps each notebook well under a minute).
CELL_TIMEOUT_S = 300
#: Notebooks that serve from the session's shared deployments, by the fixtures naming them: they get them through
#: $PDLAB_ATTACH instead of starting their own (`course.open_deployment` picks the one laid out as it needs). 00 and
#: 03 start theirs (bringing one up is their subject).
ATTACHED = {"05-load-and-slos": ("notebook_1p1d",), "06-threshold-break-even": ("notebook_1p1d",)}

#: Notebooks that read a run of a lab the session made already (its fixture names the run directory, $PDLAB_RUN)
#: instead of running the lab again: 02 reads the demo's.
SHARED_RUNS = {"02-hol-blocking": "demo_run"}


def kernel_env(attach: str | None = None, run: str | None = None) -> dict[str, str]:
    """A learner's kernel environment in quick mode (`pdlab workshop time`'s), plus `attach`, a running deployment
    for the notebook to use ($PDLAB_ATTACH), and `run`, a run directory to read ($PDLAB_RUN)."""
    return {**timing.kernel_env(quick=True), **({ATTACH_ENV: attach} if attach else {}),
            **({RUN_ENV: run} if run else {})}


def execute(path: Path, attach: str | None = None, run: str | None = None) -> nbformat.NotebookNode:
    notebook = workbook.with_answers(path)  # every exercise's answer runs after the notebook, in its kernel
    client = NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    # The "python3" kernelspec starts sys.executable (jupyter_client substitutes it), i.e. this venv's Python.
    client.execute(env=kernel_env(attach, run))
    return notebook


def test_notebooks_exist() -> None:
    assert NOTEBOOKS, f"no notebooks found under {NOTEBOOKS_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_follows_the_course_pattern(path: Path) -> None:
    """Every notebook: objectives first, a `parameters` cell read through pdlab.course, a check cell, exercises
    last; every code cell compiles (guarded notebooks included, so they cannot rot while they wait)."""
    notebook = jupytext.read(path)
    cells = notebook.cells
    assert cells[0].cell_type == "markdown" and "Learning objectives" in cells[0].source, "first cell: objectives"
    parameters = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(parameters) == 1 and "course.choose(" in parameters[0].source, "one `parameters` cell with quick mode"
    code = [c for c in cells if c.cell_type == "code"]
    assert any("course.check(" in c.source for c in code), "no check cell"
    assert cells[-1].cell_type == "markdown" and "## Exercises" in cells[-1].source, "last cell: exercises"
    numbers = [int(line.split(".")[0]) for line in cells[-1].source.splitlines() if line[:1].isdigit()]
    assert numbers and numbers == list(range(1, len(numbers) + 1)), \
        f"exercises: a numbered list 1., 2., ... (answers refer to them by number), got {numbers}"
    for i, cell in enumerate(code):
        compile(cell.source, f"{path.name}[code cell {i}]", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    assert notebook.metadata["jupytext"]["formats"] == "ipynb,py:percent", "pair with ipynb (make lab syncs them)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path: Path, request: pytest.FixtureRequest) -> None:
    if path.stem in BROWSER_NOTEBOOKS:
        pytest.skip("run top to bottom, every check cell asserted, in a real browser by tests/course/test_browser.py")
    # Only the notebooks that need it start the shared deployment (`-k 07` starts no vLLM).
    attach = ",".join(request.getfixturevalue(name) for name in ATTACHED.get(path.stem, ())) or None
    run = None
    if path.stem in SHARED_RUNS:
        try:
            run = str(request.getfixturevalue(SHARED_RUNS[path.stem]).dir)
        except pytest.FixtureLookupError:  # no such session run in this checkout: the notebook runs the lab itself
            run = None
    try:
        notebook = execute(path, attach, run)
    except CellExecutionError as error:
        pytest.fail(f"{path.name} failed in quick mode:\n{error}", pytrace=False)
    executed = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert executed and all(cell.get("execution_count") for cell in executed), "not every code cell ran"
    checks = [out for cell in executed for out in cell.get("outputs", []) if "check passed" in out.get("text", "")]
    assert checks, f"{path.name} has no check cell that passed (every notebook must assert its effect)"
    printed = "".join(out.get("text", "") for cell in executed for out in cell.get("outputs", []))
    if path.stem == "03-disaggregate" and unavailable_reason() is None:  # as root (CI): the two-node layout, for real
        assert "two nodes with a shaped link" in printed and "check passed: a " in printed, \
            "03 did not run on two nodes, or did not check the link's effect"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_exercise_has_an_answer(path: Path) -> None:
    """notebooks/answers/NN-topic.py answers each exercise, with an explanation (the runs above execute them)."""
    workbook.check_answered(path)


def test_kernel_is_this_python() -> None:
    """The notebooks must run in the interpreter that has pdlab installed, not some other python3 on the PATH."""
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import sys; print(sys.executable)")])
    NotebookClient(notebook, timeout=60, kernel_name="python3").execute(env=kernel_env())
    assert notebook.cells[0].outputs[0]["text"].strip() == sys.executable
