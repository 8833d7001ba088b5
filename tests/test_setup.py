"""The two-command set-up: idempotent, documented, and the conda environment says the same."""

from __future__ import annotations

import re
import subprocess
from importlib import metadata

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from pdlab.workshop.preflight import CONSTRAINTS_FILE, read_pins
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
    assert "-c constraints.txt" in pip_deps  # the same pins as make setup


def _installed_closure(root: str, extras: tuple[str, ...]) -> tuple[dict[str, str], set[str]]:
    """Every distribution `root[extras]` needs, transitively (each with the extras asked of it), with its installed
    version; and the names it needs that are not installed."""
    found: dict[str, str] = {}
    missing: set[str] = set()
    seen: set[tuple[str, str]] = set()
    todo = [(canonicalize_name(root), extra) for extra in ("", *extras)]
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen or name in missing:
            continue
        seen.add((name, extra))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.add(name)
            continue
        found[name] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                todo += [(canonicalize_name(req.name), wanted) for wanted in ("", *req.extras)]
    found.pop(canonicalize_name(root))
    return found, missing


def test_constraints_pin_every_package_setup_installs():
    """constraints.txt pins the whole resolution of pdlab[local,lab,dev] (LMCache's pins are its own file's), and
    this venv, which `make setup` built with it, holds exactly those versions. A dependency added to pyproject.toml
    without `make constraints`, or a pin that is not what runs here, fails."""
    makefile = (REPO / "Makefile").read_text()
    assert "pip install --quiet -c $(CONSTRAINTS) $(INSTALL_TARGET)" in makefile
    extras = re.search(r"INSTALL_TARGET := -e '\.\[(.*)\]'", makefile).group(1).split(",")
    unwanted = {canonicalize_name(n) for n in re.search(r"UNWANTED := (.*)", makefile).group(1).split()}
    pinned = read_pins(REPO / CONSTRAINTS_FILE)
    lmcache = read_pins(REPO / "src" / "pdlab" / "lmcache" / "requirements.txt")
    assert not pinned.keys() & lmcache.keys(), "LMCache's pins have one home: src/pdlab/lmcache/requirements.txt"
    needed, missing = _installed_closure("pdlab", tuple(extras))
    assert missing == unwanted, "only what make setup removes may be missing"
    unpinned = sorted(needed.keys() - pinned.keys() - lmcache.keys())
    assert not unpinned, f"installed by make setup but not pinned (run make constraints): {unpinned}"
    for name, version in pinned.items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        assert installed == version, f"{name}: constraints.txt pins {version}, this venv has {installed}"
    stale = sorted(pinned.keys() - needed.keys())
    assert not stale, f"pinned but no longer needed (run make constraints): {stale}"
