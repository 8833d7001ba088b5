"""Goodput, as DistServe defines it: the share of requests that meet both a TTFT and a TPOT objective
(SLO attainment), and the highest request rate at which that share stays at or above a target (90%).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import pandas as pd

from pdlab.metrics.latency import DEFAULT_STALL_K, gaps, itl_values, percentiles, request_metrics

#: DistServe's attainment target: goodput is the highest rate at which at least this share meets both SLOs.
DEFAULT_ATTAINMENT = 0.9


def slo_attainment(rows: pd.DataFrame, ttft_slo_s: float, tpot_slo_s: float, cls: str | None = None) -> float:
    """Share of sent requests (every row, failures included, as a failure meets no SLO) with TTFT <= ttft_slo_s
    and TPOT <= tpot_slo_s. A one-token answer has no TPOT and meets that half by definition."""
    sent = rows if cls is None else rows[rows["cls"] == cls]
    if sent.empty:
        return math.nan
    timed = request_metrics(sent)
    tpot_ok = timed["tpot_s"].isna() | (timed["tpot_s"] <= tpot_slo_s)
    good = int(((timed["ttft_s"] <= ttft_slo_s) & tpot_ok).sum())
    return good / len(sent)


def goodput_rate(sweep: Mapping[float, pd.DataFrame], ttft_slo_s: float, tpot_slo_s: float,
                 target: float = DEFAULT_ATTAINMENT, cls: str | None = None) -> float | None:
    """The highest measured rate (requests/s) of `sweep` (rate -> rows of the run at that rate) whose SLO
    attainment is >= target; None if no rate reaches it. Only measured rates are candidates (no interpolation)."""
    good = [rate for rate, rows in sweep.items() if slo_attainment(rows, ttft_slo_s, tpot_slo_s, cls) >= target]
    return max(good) if good else None


def attainment_curve(sweep: Mapping[float, pd.DataFrame], ttft_slo_s: float, tpot_slo_s: float,
                     cls: str | None = None) -> pd.DataFrame:
    """rate, attainment for each run of a sweep, sorted by rate (for pdlab.report's sweep figure)."""
    data = [{"rate": rate, "attainment": slo_attainment(rows, ttft_slo_s, tpot_slo_s, cls)}
            for rate, rows in sweep.items()]
    return pd.DataFrame(data, columns=["rate", "attainment"]).sort_values("rate", ignore_index=True)


def sweep_table(runs: Mapping[tuple[str, float], pd.DataFrame], ttft_slo_s: float, tpot_slo_s: float,
                stall_k: float = DEFAULT_STALL_K) -> pd.DataFrame:
    """One line per (scenario, rate) run of a sweep: SLO attainment and the HOL headline figures, ready for
    `pdlab.report.sweep_figure` (e.g. `y="attainment"` or `y="short_itl_p99_ms"`)."""
    lines = []
    for (scenario, rate), rows in runs.items():
        timed = request_metrics(rows, stall_k)
        short_itl = percentiles(itl_values(rows, "short"), 1000)
        lines.append({
            "scenario": scenario, "rate": rate, "attainment": slo_attainment(rows, ttft_slo_s, tpot_slo_s),
            "short_itl_p50_ms": short_itl["p50"], "short_itl_p99_ms": short_itl["p99"],
            "short_itl_max_ms": short_itl["max"],
            "short_ttft_p99_ms": percentiles(timed.loc[timed["cls"] == "short", "ttft_s"], 1000)["p99"],
            "long_ttft_p99_ms": percentiles(timed.loc[timed["cls"] == "long", "ttft_s"], 1000)["p99"],
            "stalls": int(gaps(rows, stall_k)["stall"].sum()), "sent": int(len(rows)),
        })
    return pd.DataFrame(lines).sort_values(["scenario", "rate"], ignore_index=True) if lines else pd.DataFrame()
