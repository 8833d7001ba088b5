"""How to measure (pdlab.metrics): pure functions over the raw rows of pdlab.load, plus the KV-transfer
figures vLLM exports. docs/metrics.md is the glossary."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdlab import lazy_names

if TYPE_CHECKING:
    from pdlab.metrics.goodput import DEFAULT_ATTAINMENT, attainment_curve, goodput_rate, slo_attainment, sweep_table
    from pdlab.metrics.kv import KVTransferStats, parse_kv_transfer, scrape_kv_transfer
    from pdlab.metrics.latency import (
        DEFAULT_STALL_K,
        completed,
        gaps,
        gaps_during_prefills,
        itl_values,
        percentiles,
        prefill_intervals,
        request_metrics,
    )
    from pdlab.metrics.summary import build_summary, request_counts, scenario_summary

__getattr__ = lazy_names(__name__, {
    "pdlab.metrics.goodput": ("DEFAULT_ATTAINMENT", "attainment_curve", "goodput_rate", "slo_attainment",
        "sweep_table"),
    "pdlab.metrics.kv": ("KVTransferStats", "parse_kv_transfer", "scrape_kv_transfer"),
    "pdlab.metrics.latency": ("DEFAULT_STALL_K", "completed", "gaps", "gaps_during_prefills", "itl_values",
        "percentiles", "prefill_intervals", "request_metrics"),
    "pdlab.metrics.summary": ("build_summary", "request_counts", "scenario_summary"),
})


__all__ = [
    "DEFAULT_ATTAINMENT",
    "DEFAULT_STALL_K",
    "KVTransferStats",
    "attainment_curve",
    "build_summary",
    "completed",
    "gaps",
    "gaps_during_prefills",
    "goodput_rate",
    "itl_values",
    "parse_kv_transfer",
    "percentiles",
    "prefill_intervals",
    "request_counts",
    "request_metrics",
    "scenario_summary",
    "scrape_kv_transfer",
    "slo_attainment",
    "sweep_table",
]
