"""A lab spec (`labs/*.yaml`): one file that says what to deploy and, for experiments, what to measure."""

from __future__ import annotations

from pathlib import Path

from pydantic import model_validator

from pdlab.config.base import Spec, load_yaml
from pdlab.config.cluster import ClusterSpec
from pdlab.config.deployment import DeploymentSpec
from pdlab.config.workload import WorkloadSpec


class LabSpec(Spec):
    """A lab: a deployment to bring up, or several scenarios to compare under one workload."""

    name: str
    """Lab name (used for run directories)."""
    description: str = ""
    """What the lab shows, in a sentence or two."""
    deployment: DeploymentSpec | None = None
    """The deployment `pdlab up` brings up."""
    scenarios: dict[str, DeploymentSpec] = {}
    """Named deployments an experiment compares on the same cores."""
    workload: WorkloadSpec | None = None
    """The load an experiment sends."""
    seed: int = 0
    """Seed for everything random in the lab."""
    cluster: ClusterSpec | None = None
    """Cluster-tier settings (pdlab.cluster)."""

    @model_validator(mode="after")
    def _has_deployment(self) -> LabSpec:
        if self.deployment is None and not self.scenarios:
            raise ValueError("a lab needs a `deployment` or at least one entry in `scenarios`")
        return self

    def main_deployment(self) -> DeploymentSpec:
        """The deployment `pdlab up` starts: `deployment`, else the first scenario."""
        if self.deployment is not None:
            return self.deployment
        return next(iter(self.scenarios.values()))

def load_lab(path: str | Path) -> LabSpec:
    """Load and validate a lab spec; errors name the file and each bad field."""
    return load_yaml(path, LabSpec)

