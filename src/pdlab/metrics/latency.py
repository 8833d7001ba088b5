"""Per-request latency and head-of-line figures, as pure functions over the raw rows (pdlab.load.rows).

Definitions (docs/metrics.md has the glossary):
- TTFT: send -> first streamed token.
- E2E: send -> last streamed token.
- TPOT: (E2E - TTFT) / (tokens - 1), one number per request: the mean decode step it saw.
- ITL: every gap between consecutive streamed tokens of a request, kept one by one (a stall is one big gap;
  averaging it into TPOT hides it, which is why HOL blocking is read from ITL, not TPOT).
- Stall: a gap longer than `k` times the median gap of the same request.
- Worst gap: a request's longest inter-token gap (one number per request; its percentiles over requests say how
  many requests froze and for how long, whatever share of all gaps the freezes are).
Latency figures count completed (`ok`) requests only; failures are counted, not timed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import pandas as pd

#: A gap counts as a stall when it exceeds this many times its request's median gap: big enough that ordinary
#: step-to-step variation is not a stall, small enough that a prefill taking several decode steps' time is.
DEFAULT_STALL_K = 5.0

#: Percentiles every summary reports.
PERCENTILES = (50, 90, 99)


def completed(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows of requests that ended normally (status `ok`) with at least one token."""
    return rows[(rows["status"] == "ok") & (rows["token_times"].map(len) > 0)]


def output_tokens(row: pd.Series) -> int:
    """Tokens a request generated: the server's usage count when it sent one, else the streamed chunks."""
    usage = row.get("usage_completion_tokens")
    if usage is not None and not (isinstance(usage, float) and math.isnan(usage)) and int(usage) > 0:
        return int(usage)
    return len(row["token_times"])


def request_metrics(rows: pd.DataFrame, stall_k: float = DEFAULT_STALL_K) -> pd.DataFrame:
    """One line per completed request: ttft_s, e2e_s, tpot_s (NaN for one-token answers), tokens,
    median_itl_s, max_gap_s (its worst gap; NaN for one-token answers), stalls (count), stall_s (summed stalled
    gaps), plus its id, class, path and start_s."""
    out = []
    for _, row in completed(rows).iterrows():
        times = row["token_times"]
        gaps = np.diff(times)
        tokens = output_tokens(row)
        median = float(np.median(gaps)) if len(gaps) else math.nan
        stalled = gaps[gaps > stall_k * median] if len(gaps) else gaps
        ttft, e2e = float(times[0]), float(times[-1])
        out.append({
            "request_id": row["request_id"], "cls": row["cls"], "path": row["path"], "start_s": row["start_s"],
            "ttft_s": ttft, "e2e_s": e2e, "tpot_s": (e2e - ttft) / (tokens - 1) if tokens > 1 else math.nan,
            "tokens": tokens, "median_itl_s": median, "max_gap_s": float(gaps.max()) if len(gaps) else math.nan,
            "stalls": int(len(stalled)), "stall_s": float(stalled.sum()),
        })
    columns = ["request_id", "cls", "path", "start_s", "ttft_s", "e2e_s", "tpot_s", "tokens", "median_itl_s",
               "max_gap_s", "stalls", "stall_s"]
    return pd.DataFrame(out, columns=columns)


def gaps(rows: pd.DataFrame, stall_k: float = DEFAULT_STALL_K) -> pd.DataFrame:
    """Every inter-token gap of every completed request, on the run's timeline: request_id, cls, path,
    index (0 = between tokens 1 and 2), t0_s and t1_s (seconds since the load began), gap_s, median_s
    (of that request), stall (gap_s > stall_k * median_s)."""
    out = []
    for _, row in completed(rows).iterrows():
        times = np.asarray(row["token_times"], dtype=float)
        if len(times) < 2:
            continue
        diffs = np.diff(times)
        median = float(np.median(diffs))
        for i, gap in enumerate(diffs):
            out.append({"request_id": row["request_id"], "cls": row["cls"], "path": row["path"], "index": i,
                        "t0_s": row["start_s"] + times[i], "t1_s": row["start_s"] + times[i + 1],
                        "gap_s": float(gap), "median_s": median, "stall": bool(gap > stall_k * median)})
    columns = ["request_id", "cls", "path", "index", "t0_s", "t1_s", "gap_s", "median_s", "stall"]
    # explicit dtypes: an empty frame's `stall` must still be a boolean mask, not a column selector
    return pd.DataFrame(out, columns=columns).astype({"index": int, "t0_s": float, "t1_s": float, "gap_s": float,
                                                       "median_s": float, "stall": bool})


