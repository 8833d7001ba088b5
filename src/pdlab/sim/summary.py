"""Per-request timings and the run summary, in the same shape as a measured run's summary.json.

Shape (per scenario): `requests.{sent,completed,failed}`, `short.*` and `long.*` with `ttft_ms`, `itl_ms`,
`tpot_ms`, `e2e_ms` (each `{p50,p99,max,mean}`), `stalls.{count,threshold_ms}`, `goodput`, `paths`,
`preemptions` (the simulator's own: how often a running request lost its KV to make room and computed it again), and
`prefix_cache.{hit_tokens,prompt_tokens,hit_rate}` (prompt tokens found in an instance's prefix cache, of all).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from pdlab.sim.engine import SimRequest


def token_times(request: SimRequest) -> np.ndarray:
    """When each output token reached the client (seconds from the run's start)."""
    if request.token_instance is None or math.isnan(request.finish):
        return np.empty(0)
    last = request.token_instance.step_end_array()[
        request.first_step:request.first_step + request.tokens_left]
    if not request.segments:
        return last
    return np.concatenate([inst.step_end_array()[first:first + n] for inst, first, n in request.segments] + [last])


def _percentile(ordered: list[float], q: float) -> float:
    """`np.percentile(values, q)` (its default, linear method) of `ordered`, the values sorted: the same floating-point
    operations in the same order, so the same result to the last bit, at a small fraction of numpy's cost on the few
    values one simulated class has (a calibration fit summarizes tens of thousands of simulations)."""
    virtual = (len(ordered) - 1) * (q / 100)
    below = math.floor(virtual)
    a, b = ordered[below], ordered[min(below + 1, len(ordered) - 1)]
    gamma = virtual - below
    return b - (b - a) * (1 - gamma) if gamma >= 0.5 else a + (b - a) * gamma


def _stats(values: np.ndarray) -> dict[str, float | None]:
    if values.size == 0:
        return {"p50": None, "p99": None, "max": None, "mean": None}
    if np.isnan(values).any():  # numpy's NaN rules
        p50, p99 = np.percentile(values, [50, 99])
    else:
        ordered = sorted(values.tolist())
        p50, p99 = _percentile(ordered, 50), _percentile(ordered, 99)
    return {"p50": float(p50), "p99": float(p99), "max": float(values.max()), "mean": float(values.mean())}


def per_request_rows(requests: Sequence[SimRequest]) -> list[dict]:
    """One row per request (like a measured run's raw rows): class, path, times and per-token gaps."""
    rows = []
    for r in requests:
        times = token_times(r)
        rows.append({
            "id": r.id, "cls": r.arrival.cls, "path": r.path, "start_s": r.arrival.at_s,
            "prompt_tokens": r.arrival.prompt_tokens, "output_tokens": r.arrival.output_tokens,
            "ttft_s": float(times[0] - r.arrival.at_s) if times.size else None,
            "e2e_s": float(r.finish - r.arrival.at_s) if times.size else None,
            "itl_s": np.diff(times), "failed": r.failed,
        })
    return rows


def summarize(requests: Sequence[SimRequest], *, stall_ms: float, ttft_slo_ms: float, tpot_slo_ms: float) -> dict:
    rows = per_request_rows(requests)
    done = [row for row in rows if row["ttft_s"] is not None]
    summary: dict = {
        "source": "simulated",
        "requests": {"sent": len(rows), "completed": len(done), "failed": len(rows) - len(done)},
    }
    for cls in sorted({row["cls"] for row in rows} | {"short", "long"}):
        mine = [row for row in done if row["cls"] == cls]
        ttft = np.array([row["ttft_s"] for row in mine]) * 1e3
        e2e = np.array([row["e2e_s"] for row in mine]) * 1e3
        gaps = [row["itl_s"] for row in mine]
        itl = np.concatenate(gaps) * 1e3 if gaps else np.empty(0)
        tpot = np.array([(row["e2e_s"] - row["ttft_s"]) / (row["output_tokens"] - 1) * 1e3
                         for row in mine if row["output_tokens"] > 1])
        summary[cls] = {"count": len(mine), "ttft_ms": _stats(ttft), "itl_ms": _stats(itl),
                        "tpot_ms": _stats(tpot), "e2e_ms": _stats(e2e)}
    all_gaps = [row["itl_s"] for row in done]
    stalls = int(sum(int(np.count_nonzero(g * 1e3 > stall_ms)) for g in all_gaps))
    summary["stalls"] = {"count": stalls, "threshold_ms": stall_ms}
    good = 0
    for row in done:
        tpot_ms = (row["e2e_s"] - row["ttft_s"]) / max(row["output_tokens"] - 1, 1) * 1e3
        good += row["ttft_s"] * 1e3 <= ttft_slo_ms and tpot_ms <= tpot_slo_ms
    start = min((r.arrival.at_s for r in requests), default=0.0)
    end = max((r.finish for r in requests if not math.isnan(r.finish)), default=start)
    duration = max(end - start, 1e-9)
    summary["duration_s"] = end - start
    summary["goodput"] = {"slo": {"ttft_ms": ttft_slo_ms, "tpot_ms": tpot_slo_ms},
                          "attainment": good / len(rows) if rows else 0.0, "rps": good / duration}
    summary["throughput"] = {"rps": len(done) / duration,
                             "output_tokens_per_s": sum(row["output_tokens"] for row in done) / duration}
    summary["paths"] = {p: sum(1 for r in requests if r.path == p) for p in ("direct", "disaggregated")}
    summary["preemptions"] = sum(r.preemptions for r in requests)
    prompt = sum(r.arrival.prompt_tokens for r in requests)
    cached = sum(r.cached for r in requests)
    summary["prefix_cache"] = {"hit_tokens": cached, "prompt_tokens": prompt,
                               "hit_rate": cached / prompt if prompt else None}
    return summary
