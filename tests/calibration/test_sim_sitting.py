"""`pdlab sim sitting`: the plan's commands and how a sitting runs, stops and records (steps run as real child
processes; the labs and benches themselves are covered by their own tests)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from pdlab.calibration.sitting import SittingError, Step, plan, run, scenario_dirs
from pdlab.cli import app

LABS = Path("labs")


def _fake_run(run_dir: Path, scenarios: list[str]) -> None:
    for name in scenarios:
        (run_dir / name).mkdir(parents=True)
        (run_dir / name / "rows.csv").write_text("request_id\n")


def _pairs(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == flag]


def test_plan_interleaves_the_labs_between_the_speed_probes(tmp_path: Path) -> None:
    steps = plan(tmp_path, labs_dir=LABS, calibration_runs=2, validation_runs=3)
    names = [s.name for s in steps]
    assert names == [
        "prefill probe",
        "sim-calibration run 1", "hol-blocking run 1", "threshold-sweep run 1",
        "sim-calibration run 2", "hol-blocking run 2", "threshold-sweep run 2",
        "hol-blocking run 3", "threshold-sweep run 3",
        "admission probe (P/D pair)", "admission probe (colocated pair)", "streams probe", "transfer probe",
        "speed check", "fit", "validation"]
    lab_run = steps[1].command()
    assert lab_run[:3] == [sys.executable, "-m", "pdlab.cli"]
    assert lab_run[3:] == ["run", str(LABS / "sim-calibration.yaml"), "--out",
                           str(tmp_path / "runs" / "sim-calibration-1")]
    assert all("--quick" not in s.command() for s in steps[:-2])
    assert "--lengths" in steps[13].command()


def test_plan_quick_shortens_every_measurement(tmp_path: Path) -> None:
    steps = plan(tmp_path, labs_dir=LABS, calibration_runs=1, validation_runs=1, quick=True)
    for step in steps[:-2]:
        argv = step.command()
        if "run" in argv[3:4]:
            assert "--quick" in argv, step.name
        elif "prefill" in argv[3:5]:  # the speed check compares the fastest of the prefill probes' repeats
            assert not _pairs(argv, "--repeats"), step.name
        else:
            assert _pairs(argv, "--repeats") == ["1"], step.name


def test_fit_and_validation_name_the_recorded_runs(tmp_path: Path) -> None:
    steps = plan(tmp_path, labs_dir=LABS, calibration_runs=2, validation_runs=3, evaluations=500, seeds=2)
    runs = tmp_path / "runs"
    for i in (1, 2):
        _fake_run(runs / f"sim-calibration-{i}", ["colocated", "disaggregated"])
    for i in (1, 2, 3):
        _fake_run(runs / f"hol-blocking-{i}", ["baseline", "colocated"])
        _fake_run(runs / f"threshold-sweep-{i}", ["disaggregated@0", "disaggregated@1024"])
    fit, validation = steps[-2].command(), steps[-1].command()
    assert fit[3:6] == ["sim", "calibrate", "--from-runs"]
    assert fit[6:10] == [str(runs / f"sim-calibration-{i}" / s) for i in (1, 2) for s in ("colocated", "disaggregated")]
    probes = tmp_path / "probes"
    assert _pairs(fit, "--prefill-probe") == [str(probes / "prefill.json")]
    assert _pairs(fit, "--admission-probe") == [str(probes / "admission-pd.json"),
                                                str(probes / "admission-colocated.json")]
    assert _pairs(fit, "--transfer-probe") == [str(probes / "transfer.json")]
    assert _pairs(fit, "--seeds") == ["2"] and _pairs(fit, "--evaluations") == ["500"]
    assert _pairs(fit, "--out") == [str(tmp_path / "profile.json")]
    validated = validation[5:9]
    assert validated == [str(runs / "hol-blocking-1" / "baseline"), str(runs / "hol-blocking-1" / "colocated"),
                         str(runs / "threshold-sweep-1" / "disaggregated@0"),
                         str(runs / "threshold-sweep-1" / "disaggregated@1024")]
    assert all("-2" in p for p in _pairs(validation, "--pool")) and len(_pairs(validation, "--pool")) == 4
    assert all("-3" in p for p in _pairs(validation, "--repeat")) and len(_pairs(validation, "--repeat")) == 4
    assert _pairs(validation, "--profile") == [str(tmp_path / "profile.json")]
    assert "--record" not in validation  # a sitting's validation stays in its own directory


def test_two_validation_runs_pool_without_a_repeat(tmp_path: Path) -> None:
    steps = plan(tmp_path, labs_dir=LABS, calibration_runs=1, validation_runs=2)
    runs = tmp_path / "runs"
    _fake_run(runs / "sim-calibration-1", ["colocated"])
    for i in (1, 2):
        _fake_run(runs / f"hol-blocking-{i}", ["colocated"])
        _fake_run(runs / f"threshold-sweep-{i}", ["disaggregated@0"])
    validation = steps[-1].command()
    assert len(_pairs(validation, "--pool")) == 2 and not _pairs(validation, "--repeat")


def test_a_run_without_rows_is_named(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(SittingError, match="no scenario with measured rows"):
        scenario_dirs(tmp_path / "empty")
    with pytest.raises(SittingError, match="at least one"):
        plan(tmp_path, labs_dir=LABS, calibration_runs=0)


def _writes(path: Path, text: str = "x", status: int = 0) -> list[str]:
    code = f"import pathlib, sys; p = pathlib.Path({str(path)!r}); p.parent.mkdir(parents=True, exist_ok=True); " \
           f"p.write_text({text!r}); sys.exit({status})"
    return [sys.executable, "-c", code]


def _speed(seconds: dict[int, float]) -> str:
    return json.dumps({"points": [{"prompt_tokens": n, "ttft_s": s} for n, s in seconds.items()]})


def test_a_sitting_runs_every_step_and_records_the_speed_drift(tmp_path: Path) -> None:
    out = tmp_path / "sitting"
    first, last, other = out / "probes" / "prefill.json", out / "probes" / "speed-check.json", out / "runs" / "a"
    steps = [Step("prefill probe", _writes(first, _speed({64: 0.030, 3000: 1.2})), first),
             Step("a lab", _writes(other), other),
             Step("speed check", _writes(last, _speed({64: 0.033, 3000: 1.26})), last)]
    manifest = run(steps, out)
    assert manifest["complete"] is True
    assert [s["exit_status"] for s in manifest["steps"]] == [0, 0, 0]
    assert manifest["speed"]["ratio_end_to_start"] == pytest.approx({"64": 1.1, "3000": 1.05})
    assert manifest["speed"]["speed_drift_pct"] == pytest.approx(10.0)
    saved = json.loads((out / "sitting.json").read_text())
    assert saved["complete"] is True and saved["environment"]["cpu_count"]


def test_a_failed_step_stops_the_sitting_and_keeps_what_it_recorded(tmp_path: Path) -> None:
    out = tmp_path / "sitting"
    steps = [Step("one", _writes(out / "one"), out / "one"),
             Step("two", _writes(out / "two", status=3), out / "two"),
             Step("three", _writes(out / "three"), out / "three")]
    with pytest.raises(SittingError, match="two failed .exit status 3."):
        run(steps, out)
    manifest = json.loads((out / "sitting.json").read_text())
    assert manifest["complete"] is False
    assert manifest["stopped"] == "step 'two' exited with status 3"
    assert [(s["name"], s["exit_status"]) for s in manifest["steps"]] == [("one", 0), ("two", 3)]
    assert (out / "one").exists() and not (out / "three").exists()
    with pytest.raises(SittingError, match="not empty"):
        run(steps, out)  # never into earlier results


def test_dry_run_prints_the_plan_and_records_nothing(tmp_path: Path) -> None:
    out = tmp_path / "sitting"
    result = CliRunner().invoke(app, ["sim", "sitting", "--dry-run", "--out", str(out), "--validation-runs", "2"],
                                terminal_width=400)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[0].startswith(" 1. prefill probe: pdlab bench prefill")
    assert lines[-1].startswith("14. validation: pdlab sim validate")
    assert not out.exists()


SITTING_SCRIPT = """
import sys
from pathlib import Path
from pdlab.calibration.sitting import Step, run
out = Path(sys.argv[1])
child = "import os, pathlib, time; pathlib.Path(%r).write_text(str(os.getpid())); time.sleep(60)" % sys.argv[2]
try:
    run([Step("long", [sys.executable, "-c", child], out / "long")], out)
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_sigterm_ends_the_step_and_marks_the_sitting_incomplete(tmp_path: Path) -> None:
    out, pid_file = tmp_path / "sitting", tmp_path / "child.pid"
    sitting = subprocess.Popen([sys.executable, "-c", SITTING_SCRIPT, str(out), str(pid_file)])
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the step never started"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    os.kill(sitting.pid, signal.SIGTERM)
    assert sitting.wait(timeout=30) == 130
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    manifest = json.loads((out / "sitting.json").read_text())
    assert manifest["complete"] is False and manifest["stopped"] == "interrupted (Ctrl-C or SIGTERM)"
