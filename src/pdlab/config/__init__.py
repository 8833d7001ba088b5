"""Typed, validated descriptions of everything pdlab runs. One class per concern; field docstrings are the
lab-spec reference."""

from pdlab.config.base import ConfigError, Spec, load_yaml, validate
from pdlab.config.cluster import ClusterSpec
from pdlab.config.deployment import (
    ConnectorSpec,
    DeploymentSpec,
    EngineOptions,
    InstanceSpec,
    LinkPreset,
    LinkSpec,
    ModelRef,
    NodeSpec,
    Role,
)
from pdlab.config.lab import LabSpec, load_lab, parse_lab
from pdlab.config.router import (
    FallbackPolicy,
    KVProtocol,
    LMCacheReceiverPorts,
    RouterSettings,
    RouterSpec,
    Strategy,
)
from pdlab.config.workload import (
    MixedWorkload,
    ProbeSpec,
    ProbeWorkload,
    TraceWorkload,
    WorkloadSpec,
    parse_workload,
)

__all__ = [
    "ClusterSpec",
    "ConfigError",
    "ConnectorSpec",
    "DeploymentSpec",
    "EngineOptions",
    "FallbackPolicy",
    "InstanceSpec",
    "KVProtocol",
    "LabSpec",
    "LinkPreset",
    "LinkSpec",
    "LMCacheReceiverPorts",
    "MixedWorkload",
    "ModelRef",
    "NodeSpec",
    "ProbeSpec",
    "ProbeWorkload",
    "Role",
    "RouterSettings",
    "RouterSpec",
    "Spec",
    "Strategy",
    "TraceWorkload",
    "WorkloadSpec",
    "load_lab",
    "parse_lab",
    "load_yaml",
    "parse_workload",
    "validate",
]
