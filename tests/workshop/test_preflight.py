"""`pdlab preflight`, the check a workshop room runs on every seat, run as a learner runs it: the console script in a
subprocess, on this machine (which must pass it: CI's machine is a course seat), and against a real leftover."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdlab.workshop import preflight
from tests.standin_process import standin

REPO = Path(__file__).resolve().parents[2]


def console_script() -> str:
    """The `pdlab` console script of this environment (the one `make setup` installs)."""
    beside = Path(sys.executable).with_name("pdlab")
    found = str(beside) if beside.exists() else shutil.which("pdlab")
    assert found, "the `pdlab` console script is not installed in this environment"
    return found


def run_preflight(*args: str, timeout: float = 300) -> tuple[int, dict]:
    done = subprocess.run([console_script(), "preflight", "--json", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=os.environ.copy())
    assert done.stdout.strip(), f"no output; stderr:\n{done.stderr}"
    return done.returncode, json.loads(done.stdout)


def by_name(report: dict) -> dict[str, dict]:
    return {check["name"]: check for check in report["checks"]}


def test_this_machine_is_ready_for_the_course() -> None:
    code, report = run_preflight()
    failed = [check for check in report["checks"] if check["status"] == "fail"]
    assert code == 0 and report["passed"] and not failed, f"pre-flight failed here: {failed}"
    assert {"platform", "python", "cores", "memory", "disk", "packages", "versions", "LMCache", "models", "ports",
            "leftovers"} <= set(by_name(report))
    assert by_name(report)["versions"]["status"] == "ok", by_name(report)["versions"]  # `make setup` used the pins
    assert by_name(report)["LMCache"]["status"] == "ok", by_name(report)["LMCache"]  # `make setup` installed it


def test_lmcache_pins_have_one_home() -> None:
    """`make setup` installs LMCache from the file the pre-flight reads; a pin not met is a warning with the fix."""
    pins = preflight.lmcache_requirements()
    assert pins[0].startswith("lmcache==") and all("==" in pin for pin in pins), pins
    makefile = (REPO / "Makefile").read_text()
    assert "LMCACHE_REQUIREMENTS := src/pdlab/lmcache/requirements.txt" in makefile
    assert "--no-deps -r $(LMCACHE_REQUIREMENTS)" in makefile
    assert preflight.check_lmcache().status == "ok"
    off = preflight.check_lmcache([*pins[1:], "lmcache==0.0.1"])
    assert off.status == "warn" and off.passed and "lmcache 0.5" in off.found and "make setup" in off.fix, off
    missing = preflight.check_lmcache(["pdlab-no-such-package==1.0"])
    assert missing.status == "warn" and "pdlab-no-such-package missing" in missing.found, missing


def test_versions_other_than_the_tested_ones_are_a_warning_with_the_fix(tmp_path) -> None:
    """The `versions` check reads the checkout's constraints.txt (what `make setup` installs with); a package at
    another version is named with both versions, a pin of a package not installed is left to `packages`, and
    outside a checkout the check is skipped."""
    assert preflight.check_versions().status == "ok"
    pins = tmp_path / "constraints.txt"
    pins.write_text("# a comment\nnumpy==0.0.1\npdlab-no-such-package==1.0\n")
    off = preflight.check_versions(pins)
    assert off.status == "warn" and off.passed and "make setup" in off.fix, off
    assert off.found.startswith("1 of 1 at other versions") and "numpy " in off.found and "(tested 0.0.1)" in off.found
    assert preflight.check_versions(tmp_path / "missing.txt").status == "skip"


def test_a_leftover_server_fails_the_check_and_says_what_to_do() -> None:
    """A pdlab stand-in server still holding one of the course's ports (as after a killed notebook kernel): the
    pre-flight exits 1, names the port and the process, and says how to stop it."""
    port = min(preflight.lab_ports(preflight.course_labs()))
    with standin(port):
        code, report = run_preflight()
    checks = by_name(report)
    assert code == 1 and not report["passed"]
    assert checks["ports"]["status"] == "fail" and str(port) in checks["ports"]["found"], checks["ports"]
    assert "stand-in" in checks["ports"]["found"], "the port check should name the process that holds it"
    leftovers = checks["leftovers"]
    assert leftovers["status"] == "fail" and "stand-in" in leftovers["found"], leftovers
    assert "kill " in leftovers["fix"], leftovers


def test_a_short_machine_fails_with_a_fix() -> None:
    """Thresholds the machine cannot meet fail with the figure found and a fix (the library call the command wraps)."""
    memory = preflight.check_memory(min_available_gib=1e6)
    disk = preflight.check_disk(min_free_gib=1e9)
    for check in (memory, disk):
        assert check.status == "fail" and check.fix and "GiB" in check.found, check
    assert preflight.check_models(["no-such-model"]).status == "fail"


@pytest.mark.e2e
def test_serve_starts_vllm_and_moves_a_kv_cache() -> None:
    code, report = run_preflight("--serve", "--model", "pdlab-tiny", timeout=600)
    serve = by_name(report)["vLLM P/D request"]
    assert code == 0 and serve["status"] == "ok", serve
    assert "KV" in serve["found"] and " MB " in serve["found"], serve


def older_python() -> str | None:
    """A Python older than 3.11 on this machine, if any (pyenv's, or one on the PATH)."""
    candidates = [shutil.which(f"python3.{minor}") for minor in (10, 9, 8)]
    candidates += sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.[89]*/bin/python3"))
    candidates += sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.10*/bin/python3"))
    for path in filter(None, candidates):
        done = subprocess.run([path, "-c", "import sys; print(sys.version_info[:2] < (3, 11))"],
                              capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip() == "True":
            return path
    return None


def test_setup_refuses_a_python_older_than_311(tmp_path: Path) -> None:
    python = older_python()
    if python is None:
        pytest.skip("no Python older than 3.11 on this machine to try `make setup` with")
    venv = tmp_path / "venv"
    done = subprocess.run(["make", f"{venv}/bin/python", f"VENV={venv}", f"PYTHON={python}"], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode != 0 and "pdlab needs Python 3.11" in done.stderr, done.stderr
    assert not venv.exists()


def test_the_python_version_is_stated_once_and_agrees() -> None:
    """pyproject, the conda environment, the README and the pre-flight say the same Python."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"
    assert "python=3.11" in (REPO / "environment.yml").read_text()
    assert "Python 3.11" in (REPO / "README.md").read_text()
    assert preflight.PYTHON == (3, 11)
