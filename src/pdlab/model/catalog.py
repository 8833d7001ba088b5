"""The catalog: accelerators, model shapes and KV-transfer links, each figure with its source. The simulator prices
steps and transfers with it; notebook 01 draws its GPUs' roofs.

The figures live in `data/catalog/*.yaml` (one place for each fact); this module only types and loads them.
The local pdlab-* models take their shapes from their recipes (pdlab.model.CATALOG).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field

from pdlab.config.base import ConfigError, Spec, validate
from pdlab.model.shape import ModelShape
from pdlab.settings import data_dir


class Sourced(Spec):
    source: str = Field(min_length=1)
    """Where the figures come from (a datasheet URL, a config.json, a measurement)."""
    assumed: list[str] = []
    """Fields that are assumptions rather than sourced figures."""


class Hardware(Sourced):
    """One accelerator."""

    peak_bf16_tflops: float = Field(gt=0)
    """Dense bf16 tensor throughput, TFLOP/s."""
    hbm_gbps: float = Field(gt=0)
    """Memory bandwidth, GB/s."""
    memory_gib: float = Field(gt=0)
    """Device memory, GiB (vendors' GB, used as GiB: the difference is below the efficiency factors' error)."""
    compute_efficiency: float = Field(gt=0, le=1)
    """Achieved fraction of peak FLOP/s in large matmuls."""
    memory_efficiency: float = Field(gt=0, le=1)
    """Achieved fraction of peak memory bandwidth."""
    step_overhead_ms: float = Field(ge=0)
    """Fixed cost per scheduler step outside the forward pass (the serving engine's scheduling, input preparation
    and sampling); where `layer_overhead_us` is not measured it also stands for the forward pass's kernel latencies."""
    layer_overhead_us: float = Field(default=0.0, ge=0)
    """Fixed time per layer of a forward pass that neither FLOPs nor bytes explain (kernel latencies, replayed from
    a CUDA graph), fitted on GPU profiles (`pdlab sim efficiency`); 0 where none was measured."""
    tensor_parallel_link: str = Field(min_length=1)
    """The `links` entry joining the GPUs of one instance: what its tensor-parallel all-reduces cross."""
    gpus_per_node: int = Field(gt=0)
    """The most GPUs on that link: the largest tensor-parallel instance."""

    @property
    def ridge_point(self) -> float:
        """Arithmetic intensity (FLOP/byte) above which a bf16 kernel is compute-bound rather than memory-bound, at
        the published peaks."""
        return self.peak_bf16_tflops * 1e12 / (self.hbm_gbps * 1e9)


class Link(Sourced):
    """A KV-transfer path between a prefill and a decode instance."""

    bandwidth_gbps: float = Field(gt=0)
    """Nominal bandwidth one instance's transfers can use, Gbit/s."""
    latency_us: float = Field(ge=0)
    """One-way latency per transfer (setup, handshake, first byte), microseconds."""
    efficiency: float = Field(default=1.0, gt=0, le=1)
    """Achieved fraction of the nominal bandwidth."""
    per_gpu: bool = True
    """The bandwidth is each GPU's own (EFA's share per GPU, NVLink, an InfiniBand port per GPU), so the ranks of a
    tensor-parallel instance add theirs up; false for a NIC they share (Ethernet over TCP, a host's loopback)."""

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8 * self.efficiency


class Catalog(Spec):
    hardware: dict[str, Hardware]
    models: dict[str, ModelShape]
    links: dict[str, Link]

    def model_named(self, name: str) -> str:
        """The catalog name of `name`: a catalog name itself, or a Hugging Face id one of the shapes lists."""
        if name in self.models:
            return name
        for catalog_name, shape in self.models.items():
            if name in shape.hub_ids:
                return catalog_name
        known = sorted(hub for shape in self.models.values() for hub in shape.hub_ids)
        raise ConfigError("catalog models", [(name, f"no shape in data/catalog/models.yaml lists it in `hub_ids` "
                                                    f"(listed: {', '.join(known)})")])

    def get(self, kind: str, name: str):  # -> Hardware | ModelShape | Link
        table = getattr(self, kind)
        if name not in table:
            raise ConfigError(f"catalog {kind}", [(name, f"unknown; known: {', '.join(sorted(table))}")])
        return table[name]


def catalog_dir() -> Path:
    return data_dir() / "catalog"


def load_catalog(directory: Path | None = None) -> Catalog:
    """Load hardware.yaml, models.yaml and links.yaml; the local pdlab-* models are added from their recipes."""
    from pdlab.model import CATALOG as LOCAL_MODELS

    directory = directory or catalog_dir()
    tables = {}
    for kind in ("hardware", "models", "links"):
        path = directory / f"{kind}.yaml"
        if not path.exists():
            raise ConfigError(str(path), [("(file)", "no such file")])
        tables[kind] = yaml.safe_load(path.read_text()) or {}
    catalog = validate(Catalog, tables, source=str(directory))
    unknown = [(f"hardware.{name}.tensor_parallel_link", f"{hw.tensor_parallel_link!r} is not in links.yaml "
                f"(known: {', '.join(sorted(catalog.links))})")
               for name, hw in catalog.hardware.items() if hw.tensor_parallel_link not in catalog.links]
    if unknown:
        raise ConfigError(str(directory), unknown)
    unsourced = [(f"models.{name}.source", "every shape says where its figures come from")
                 for name, shape in catalog.models.items() if not shape.source]
    if unsourced:
        raise ConfigError(str(directory), unsourced)
    for name, recipe in LOCAL_MODELS.items():
        catalog.models.setdefault(name, recipe.shape)
    return catalog
