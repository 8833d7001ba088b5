"""Goodput, as DistServe defines it: the share of requests that meet both a TTFT and a TPOT objective
(SLO attainment), and the highest request rate at which that share stays at or above a target (90%).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import pandas as pd

from pdlab.metrics.latency import request_metrics

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
