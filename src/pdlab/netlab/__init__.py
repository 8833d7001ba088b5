"""Two nodes on one machine: network namespaces joined by a shaped veth link."""

from pdlab.netlab.iproute import NetLabUnavailable, unavailable_reason
from pdlab.netlab.presets import PRESET_LINKS, ShapedRate, kv_bytes_per_token, real_link, shaped_rate
from pdlab.netlab.topology import NetLab, cleanup_stale, for_deployment, leftovers, link_only_tls

__all__ = [
    "PRESET_LINKS",
    "NetLab",
    "NetLabUnavailable",
    "ShapedRate",
    "cleanup_stale",
    "for_deployment",
    "kv_bytes_per_token",
    "leftovers",
    "link_only_tls",
    "real_link",
    "shaped_rate",
    "unavailable_reason",
]
