"""pdlab.course (quick mode, check cells) and pdlab.environment (the set-up report)."""

from __future__ import annotations

import pytest
import torch

from pdlab import course
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
