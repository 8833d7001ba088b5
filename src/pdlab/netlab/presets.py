"""Link presets: real links scaled down to the local model's KV sizes, so that KV transfer time per token of
context on the shaped veth matches what the real link gives a real model (docs/netlab.md explains it)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from pdlab.config import LinkPreset, LinkSpec, ModelRef
from pdlab.model.shape import DTYPE_BYTES, shape_of


@dataclass(frozen=True)
class RealLink:
    """A real interconnect, by its per-node bandwidth."""

    name: str
    description: str
    gbps: float


#: Each preset a lab can pick is a link of data/catalog/links.yaml (the one home of its bandwidth and source), at a
#: node's whole bandwidth: a link that is each GPU's own (EFA's share per GPU) counts once per GPU of the node, the
#: GPUs of the accelerator named here (hardware.yaml's `gpus_per_node`); a shared NIC counts once.
PRESET_LINKS: dict[str, tuple[str, str, str | None]] = {
    "efa-p5": ("efa-p5", "AWS EFA on p5.48xlarge", "H100-SXM5-80GB"),
    "100gbe": ("tcp-100gbe", "100 Gigabit Ethernet", None),
    "10gbe": ("tcp-10gbe", "10 Gigabit Ethernet", None),
    "1gbe": ("tcp-1gbe", "1 Gigabit Ethernet", None),
}


@cache
def real_link(preset: str) -> RealLink:
    """The real link behind a preset, its per-node bandwidth from the catalog."""
    from pdlab.model.catalog import load_catalog

    catalog = load_catalog()
    name, description, accelerator = PRESET_LINKS[preset]
    link = catalog.links[name]
    gpus = catalog.hardware[accelerator].gpus_per_node if accelerator and link.per_gpu else 1
    gbps = link.bandwidth_gbps * gpus
    return RealLink(preset, f"{description} ({gpus} x {link.bandwidth_gbps:g} Gbit/s)" if gpus > 1 else description,
                    gbps)


#: The model real links are sized for: Llama-3.1-70B in bf16 (its shape from data/catalog/models.yaml).
REFERENCE_MODEL = "Llama-3.1-70B"


@cache
def reference_kv_bytes_per_token() -> int:
    """KV bytes one token of the reference model takes (bf16)."""
    from pdlab.model.catalog import load_catalog

    return load_catalog().models[REFERENCE_MODEL].kv_bytes_per_token(2)


#: The most a veth pair carries on this machine kind (about 10.8 Gbit/s measured unshaped); scaled rates above
#: it are capped, so the fastest presets no longer keep their ratio (docs/netlab.md says which).
VETH_CAP_MBPS = 10_000.0


def kv_bytes_per_token(model: ModelRef) -> int:
    """KV cache bytes one token of context takes in `model` (a catalog model, from its recipe; another, from its
    directory's config.json), in the dtype it is served in."""
    try:
        return shape_of(model.name, DTYPE_BYTES[model.dtype]).kv_bytes_per_token()
    except ValueError as error:
        raise ValueError(f"{error}: cannot size its KV cache; set link.mbps instead of a preset") from None


@dataclass(frozen=True)
class ShapedRate:
    """The rate a link is shaped to, and how it was arrived at (for reports)."""

    mbps: float
    preset: LinkPreset | None
    real_gbps: float | None
    scale: float | None
    capped: bool

    def as_dict(self) -> dict:
        return {"mbps": self.mbps, "preset": self.preset, "real_gbps": self.real_gbps, "scale": self.scale,
                "capped": self.capped}


def scaled_mbps(preset: LinkPreset, kv_bytes: int) -> ShapedRate:
    """A real link's bandwidth times (local KV bytes per token / reference KV bytes per token), capped at what a
    veth carries: the time to move one token's KV then equals the real link's for the reference model."""
    real = real_link(preset)
    scale = kv_bytes / reference_kv_bytes_per_token()
    mbps = real.gbps * 1000.0 * scale
    return ShapedRate(min(mbps, VETH_CAP_MBPS), preset, real.gbps, scale, capped=mbps > VETH_CAP_MBPS)


def shaped_rate(link: LinkSpec, model: ModelRef | None = None) -> ShapedRate:
    """The rate for a link spec: its explicit `mbps`, else its preset scaled for `model` (default: pdlab's)."""
    if link.mbps is not None:
        return ShapedRate(link.mbps, None, None, None, capped=False)
    return scaled_mbps(link.preset, kv_bytes_per_token(model or ModelRef()))


def burst_bytes(link: LinkSpec, mbps: float) -> int:
    """tbf's bucket: big enough for a 64 KiB GSO segment and for 2 ms at the rate (timer granularity)."""
    if link.burst_kib is not None:
        return link.burst_kib * 1024
    return max(64 * 1024, int(mbps * 1e6 / 8 * 0.002))