def itl_values(rows: pd.DataFrame, cls: str | None = None) -> np.ndarray:
    """All inter-token gaps (seconds) of completed requests, optionally of one class."""
    selected = completed(rows)
    if cls is not None:
        selected = selected[selected["cls"] == cls]
    parts = [np.diff(times) for times in selected["token_times"] if len(times) > 1]
    return np.concatenate(parts) if parts else np.array([], dtype=float)


def prefill_intervals(rows: pd.DataFrame, cls: str = "long") -> pd.DataFrame:
    """When each request of class `cls` was in prefill: [start_s, start_s + TTFT] on the run's timeline.
    A request that produced no token counts as in prefill until it ended (it may have stalled others)."""
    selected = rows[rows["cls"] == cls]
    out = [{"request_id": row["request_id"], "t0_s": row["start_s"],
            "t1_s": row["start_s"] + (row["token_times"][0] if len(row["token_times"]) else row["end_s"])}
           for _, row in selected.iterrows()]
    return pd.DataFrame(out, columns=["request_id", "t0_s", "t1_s"])


def gaps_during_prefills(rows: pd.DataFrame, cls: str = "short", prefill_cls: str = "long",
                         stall_k: float = DEFAULT_STALL_K) -> pd.DataFrame:
    """The gaps of `cls` requests whose interval overlaps some `prefill_cls` request's prefill interval:
    the decode steps a long prefill could have delayed (open intervals: touching at an end is no overlap)."""
    all_gaps = gaps(rows, stall_k)
    mine = all_gaps[all_gaps["cls"] == cls]
    prefills = prefill_intervals(rows, prefill_cls)
    if mine.empty or prefills.empty:
        return mine.iloc[0:0]
    starts, ends = prefills["t0_s"].to_numpy(), prefills["t1_s"].to_numpy()
    overlaps = [bool(np.any((t0 < ends) & (t1 > starts))) for t0, t1 in zip(mine["t0_s"], mine["t1_s"], strict=True)]
    return mine[overlaps]


def percentiles(values: Iterable[float], scale: float = 1.0, qs: tuple[int, ...] = PERCENTILES) -> dict:
    """`{p50, p90, p99, max, mean, count}` of `values` times `scale` (1000 for ms); numpy's linear
    interpolation between closest ranks. Empty input gives None for every statistic and count 0."""
    data = np.asarray(list(values), dtype=float) * scale
    data = data[~np.isnan(data)]
    if data.size == 0:
        return {**{f"p{q}": None for q in qs}, "max": None, "mean": None, "count": 0}
    stats = {f"p{q}": float(np.percentile(data, q)) for q in qs}
    return {**stats, "max": float(data.max()), "mean": float(data.mean()), "count": int(data.size)}


def stall_causes(rows: pd.DataFrame, cls: str = "short", prefill_cls: str = "long",
                 stall_k: float = DEFAULT_STALL_K) -> pd.DataFrame:
    """Each stalled gap of a `cls` request, longest first, with the `prefill_cls` request whose prefill overlapped
    it most (`long_request`, its prefill `long_t0_s`-`long_t1_s`, `overlap_s`; none and 0 when no prefill did):
    the prompt that held the stream up, when both ran on one instance."""
    stalled = gaps(rows, stall_k)
    stalled = stalled[stalled["stall"] & (stalled["cls"] == cls)].sort_values("gap_s", ascending=False)
    prefills = prefill_intervals(rows, prefill_cls)
    out = []
    for _, gap in stalled.iterrows():
        overlap = (np.minimum(prefills["t1_s"], gap["t1_s"]) - np.maximum(prefills["t0_s"], gap["t0_s"])).clip(0)
        best = int(overlap.to_numpy().argmax()) if len(prefills) else -1
        found = best >= 0 and overlap.iloc[best] > 0
        out.append({**gap.drop("stall").to_dict(),
                    "long_request": prefills["request_id"].iloc[best] if found else None,
                    "long_t0_s": prefills["t0_s"].iloc[best] if found else math.nan,
                    "long_t1_s": prefills["t1_s"].iloc[best] if found else math.nan,
                    "overlap_s": float(overlap.iloc[best]) if found else 0.0})
    columns = ["request_id", "cls", "path", "index", "t0_s", "t1_s", "gap_s", "median_s", "long_request",
               "long_t0_s", "long_t1_s", "overlap_s"]
    return pd.DataFrame(out, columns=columns)
