"""Bring deployments up and down: plan (ports, cores, vLLM flags), launch (processes, health, progress),
and keep no orphans."""

from pdlab.deploy.launcher import DeployError, Deployment, RunningInstance
from pdlab.deploy.plan import InstancePlan, PlanError, plan_deployment

__all__ = ["DeployError", "Deployment", "InstancePlan", "PlanError", "RunningInstance", "plan_deployment"]
