"""`pdlab workshop time` (pdlab.workshop.timing), run as a user types it on a small notebook written here whose third
cell fails: a real kernel, the console script in a subprocess, the JSON it writes read back."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from pdlab.course import ATTACH_ENV, QUICK_ENV, RUN_ENV
from pdlab.workshop import timing
from tests.conftest import run_pdlab

HEADER = textwrap.dedent('''\
    # ---
    # jupyter:
    #   kernelspec:
    #     display_name: Python 3 (ipykernel)
    #     language: python
    #     name: python3
    # ---

    # %% [markdown]
    # # A notebook to time
    ''')

NOTEBOOK = HEADER + textwrap.dedent('''\

    # %%
    import os, time
    print(os.environ["PDLAB_QUICK"], os.environ.get("PDLAB_RUN"), os.environ.get("PDLAB_ATTACH"))

    # %%
    time.sleep(0.5)
    print("check passed: slept")

    # %%
    1 / 0

    # %%
    print("never runs")
    ''')


def test_time_writes_per_cell_times_and_says_which_cell_failed(tmp_path: Path) -> None:
    notebook = tmp_path / "notebook.py"
    notebook.write_text(NOTEBOOK)
    # A shared deployment or run of the test session must not reach the learner's kernel.
    env = {**os.environ, "PDLAB_RUNS": str(tmp_path / "runs"), RUN_ENV: "/nowhere", ATTACH_ENV: "nothing"}
    done = run_pdlab("workshop", "time", str(notebook), "--quick", timeout=120, env=env)
    assert done.returncode == 1, f"a failed notebook must fail the command:\n{done.stdout}\n{done.stderr}"
    [path] = (tmp_path / "runs" / timing.NAME).glob("*.json")
    assert f"written: {path}" in done.stdout, done.stdout
    result = json.loads(path.read_text())
    assert result["benchmark"] == timing.NAME and result["mode"] == "quick" and result["complete"] is False
    assert result["environment"]["cpu"], "the machine is recorded beside the times"
    [run] = result["notebooks"]
    assert run["notebook"] == "notebook" and run["cells"][0]["output"].split() == ["1", "None", "None"], \
        "quick mode, and nothing of a shared deployment or run"
    assert 0.5 <= run["cells"][1]["seconds"] < 5 and run["checks_passed"] == ["check passed: slept"]
    assert run["failed_cell"] == 2 and run["error"] == "ZeroDivisionError: division by zero"
    assert run["cells"][3]["seconds"] is None, "nothing runs after the failed cell"
    assert run["cells_s"] >= 0.5 and result["minutes"] == run["minutes"] == round(run["cells_s"] / 60, 1)
    assert run["total_s"] >= run["cells_s"] and 0 < run["memory"]["available_low_gib"] <= \
        run["memory"]["available_start_gib"]
    with pytest.raises(FileExistsError):  # checked before any notebook runs
        timing.time_course([notebook], out=path)


def test_the_learner_runs_full_parameters_by_default() -> None:
    env = timing.kernel_env(quick=False)
    assert env[QUICK_ENV] == "0" and ATTACH_ENV not in env and RUN_ENV not in env
