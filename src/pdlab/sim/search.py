"""Goodput search (DistServe-style): which split of N GPUs into prefill and decode instances (or all colocated)
serves a load best under the SLOs."""

from __future__ import annotations

from pdlab.config.sim import SimSpec
from pdlab.model.catalog import Catalog, load_catalog
from pdlab.sim.scenario import prepare, simulate
from pdlab.sim.workload import arrivals


def splits(gpus: int, tensor_parallel: int) -> list[dict[str, int]]:
    """Every pool shape that uses the GPUs: all colocated, and each prefill:decode split of the instances."""
    n = gpus // tensor_parallel
    if n < 1:
        raise ValueError(f"{gpus} GPUs cannot hold one instance of {tensor_parallel} GPUs")
    shapes = [{"colocated": n}]
    shapes += [{"prefill": p, "decode": n - p} for p in range(1, n)]
    return shapes


def _with(spec: SimSpec, pools: dict[str, int], rate: float | None = None) -> SimSpec:
    data = spec.model_dump()
    data["pools"] = {"prefill": 0, "decode": 0, "colocated": 0, **pools}
    if rate is not None:
        if data["workload"]["poisson"] is None:
            raise ValueError("a rate search needs a `poisson` workload")
        data["workload"]["poisson"]["rate_rps"] = rate
    return SimSpec.model_validate(data)


def attainment(spec: SimSpec, pools: dict[str, int], rate: float | None = None,
               catalog: Catalog | None = None) -> dict:
    summary, _ = simulate(_with(spec, pools, rate), catalog=catalog)
    return {"pools": pools, "attainment": summary["goodput"]["attainment"], "goodput_rps": summary["goodput"]["rps"],
            "short_ttft_p99_ms": summary["short"]["ttft_ms"]["p99"],
            "long_ttft_p99_ms": summary["long"]["ttft_ms"]["p99"],
            "short_itl_p99_ms": summary["short"]["itl_ms"]["p99"]}


def max_rate(spec: SimSpec, pools: dict[str, int], *, target: float = 0.9, high: float = 64.0,
             iterations: int = 8, catalog: Catalog | None = None) -> float:
    """Highest Poisson rate at which at least `target` of requests meet both SLOs (bisection)."""
    low = 0.0
    while attainment(spec, pools, high, catalog)["attainment"] >= target and high < 1e5:
        low, high = high, high * 2
    for _ in range(iterations):
        mid = (low + high) / 2
        if attainment(spec, pools, mid, catalog)["attainment"] >= target:
            low = mid
        else:
            high = mid
    return low


def search(spec: SimSpec, gpus: int, *, find_rate: bool = False, target: float = 0.9) -> dict:
    """Score every split at the spec's load (and, with `find_rate`, its maximum rate meeting `target`)."""
    catalog = load_catalog()
    prepare(spec, catalog)  # fail early: unknown names, a model that does not fit
    rows = []
    for pools in splits(gpus, spec.engine.tensor_parallel):
        row = attainment(spec, pools, catalog=catalog)
        if find_rate:
            row["max_rate_rps"] = max_rate(spec, pools, target=target, catalog=catalog)
            row["max_rate_per_gpu"] = row["max_rate_rps"] / gpus
        rows.append(row)
    key = (lambda r: r["max_rate_rps"]) if find_rate else (lambda r: (r["attainment"], r["goodput_rps"]))
    best = max(rows, key=key)
    rate = spec.workload.poisson.rate_rps if spec.workload.poisson else None
    return {"gpus": gpus, "tensor_parallel": spec.engine.tensor_parallel, "rate_rps": rate,
            "slo": spec.slo.model_dump(), "target_attainment": target, "splits": rows, "best": best,
            "requests": len(arrivals(spec.workload))}
