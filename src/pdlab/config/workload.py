"""What load to send (pdlab.load): filled in by the measurement work."""

from __future__ import annotations

from pdlab.config.base import Spec


class WorkloadSpec(Spec):
    """A load to send at a deployment."""

    kind: str = "mixed"
    """Workload kind."""
