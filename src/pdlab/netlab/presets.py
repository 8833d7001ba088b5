"""Link presets: real links scaled down to the local model's KV sizes, so that KV transfer time per token of
context on the shaped veth matches what the real link gives a real model (docs/netlab.md explains it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pdlab.config import LinkPreset, LinkSpec, ModelRef
from pdlab.model import CATALOG


@dataclass(frozen=True)
class RealLink:
    """A real interconnect, by its per-node bandwidth."""

    name: str
    description: str
    gbps: float


#: The links a lab can pick. EFA: p5.48xlarge has 32 x 100 Gbit/s EFA adapters per node.
REAL_LINKS: dict[str, RealLink] = {
    link.name: link
    for link in (
        RealLink("efa-p5", "AWS EFA on p5.48xlarge (32 x 100 Gbit/s)", 3200.0),
        RealLink("100gbe", "100 Gigabit Ethernet", 100.0),
        RealLink("10gbe", "10 Gigabit Ethernet", 10.0),
        RealLink("1gbe", "1 Gigabit Ethernet", 1.0),
    )
}

#: The model real links are sized for: Llama-3.1-70B (80 layers, 8 KV heads of 128 dims, bf16 KV cache).
REFERENCE_MODEL = "Llama-3.1-70B (bf16)"
REFERENCE_KV_BYTES_PER_TOKEN = 80 * 2 * 8 * 128 * 2

#: The most a veth pair carries on this machine kind (about 10.8 Gbit/s measured unshaped); scaled rates above
#: it are capped, so the fastest presets no longer keep their ratio (docs/netlab.md says which).
VETH_CAP_MBPS = 10_000.0

_DTYPE_BYTES = {"float32": 4, "auto": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(model: ModelRef) -> int:
    """KV cache bytes one token of context takes: layers x (K and V) x KV heads x head dim x dtype bytes.
    Catalog models are read from their recipe; other models from a local directory's config.json."""
    dtype_bytes = _DTYPE_BYTES[model.dtype]
    if model.name in CATALOG:
        recipe = CATALOG[model.name]
        layers, kv_heads, head_dim = recipe.num_layers, recipe.num_kv_heads, recipe.hidden_size // recipe.num_heads
    else:
        config_path = Path(model.name) / "config.json"
        if not config_path.is_file():
            raise ValueError(
                f"model {model.name!r}: cannot size its KV cache (not in the catalog, no local config.json); "
                "set link.mbps instead of a preset"
            )
        config = json.loads(config_path.read_text())
        heads = config["num_attention_heads"]
        layers = config["num_hidden_layers"]
        kv_heads = config.get("num_key_value_heads", heads)
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return layers * 2 * kv_heads * head_dim * dtype_bytes


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
    real = REAL_LINKS[preset]
    scale = kv_bytes / REFERENCE_KV_BYTES_PER_TOKEN
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
