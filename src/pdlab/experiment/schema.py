"""JSON Schema of a run's summary.json: what notebooks, the demo and tests may rely on."""

from __future__ import annotations

from typing import Any

import jsonschema

_NUMBER_OR_NULL = {"type": ["number", "null"]}

PERCENTILES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["p50", "p90", "p99", "max", "mean", "count"],
    "properties": {"p50": _NUMBER_OR_NULL, "p90": _NUMBER_OR_NULL, "p99": _NUMBER_OR_NULL, "max": _NUMBER_OR_NULL,
                   "mean": _NUMBER_OR_NULL, "count": {"type": "integer", "minimum": 0}},
}

_COUNT = {"type": "integer", "minimum": 0}

CLASS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "requests", "stalls", "worst_gap_ms", "stalled"],
    "properties": {"ttft_ms": PERCENTILES_SCHEMA, "itl_ms": PERCENTILES_SCHEMA, "tpot_ms": PERCENTILES_SCHEMA,
                   "e2e_ms": PERCENTILES_SCHEMA, "stalls": _COUNT, "worst_gap_ms": PERCENTILES_SCHEMA,
                   "stalled": {"type": "object", "required": ["requests", "of", "share"],
                               "properties": {"requests": _COUNT, "of": _COUNT,
                                              "share": {"type": ["number", "null"], "minimum": 0, "maximum": 1}}}},
}

REQUESTS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["sent", "completed", "failed"],
    "properties": {"sent": _COUNT, "completed": _COUNT, "failed": _COUNT, "scheduled": _COUNT, "not_sent": _COUNT},
}

SCENARIO_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["requests"],
    "properties": {
        "short": CLASS_SCHEMA, "long": CLASS_SCHEMA, "probe": CLASS_SCHEMA, "all": CLASS_SCHEMA,
        "stalls": {"type": "object", "required": ["count", "total_ms", "k"],
                   "properties": {"count": _COUNT, "total_ms": {"type": "number"}, "k": {"type": "number"}}},
        "short_itl_during_long_prefill_ms": PERCENTILES_SCHEMA,
        "requests": REQUESTS_SCHEMA,
        "by_path": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["requests", "ttft_ms", "itl_ms"],
            "properties": {"ttft_ms": PERCENTILES_SCHEMA, "itl_ms": PERCENTILES_SCHEMA,
                           "after_prefill_ms": PERCENTILES_SCHEMA}}},
    },
}

#: An LMCache P/D scenario's pushes and loads, per request, from LMCache's own log lines (pdlab.lmcache.figures).
LMCACHE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["disaggregated", "pushed", "pushed_tokens", "push_ms", "loaded", "loaded_tokens", "load_ms",
                 "loaded_in_full", "recomputed"],
    "properties": {**{name: _COUNT for name in ("disaggregated", "pushed", "pushed_tokens", "loaded",
                                                "loaded_tokens", "loaded_in_full", "recomputed")},
                   **{name: {"type": "object", "required": ["median", "max"],
                             "properties": {"median": _NUMBER_OR_NULL, "max": _NUMBER_OR_NULL}}
                      for name in ("push_ms", "load_ms")}},
}

SUMMARY_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "pdlab run summary",
    "type": "object",
    "required": ["lab", "started", "complete", "stall_k", "scenarios", "baseline", "kv_transfer"],
    "properties": {
        "lab": {"type": "string"},
        "started": {"type": "string"},
        "finished": {"type": ["string", "null"]},
        "complete": {"type": "boolean"},
        "stall_k": {"type": "number"},
        "scenarios": {"type": "object", "additionalProperties": SCENARIO_SCHEMA},
        "baseline": {"oneOf": [SCENARIO_SCHEMA, {"type": "null"}]},
        "kv_transfer": {"type": "object", "additionalProperties": {
            "type": "object", "properties": {"lmcache": LMCACHE_SCHEMA}}},
    },
}


def check_summary(summary: dict) -> None:
    """Raise jsonschema.ValidationError when `summary` does not match SUMMARY_SCHEMA."""
    jsonschema.validate(summary, SUMMARY_SCHEMA)
