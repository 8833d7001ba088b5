"""KV-transfer figures from a vLLM instance's Prometheus `/metrics` text (NixlConnector).

vLLM 0.32 (`vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py`) exports, per engine:
histograms `vllm:nixl_xfer_time_seconds` (transfer duration), `vllm:nixl_post_time_seconds` (time to post the
transfer), `vllm:nixl_bytes_transferred` (bytes per transfer), `vllm:nixl_num_descriptors`; counters
`vllm:nixl_num_failed_transfers`, `vllm:nixl_num_failed_notifications`, `vllm:nixl_num_kv_expired_reqs`,
`vllm:nixl_num_notifications_after_expiry`. They are recorded on the instance that pulls the KV (the decode
side), cumulative since start: scrape before and after a run and subtract. Beside them, every engine's
`vllm:num_preemptions` counter: requests whose KV was dropped because the cache ran out (recomputed later).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import httpx
from prometheus_client.parser import text_string_to_metric_families

XFER_TIME = "vllm:nixl_xfer_time_seconds"
POST_TIME = "vllm:nixl_post_time_seconds"
BYTES = "vllm:nixl_bytes_transferred"
DESCRIPTORS = "vllm:nixl_num_descriptors"
FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers"
FAILED_NOTIFICATIONS = "vllm:nixl_num_failed_notifications"
KV_EXPIRED = "vllm:nixl_num_kv_expired_reqs"
PREEMPTIONS = "vllm:num_preemptions"


@dataclass(frozen=True)
class KVTransferStats:
    """Totals over all engines of one instance (or a difference of two scrapes)."""

    transfers: float = 0
    """Completed transfers (count of the transfer-time histogram)."""
    bytes: float = 0
    """Bytes moved, summed over transfers."""
    xfer_seconds: float = 0
    """Transfer time, summed over transfers."""
    post_seconds: float = 0
    """Time spent posting transfers, summed."""
    descriptors: float = 0
    """Descriptors, summed over transfers."""
    failed_transfers: float = 0
    failed_notifications: float = 0
    kv_expired: float = 0
    preemptions: float = 0
    """Requests preempted (their KV dropped for lack of cache, to be recomputed)."""

    def __sub__(self, earlier: KVTransferStats) -> KVTransferStats:
        return KVTransferStats(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def __add__(self, other: KVTransferStats) -> KVTransferStats:
        return KVTransferStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def mean_bytes(self) -> float | None:
        return self.bytes / self.transfers if self.transfers else None

    @property
    def mean_xfer_ms(self) -> float | None:
        return self.xfer_seconds * 1000 / self.transfers if self.transfers else None

    @property
    def throughput_mb_s(self) -> float | None:
        """Bytes over transfer time (MB = 1e6 bytes): the link speed while transferring."""
        return self.bytes / self.xfer_seconds / 1e6 if self.xfer_seconds else None

    def as_dict(self) -> dict:
        return {**asdict(self), "mean_bytes": self.mean_bytes, "mean_xfer_ms": self.mean_xfer_ms,
                "throughput_mb_s": self.throughput_mb_s}


def parse_kv_transfer(text: str) -> KVTransferStats:
    """Sum vLLM's NIXL metrics over every label set (engines, models) in a Prometheus text exposition.
    Metrics that are absent (no NixlConnector, or no transfer yet) count as zero."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return KVTransferStats(
        transfers=sums.get(f"{XFER_TIME}_count", 0.0),
        bytes=sums.get(f"{BYTES}_sum", 0.0),
        xfer_seconds=sums.get(f"{XFER_TIME}_sum", 0.0),
        post_seconds=sums.get(f"{POST_TIME}_sum", 0.0),
        descriptors=sums.get(f"{DESCRIPTORS}_sum", 0.0),
        failed_transfers=sums.get(f"{FAILED_TRANSFERS}_total", 0.0),
        failed_notifications=sums.get(f"{FAILED_NOTIFICATIONS}_total", 0.0),
        kv_expired=sums.get(f"{KV_EXPIRED}_total", 0.0),
        preemptions=sums.get(f"{PREEMPTIONS}_total", 0.0),
    )


def scrape_kv_transfer(base_url: str, timeout_s: float = 5.0) -> KVTransferStats:
    """GET `<base_url>/metrics` and parse the NIXL figures."""
    response = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout_s)
    response.raise_for_status()
    return parse_kv_transfer(response.text)
