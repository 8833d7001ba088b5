"""pdlab.course (quick mode, check cells) and pdlab.environment (the set-up report)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from pdlab import course
from pdlab.load import rundir
from pdlab.model import CATALOG


@pytest.mark.parametrize(("value", "expected"), [("", False), ("0", False), ("no", False), ("1", True),
                                                 ("true", True), ("ON", True)])
def test_quick_reads_the_environment(monkeypatch, value, expected) -> None:
    monkeypatch.setenv(course.QUICK_ENV, value)
    assert course.quick() is expected
    assert course.choose("full", "quick") == ("quick" if expected else "full")


def test_quick_rejects_a_typo(monkeypatch) -> None:
    monkeypatch.setenv(course.QUICK_ENV, "yes please")
    with pytest.raises(ValueError, match="PDLAB_QUICK"):
        course.quick()


def test_check_passes_with_a_confirmation(capsys) -> None:
    course.check(True, "decode batches well", "n/a")
    assert "check passed: decode batches well" in capsys.readouterr().out


def test_check_fails_with_the_effect_and_a_hint() -> None:
    with pytest.raises(AssertionError) as error:
        course.check(False, "decode batches well", "re-run on a quiet machine")
    assert isinstance(error.value, course.CheckFailed)
    assert "decode batches well" in str(error.value) and "re-run on a quiet machine" in str(error.value)


def test_environment_reports_versions_cores_and_models() -> None:
    env = course.setup_report()
    assert env.packages["torch"] == torch.__version__
    assert env.cpu_cores >= 1
    assert set(env.models) == set(CATALOG)
    table = course.environment_table(env)
    assert "| torch |" in table and "| CPU cores available |" in table
    assert env.as_dict()["packages"] == env.packages


def test_environment_lists_missing_packages(monkeypatch) -> None:
    monkeypatch.setitem(course.SETUP_PACKAGES, "absent", "pdlab-no-such-distribution")
    env = course.setup_report()
    assert env.packages["absent"] is None
    assert "absent" in env.missing() and "torch" not in env.missing()
    assert "| absent | **MISSING** |" in course.environment_table(env)


class FakeDeployment:
    """What `course.check` and `course.leftovers` use of a deployment `course.start` began."""

    def __init__(self) -> None:
        self.stopped = 0
        self.spec = type("Spec", (), {"name": "fake"})()
        self.instances: list = []
        self.router = None

    def stop(self) -> None:
        self.stopped += 1


def test_a_failing_check_stops_what_the_notebook_started(monkeypatch) -> None:
    dep = FakeDeployment()
    monkeypatch.setattr(course, "_STARTED", [dep])
    with pytest.raises(course.CheckFailed, match=r"Stopped this notebook's deployment\(s\) \['fake'\]"):
        course.check(False, "an effect", "a hint")
    assert dep.stopped == 1 and course._STARTED == []
    course.check(True, "another effect", "a hint")  # a passing check stops nothing


def test_leftovers_finds_a_server_started_elsewhere_and_stops_it(monkeypatch) -> None:
    monkeypatch.delenv(course.ATTACH_ENV, raising=False)
    # A process whose command line looks like a vLLM server's, in its own process group as pdlab starts them.
    fake = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                             "vllm.entrypoints.openai.api_server", "--port", "18999"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not (found := [f for f in course.leftovers() if f.pgid == fake.pid]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert found and "port 18999" in found[0].what and found[0].how_to_stop == f"kill -TERM -- -{fake.pid}"
        found[0].stop()
        assert fake.wait(timeout=10) is not None
        assert not [f for f in course.leftovers() if f.pgid == fake.pid]
    finally:
        if fake.poll() is None:
            fake.kill()


def test_attached_picks_the_deployment_laid_out_as_asked() -> None:
    one = course.lab_deployment("local-1p1d-router", "pdlab-tiny")
    two = course.lab_deployment("local-replicas", "pdlab-tiny")
    assert course.layout(one) != course.layout(two)
    renamed = one.model_copy(update={"name": "other", "model": one.model.model_copy(update={"name": "pdlab-small"})})
    assert course.layout(renamed) == course.layout(one)  # names, ports and the model do not matter


def test_shared_run_reads_only_a_complete_run_of_the_same_lab(tmp_path, monkeypatch) -> None:
    lab = course.lab_spec("hol-blocking", "pdlab-tiny")
    monkeypatch.setenv(course.RUN_ENV, str(tmp_path))
    assert course.shared_run(lab) is None  # no summary there
    for summary in ({"lab": "other", "complete": True, "scenarios": {}},
                    {"lab": lab.name, "complete": False, "scenarios": {}}):
        rundir.write_json(tmp_path / rundir.SUMMARY, summary)
        assert course.shared_run(lab) is None, summary
    rundir.write_json(tmp_path / rundir.SUMMARY, {"lab": lab.name, "complete": True, "scenarios": {}})
    run = course.shared_run(lab)
    assert run is not None and run.dir == tmp_path and run.summary["lab"] == lab.name
    monkeypatch.delenv(course.RUN_ENV)
    assert course.shared_run(lab) is None
