"""`pdlab bench startup`: time from `up` to healthy, and each instance's memory."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console

from pdlab.benchmarks import results
from pdlab.config.deployment import DeploymentSpec
from pdlab.deploy import Deployment


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and all its descendants (vLLM runs an API server, engine core and worker)."""
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue
    return total / 2**20


def run(spec: DeploymentSpec, repeats: int = 1, out: Path | None = None,
        console: Console | None = None) -> dict[str, Any]:
    samples: list[dict[str, Any]] = []
    for attempt in range(repeats):
        if console:
            console.print(f"start-up {attempt + 1}/{repeats}")
        began = time.monotonic()
        with Deployment(spec, console=console) as dep:
            healthy_s = time.monotonic() - began
            samples.append({"up_to_healthy_s": round(healthy_s, 2),
                            "rss_mib": {i.name: round(tree_rss_mib(i.pid), 1) for i in dep.instances}})
    ups = [s["up_to_healthy_s"] for s in samples]
    summary = {"deployment": spec.name, "model": spec.model.name, "repeats": repeats,
               "up_to_healthy_s": {"median": statistics.median(ups), "min": min(ups), "max": max(ups)},
               "rss_mib": samples[-1]["rss_mib"]}
    result = {"summary": summary, "samples": samples, "spec": spec.model_dump(mode="json")}
    path = results.write("startup", result, out)
    return {**result, "path": str(path)}
