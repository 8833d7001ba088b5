"""Two nodes on one machine: network namespaces joined by a shaped veth link."""

from pdlab.netlab.iproute import NetLabUnavailable, unavailable_reason
from pdlab.netlab.presets import REAL_LINKS, ShapedRate, kv_bytes_per_token, shaped_rate
from pdlab.netlab.topology import NetLab, cleanup_stale, for_deployment, leftovers, link_only_tls

__all__ = [
    "REAL_LINKS",
    "NetLab",
    "NetLabUnavailable",
    "ShapedRate",
    "cleanup_stale",
    "for_deployment",
    "kv_bytes_per_token",
    "leftovers",
    "link_only_tls",
    "shaped_rate",
    "unavailable_reason",
]
