"""Bring deployments up and down: plan (ports, cores, vLLM flags), launch (processes, health, progress),
and keep no orphans."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdlab import lazy_names

if TYPE_CHECKING:
    from pdlab.deploy.launcher import DeployError, Deployment, RunningInstance
    from pdlab.deploy.plan import InstancePlan, PlanError, plan_deployment

__getattr__ = lazy_names(__name__, {
    "pdlab.deploy.launcher": ("DeployError", "Deployment", "RunningInstance"),
    "pdlab.deploy.plan": ("InstancePlan", "PlanError", "plan_deployment"),
})


__all__ = ["DeployError", "Deployment", "InstancePlan", "PlanError", "RunningInstance", "plan_deployment"]
