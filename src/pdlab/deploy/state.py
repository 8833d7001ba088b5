"""Records of detached deployments (`pdlab up`), so `pdlab status` and `pdlab down` can find their processes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from pdlab.deploy.guard import GROUPS_FILE, ipc_dir
from pdlab.deploy.process import stop_group, stop_groups
from pdlab.settings import state_dir

if TYPE_CHECKING:
    from pdlab.deploy.launcher import Deployment


def _path(name: str):  # type: ignore[no-untyped-def]
    return state_dir() / f"{name}.json"


def save(dep: Deployment) -> None:
    processes = [{"name": i.name, "role": i.spec.role, "url": i.url, "pid": i.process.pid,
                  "create_time": i.process.create_time, "log": str(i.log_path)} for i in dep.instances]
    if dep.router is not None:
        processes.append({"name": "router", "role": "router", "url": dep.router_url, "pid": dep.router.pid,
                          "create_time": dep.router.create_time, "log": str(dep.router.log_path)})
    guard = dep._guard
    record = {"name": dep.spec.name, "run_dir": str(dep.run_dir), "served_model": dep.served_model,
              "url": dep.url, "processes": processes, "admin_token": dep.admin_token,
              "guard": None if guard is None else {"pid": guard.pid, "create_time": guard.create_time,
                                                   "log": str(guard.log_path)}}
    state_dir().mkdir(parents=True, exist_ok=True, mode=0o700)
    path = _path(dep.spec.name)
    # The record holds the router's admin token: readable by its owner only.
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(json.dumps(record, indent=2))


def load(name: str) -> dict[str, Any] | None:
    path = _path(name)
    return json.loads(path.read_text()) if path.exists() else None


def load_all() -> list[dict[str, Any]]:
    if not state_dir().exists():
        return []
    return [json.loads(p.read_text()) for p in sorted(state_dir().glob("*.json"))]


def remove(name: str) -> None:
    _path(name).unlink(missing_ok=True)


def process_alive(entry: dict[str, Any]) -> bool:
    try:
        return abs(psutil.Process(entry["pid"]).create_time() - entry["create_time"]) < 0.01
    except psutil.NoSuchProcess:
        return False


def any_alive(record: dict[str, Any]) -> bool:
    return any(process_alive(p) for p in record["processes"])


def stop(record: dict[str, Any]) -> None:
    """Stop every process group of a recorded deployment, router first, then its instances at once (each vLLM takes
    seconds to go), then its guard, then forget it."""
    routers = [p for p in record["processes"] if p.get("role") == "router"]
    for entry in routers:
        stop_group(entry["pid"], entry["create_time"])
    stop_groups([(p["pid"], p["create_time"]) for p in record["processes"] if p not in routers])
    (Path(record["run_dir"]) / GROUPS_FILE).unlink(missing_ok=True)  # the guard's list: it exits
    if guard := record.get("guard"):
        stop_group(guard["pid"], guard["create_time"], timeout_s=5)
    shutil.rmtree(ipc_dir(record["run_dir"]), ignore_errors=True)
    remove(record["name"])
