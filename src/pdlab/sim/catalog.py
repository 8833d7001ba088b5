"""The simulator's catalog: accelerators, model shapes and KV-transfer links, each figure with its source.

The figures live in `data/catalog/*.yaml` (one place for each fact); this module only types and loads them.
The local pdlab-* models take their shapes from pdlab.model.CATALOG.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import yaml
from pydantic import Field

from pdlab.config.base import ConfigError, Spec, validate
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


class ModelShape(Sourced):
    """A decoder-only transformer's shape: enough to count FLOPs and bytes."""

    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    tie_word_embeddings: bool = False
    hub_ids: list[str] = []
    """Hugging Face ids of checkpoints with this shape (base and instruct): how a cluster lab's model is found."""

    @cached_property
    def layer_params(self) -> int:
        """Weights of one layer: q, k, v, o projections and the gated MLP (norms are negligible)."""
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        return attn + 3 * self.hidden_size * self.intermediate_size

    @cached_property
    def params(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.layer_params + embeddings

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V for every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


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


def local_model_shape(name: str) -> ModelShape:
    """A pdlab catalog model's shape, from its recipe."""
    from pdlab.model import CATALOG

    recipe = CATALOG[name]
    return ModelShape(
        num_layers=recipe.num_layers, hidden_size=recipe.hidden_size, num_heads=recipe.num_heads,
        num_kv_heads=recipe.num_kv_heads, head_dim=recipe.hidden_size // recipe.num_heads,
        intermediate_size=recipe.intermediate_size, vocab_size=recipe.vocab_size,
        source=f"pdlab.model.CATALOG[{name!r}] (the recipe the local model is made from)",
    )


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
    for name in LOCAL_MODELS:
        catalog.models.setdefault(name, local_model_shape(name))
    return catalog
