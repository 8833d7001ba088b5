"""The two-command set-up: idempotent, documented, and the conda environment says the same."""

from __future__ import annotations

import subprocess

import yaml

from tests.conftest import REPO


def test_setup_is_idempotent():
    """After `make test` set everything up, `make setup` has nothing left to do (`make -q` exits 0)."""
    result = subprocess.run(["make", "-q", "setup"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, "make setup would install again: " + result.stdout + result.stderr


def test_setup_refuses_a_disk_too_full_before_installing(tmp_path):
    """Short of free space, set-up stops before making the venv and says how much it needs and where."""
    venv = tmp_path / "venv"
    result = subprocess.run(["make", f"{venv}/bin/python", f"VENV={venv}", "NEED_FREE_GIB=1000000"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert "needs about 1000000 GiB free" in result.stderr and "GiB free" in result.stderr.split("needs", 1)[1]
    assert not venv.exists()


def test_ci_runs_the_readme_test_command():
    assert "make test" in (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    assert "make test" in readme and "make demo" in readme and "docs/labs.md#installing-elsewhere" in readme
    assert "download.pytorch.org/whl/cpu" in (REPO / "docs" / "labs.md").read_text()


def test_environment_yml_is_a_conda_environment():
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    assert env["name"] == "pdlab"
    deps = env["dependencies"]
    assert any(str(d).startswith("python=3.11") for d in deps) and "pip" in deps
    pip_deps = next(d["pip"] for d in deps if isinstance(d, dict))
    assert "torch==2.13.0+cpu" in pip_deps and any(d.startswith("-e .[") for d in pip_deps)
