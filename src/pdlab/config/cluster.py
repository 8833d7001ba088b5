"""Cluster-tier settings (pdlab.cluster): filled in by the cluster work."""

from __future__ import annotations

from pdlab.config.base import Spec


class ClusterSpec(Spec):
    """Where and how a deployment runs on a GPU cluster."""
