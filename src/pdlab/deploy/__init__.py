"""Bring deployments up and down: plan (ports, cores, vLLM flags), launch (processes, health, progress),
and keep no orphans."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdlab.deploy.launcher import DeployError, Deployment, RunningInstance
    from pdlab.deploy.plan import InstancePlan, PlanError, plan_deployment

#: Each name's module, imported on first use: a `pdlab` command that needs none of them starts without them.
_WHERE = {
    "DeployError": "pdlab.deploy.launcher",
    "Deployment": "pdlab.deploy.launcher",
    "RunningInstance": "pdlab.deploy.launcher",
    "InstancePlan": "pdlab.deploy.plan",
    "PlanError": "pdlab.deploy.plan",
    "plan_deployment": "pdlab.deploy.plan",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


__all__ = ["DeployError", "Deployment", "InstancePlan", "PlanError", "RunningInstance", "plan_deployment"]
