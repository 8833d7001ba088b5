"""The accelerator catalog (`data/hardware.yaml`): published peak compute and memory bandwidth, each with its source,
for roofline pictures and for what-if arithmetic about GPUs this machine does not have."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from pdlab.config.base import Spec, load_yaml
from pdlab.settings import data_dir

Precision = Literal["bf16", "fp16", "tf32", "fp32"]


class Device(Spec):
    """One accelerator's published peaks."""

    name: str
    """Marketing name and form factor, e.g. `H100 SXM`."""
    kind: Literal["gpu", "cpu"] = "gpu"
    """What it is."""
    peak_flops: dict[Precision, float]
    """Dense (no sparsity) peak throughput per precision, FLOP/s."""
    mem_bandwidth: float = Field(gt=0)
    """Peak memory bandwidth, bytes/s."""
    memory_bytes: float = Field(gt=0)
    """Memory capacity, bytes."""
    memory_kind: str = ""
    """Memory technology (HBM3, HBM3e, DDR5, ...)."""
    source: str = Field(min_length=1)
    """Where the figures are published: document name and address."""

    def ridge_point(self, precision: Precision = "bf16") -> float:
        """Arithmetic intensity (FLOP/byte) above which a kernel is compute-bound rather than memory-bound."""
        return self.peak_flops[precision] / self.mem_bandwidth


class HardwareCatalog(Spec):
    """The file `data/hardware.yaml`."""

    devices: list[Device]
    """Accelerators, in the order figures show them."""

    def get(self, name: str) -> Device:
        for device in self.devices:
            if device.name == name:
                return device
        raise KeyError(f"no device {name!r} in the hardware catalog; it has: {', '.join(d.name for d in self.devices)}")


def catalog_path() -> Path:
    return data_dir() / "hardware.yaml"


def load_catalog(path: str | Path | None = None) -> HardwareCatalog:
    """Load and validate the hardware catalog (errors name the file and each bad field)."""
    return load_yaml(path or catalog_path(), HardwareCatalog)
