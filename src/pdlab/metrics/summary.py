"""The summary of a run, built from raw rows: per scenario, what a learner compares across deployments.

    {"scenarios": {"colocated": {...}, "colocated_chunked": {...}, "disaggregated": {...}},
     "baseline": {...}}

Each scenario block has `short.itl_ms.{p50,p90,p99,max,...}`, `short.ttft_ms`, `long.ttft_ms` (one block per
class present), `stalls.count`, `requests.{scheduled,sent,completed,failed,not_sent}`, and HOL details. Per
request, each class block also has `worst_gap_ms` (percentiles over requests of each one's longest gap) and
`stalled` (how many requests, and what share of the completed ones, stalled at least once).
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from pdlab.metrics.latency import (
    DEFAULT_STALL_K,
    completed,
    gaps,
    gaps_during_prefills,
    itl_values,
    percentiles,
    request_metrics,
)


def class_summary(rows: pd.DataFrame, per_request: pd.DataFrame, cls: str | None) -> dict:
    """Latency percentiles (ms) of one class (None: all requests)."""
    timed = per_request if cls is None else per_request[per_request["cls"] == cls]
    sent = rows if cls is None else rows[rows["cls"] == cls]
    return {
        "ttft_ms": percentiles(timed["ttft_s"], 1000),
        "itl_ms": percentiles(itl_values(rows, cls), 1000),
        "tpot_ms": percentiles(timed["tpot_s"], 1000),
        "e2e_ms": percentiles(timed["e2e_s"], 1000),
        "requests": {"sent": int(len(sent)), "completed": int(len(timed))},
        "stalls": int(timed["stalls"].sum()),
        "worst_gap_ms": percentiles(timed["max_gap_s"], 1000),
        "stalled": stalled_requests(timed),
    }


def stalled_requests(per_request: pd.DataFrame) -> dict:
    """How many of these requests (one line each, from request_metrics) stalled at least once, and their share of
    the requests that had a gap to stall in (more than one token)."""
    streamed = per_request[per_request["tokens"] > 1]
    count = int((streamed["stalls"] > 0).sum())
    return {"requests": count, "of": int(len(streamed)), "share": count / len(streamed) if len(streamed) else None}


def failure_kinds(rows: pd.DataFrame, limit: int = 10) -> dict[str, int]:
    """What failed: the failed requests counted by status, HTTP status and the first line of their error (the most
    common `limit` kinds), e.g. `{"http_error 503: no decode instance is available": 3}`."""
    failed = rows.drop(index=completed(rows).index)
    if failed.empty:
        return {}

    def kind(row: pd.Series) -> str:
        error = row["error"] if isinstance(row["error"], str) else ""
        http = int(row["http_status"]) if pd.notna(row["http_status"]) else 0
        return f"{row['status']} {http}: {error.splitlines()[0][:120] if error else '(no message)'}"

    return {str(k): int(v) for k, v in failed.apply(kind, axis=1).value_counts().head(limit).items()}


def request_counts(rows: pd.DataFrame, scheduled: int | None = None) -> dict:
    """sent = rows written (every request that was sent, whatever its end); completed = status ok with tokens;
    failed = sent - completed; not_sent = scheduled - sent (an interrupted run); by_status = rows per status."""
    sent = int(len(rows))
    done = int(len(completed(rows)))
    counts = {"sent": sent, "completed": done, "failed": sent - done,
              "by_status": {str(k): int(v) for k, v in rows["status"].value_counts().sort_index().items()},
              "failures": failure_kinds(rows)}
    if scheduled is not None:
        counts.update(scheduled=int(scheduled), not_sent=int(scheduled) - sent)
    late = rows["late_s"].dropna()
    counts["late_ms_max"] = float(late.max() * 1000) if len(late) else None
    return counts


def scenario_summary(rows: pd.DataFrame, stall_k: float = DEFAULT_STALL_K, scheduled: int | None = None) -> dict:
    """The summary block of one scenario (or of the baseline) from its raw rows."""
    per_request = request_metrics(rows, stall_k)
    all_gaps = gaps(rows, stall_k)
    stalled = all_gaps[all_gaps["stall"]]
    summary: dict = {cls: class_summary(rows, per_request, cls) for cls in sorted(rows["cls"].unique())}
    summary["all"] = class_summary(rows, per_request, None)
    summary["stalls"] = {"k": stall_k, "count": int(len(stalled)), "total_ms": float(stalled["gap_s"].sum() * 1000),
                         "by_class": {str(k): int(v) for k, v in stalled["cls"].value_counts().sort_index().items()}}
    summary["short_itl_during_long_prefill_ms"] = percentiles(gaps_during_prefills(rows)["gap_s"], 1000)
    summary["requests"] = request_counts(rows, scheduled)
    after = after_prefill_ms(rows, per_request)
    summary["by_path"] = {}
    for path, group in per_request.groupby("path"):
        if not path:
            continue
        block = {"requests": int(len(group)), "ttft_ms": percentiles(group["ttft_s"], 1000),
                 "itl_ms": percentiles(itl_values(rows[rows["path"] == path]), 1000)}
        if len(mine := after.reindex(group["request_id"]).dropna()):
            block["after_prefill_ms"] = percentiles(mine)
        summary["by_path"][str(path)] = block
    return summary


def after_prefill_ms(rows: pd.DataFrame, per_request: pd.DataFrame) -> pd.Series:
    """P/D requests, by request id: the time (ms) from the prefill instance's answer (the router's `prefill_ms`) to
    the first token: the KV's move (pulled by the decode instance, or pushed by the prefill instance and
    reported), the decode instance's queue and its first step. Push against pull shows here. None for a request
    the router reported no prefill time for (a direct path)."""
    prefill_ms = pd.to_numeric(rows.set_index("request_id")["prefill_ms"], errors="coerce")
    prefill_ms = prefill_ms[~prefill_ms.index.duplicated()]
    ttft_ms = per_request.set_index("request_id")["ttft_s"] * 1000
    return (ttft_ms - prefill_ms.reindex(ttft_ms.index)).dropna()


def build_summary(scenarios: Mapping[str, pd.DataFrame], baseline: pd.DataFrame | None = None,
                  stall_k: float = DEFAULT_STALL_K, scheduled: Mapping[str, int] | None = None) -> dict:
    """`{"scenarios": {name: scenario_summary}, "baseline": scenario_summary or None}`; `scheduled` maps a
    scenario name (or "baseline") to how many requests its schedule held, for exact not-sent counts."""
    scheduled = scheduled or {}
    return {
        "stall_k": stall_k,
        "scenarios": {name: scenario_summary(rows, stall_k, scheduled.get(name)) for name, rows in scenarios.items()},
        "baseline": scenario_summary(baseline, stall_k, scheduled.get("baseline")) if baseline is not None else None,
    }

