"""NIXL KV-transfer figures parsed from a Prometheus exposition made the way vLLM makes it (same metric names,
types, buckets and labels as vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from pdlab.metrics import KVTransferStats, parse_kv_transfer
from pdlab.metrics.kv import reuse_line

LABELS = ["model_name", "engine"]


def vllm_like_registry():
    registry = CollectorRegistry()
    metrics = {
        "xfer": Histogram("vllm:nixl_xfer_time_seconds", "transfer duration", LABELS, registry=registry,
                          buckets=[0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]),
        "post": Histogram("vllm:nixl_post_time_seconds", "post time", LABELS, registry=registry,
                          buckets=[0.001, 0.005, 0.01, 0.1, 1.0]),
        "bytes": Histogram("vllm:nixl_bytes_transferred", "bytes", LABELS, registry=registry,
                           buckets=[2 ** (10 + i) for i in range(1, 25, 2)]),
        "desc": Histogram("vllm:nixl_num_descriptors", "descriptors", LABELS, registry=registry,
                          buckets=[10, 100, 1000, 10000]),
        "failed": Counter("vllm:nixl_num_failed_transfers", "failed", LABELS, registry=registry),
        "expired": Counter("vllm:nixl_num_kv_expired_reqs", "expired", LABELS, registry=registry),
        "preempted": Counter("vllm:num_preemptions", "preemptions", LABELS, registry=registry),
    }
    return registry, metrics


def observe(metrics, engine: str, transfers: list[tuple[float, float, float, int]]):
    for xfer_s, post_s, size, descriptors in transfers:
        metrics["xfer"].labels("pdlab-small", engine).observe(xfer_s)
        metrics["post"].labels("pdlab-small", engine).observe(post_s)
        metrics["bytes"].labels("pdlab-small", engine).observe(size)
        metrics["desc"].labels("pdlab-small", engine).observe(descriptors)


def test_sums_over_engines_and_derives_means():
    registry, metrics = vllm_like_registry()
    observe(metrics, "0", [(0.004, 0.001, 15_500_000, 64), (0.006, 0.002, 4_500_000, 16)])
    observe(metrics, "1", [(0.010, 0.003, 10_000_000, 40)])
    metrics["failed"].labels("pdlab-small", "1").inc(2)
    metrics["preempted"].labels("pdlab-small", "0").inc(3)
    metrics["preempted"].labels("pdlab-small", "1").inc(1)
    stats = parse_kv_transfer(generate_latest(registry).decode())
    assert stats.transfers == 3
    assert stats.bytes == 30_000_000
    assert stats.xfer_seconds == pytest.approx(0.020)
    assert stats.post_seconds == pytest.approx(0.006)
    assert stats.descriptors == 120
    assert stats.failed_transfers == 2
    assert stats.kv_expired == 0
    assert stats.preemptions == 4
    assert stats.mean_bytes == 10_000_000
    assert stats.mean_xfer_ms == pytest.approx(20 / 3)
    assert stats.throughput_mb_s == pytest.approx(1500.0)  # 30 MB in 20 ms


def test_difference_of_two_scrapes_is_what_a_run_moved():
    registry, metrics = vllm_like_registry()
    observe(metrics, "0", [(0.004, 0.001, 1_000_000, 8)])
    before = parse_kv_transfer(generate_latest(registry).decode())
    observe(metrics, "0", [(0.006, 0.001, 3_000_000, 8), (0.010, 0.001, 5_000_000, 8)])
    moved = parse_kv_transfer(generate_latest(registry).decode()) - before
    assert moved.transfers == 2
    assert moved.bytes == 8_000_000
    assert moved.xfer_seconds == pytest.approx(0.016)


def test_no_nixl_metrics_is_all_zero():
    text = "# HELP vllm:num_requests_running Requests\n# TYPE vllm:num_requests_running gauge\n" \
           'vllm:num_requests_running{model_name="m"} 3.0\n'
    stats = parse_kv_transfer(text)
    assert stats == KVTransferStats()
    assert stats.mean_bytes is None and stats.throughput_mb_s is None


def test_prefix_cache_counters_give_the_hit_rate():
    registry, _ = vllm_like_registry()
    queries = Counter("vllm:prefix_cache_queries", "tokens looked up", LABELS, registry=registry)
    hits = Counter("vllm:prefix_cache_hits", "tokens found", LABELS, registry=registry)
    for engine, asked, found in (("0", 1000, 600), ("1", 1000, 200)):
        queries.labels("pdlab-small", engine).inc(asked)
        hits.labels("pdlab-small", engine).inc(found)
    stats = parse_kv_transfer(generate_latest(registry).decode())
    assert (stats.prefix_queried_tokens, stats.prefix_hit_tokens) == (2000, 800)
    assert stats.prefix_hit_rate == pytest.approx(0.4)
    assert KVTransferStats().prefix_hit_rate is None and "prefix_hit_rate" in stats.as_dict()


def test_prompt_tokens_are_split_into_cached_loaded_and_computed():
    registry, _ = vllm_like_registry()
    for name, value in (("vllm:prefix_cache_queries", 1000), ("vllm:prefix_cache_hits", 400),
                        ("vllm:external_prefix_cache_queries", 600), ("vllm:external_prefix_cache_hits", 150)):
        Counter(name, "tokens", LABELS, registry=registry).labels("pdlab-small", "0").inc(value)
    kv = parse_kv_transfer(generate_latest(registry).decode()).as_dict()
    assert kv["connector_hit_rate"] == pytest.approx(0.15)
    assert reuse_line(kv) == ("prompt tokens: 40% from vLLM's prefix cache, 15% loaded from LMCache (its KV "
                              "connector), 45% computed (1,000 in all)")
    # No prefix cache, nothing looked up: no line; NIXL pulls (tokens counted on both instances of a pair): none.
    assert reuse_line(KVTransferStats().as_dict()) is None
    assert reuse_line(dict(kv, transfers=3)) is None
