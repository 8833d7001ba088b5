"""`pdlab bench push-pull`: LMCache's push against NIXL's pull (labs/kv-push-vs-pull.yaml), side by side in one run.

Each of the lab's scenarios (the same prefill and decode instances and router, with a different KV connector) is
deployed in turn on the same cores and measured twice:
- probes: a long prompt through the router, alone (`idle`) and with a longer prompt sent straight to the prefill
  instance right behind it (`prefill-busy`: the prefill instance computes that one while the probe's KV moves). Per
  probe: its time to first token, the router's prefill time (its `x-pdlab-prefill-ms`), their difference (`after
  prefill`: the KV's move, the decode instance's queue and its first step) and, under LMCache, how long the router
  waited after prefill's answer for the push report (`x-pdlab-kv-wait-ms`);
- load: the lab's workload through the router (pdlab.experiment.runner, one run directory for both scenarios):
  long prompts' TTFT and after-prefill time, short requests' TTFT and inter-token latency, and each connector's own
  transfer figures (NIXL's read time; the tokens vLLM took from LMCache).
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
from rich.console import Console

from pdlab.benchmarks import results
from pdlab.benchmarks.prefill import ProbeError, random_prompt
from pdlab.config.lab import LabSpec
from pdlab.deploy import Deployment
from pdlab.experiment.runner import ExperimentRun
from pdlab.settings import KV_WAIT_MS_HEADER, PREFILL_MS_HEADER

CONDITIONS = ("idle", "prefill-busy")
#: How long after the probe the busy prompt follows (the probe is then ahead of it on the prefill instance).
BUSY_AFTER_S = 0.1
VOCAB = 1000


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "p90": None, "max": None, "count": 0}
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "max": ordered[-1], "count": len(ordered)}


def probe_once(client: httpx.Client, dep: Deployment, prompt: list[int], busy: list[int] | None) -> dict[str, Any]:
    """One probe through the router (streamed, timed at its first token), with `busy` sent straight to the prefill
    instance BUSY_AFTER_S later. (Under LMCache that is a plain request to a sender: pdlab's connector serves it
    without pushing, pdlab.lmcache.connector point 5; only this probe sends one.)"""
    background: list[threading.Thread] = []
    if busy is not None:
        def send_busy() -> None:
            time.sleep(BUSY_AFTER_S)
            client.post(dep.urls("prefill")[0] + "/v1/completions", json={
                "model": dep.served_model, "prompt": busy, "max_tokens": 1})
        background.append(threading.Thread(target=send_busy, daemon=True))
        background[0].start()
    body = {"model": dep.served_model, "prompt": prompt, "max_tokens": 2, "ignore_eos": True, "stream": True}
    began = time.perf_counter()
    first = None
    assert dep.router_url is not None
    with client.stream("POST", dep.router_url + "/v1/completions", json=body) as response:
        if response.is_error:
            response.read()
            raise ProbeError(f"the router refused the probe: {response.status_code} {response.text[:300]}")
        for line in response.iter_lines():
            if first is None and line.startswith("data:") and line.strip() != "data: [DONE]":
                first = time.perf_counter() - began
        headers = response.headers
    for thread in background:
        thread.join()
    if first is None:
        raise ProbeError("the router streamed no token for the probe")
    prefill_ms = float(headers[PREFILL_MS_HEADER]) if PREFILL_MS_HEADER in headers else None
    return {"ttft_ms": first * 1e3, "prefill_ms": prefill_ms,
            "after_prefill_ms": first * 1e3 - prefill_ms if prefill_ms is not None else None,
            "push_wait_ms": float(headers[KV_WAIT_MS_HEADER]) if KV_WAIT_MS_HEADER in headers else None}


def probes(dep: Deployment, *, prompt_tokens: int, busy_tokens: int, repeats: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    out: dict[str, Any] = {}
    with httpx.Client(timeout=300) as client:
        for condition in CONDITIONS:
            trials = []
            for _ in range(repeats):
                busy = random_prompt(rng, busy_tokens, VOCAB) if condition == "prefill-busy" else None
                trials.append(probe_once(client, dep, random_prompt(rng, prompt_tokens, VOCAB), busy))
                time.sleep(0.5)
            out[condition] = {"trials": trials, **{
                field: _percentiles([t[field] for t in trials if t[field] is not None])
                for field in ("ttft_ms", "after_prefill_ms", "push_wait_ms")}}
    return out


def load_figures(rows: pd.DataFrame, summary: dict[str, Any], kv: dict[str, Any]) -> dict[str, Any]:
    """The load's headline figures for one scenario, from its rows, its summary block and its KV figures."""
    long = rows[(rows["cls"] == "long") & (rows["status"] == "ok")]
    after = [float(t[0]) * 1e3 - p for t, p in zip(long["token_times"], long["prefill_ms"], strict=True)
             if len(t) and p == p]  # p == p: not NaN (a request served directly has no prefill time)

    def get(*path: str) -> float | None:
        node: Any = summary
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        return node

    return {"requests": get("requests"),
            "long_ttft_ms": {"p50": get("long", "ttft_ms", "p50"), "p99": get("long", "ttft_ms", "p99")},
            "long_after_prefill_ms": _percentiles(after),
            "short_ttft_ms": {"p50": get("short", "ttft_ms", "p50"), "p99": get("short", "ttft_ms", "p99")},
            "short_itl_ms": {"p50": get("short", "itl_ms", "p50"), "p99": get("short", "itl_ms", "p99"),
                             "max": get("short", "itl_ms", "max")},
            "stalls": get("stalls", "count"),
            "kv": {key: kv.get(key) for key in ("transfers", "mean_xfer_ms", "post_seconds", "connector_hit_tokens",
                                                "preemptions")}}


def run(lab: LabSpec, *, prompt_tokens: int, busy_tokens: int, repeats: int, duration_s: float | None,
        out: Path | None, console: Console, progress: bool = True) -> dict[str, Any]:
    """Measure every scenario of `lab` (probes, then the load) and write the comparison; returns it with `path`
    (the JSON) and `run_dir` (the load's run directory)."""
    results.ensure_new(out)
    if lab.workload is None:
        raise ProbeError(f"lab {lab.name!r} has no workload")
    workload = lab.workload if duration_s is None else lab.workload.model_copy(
        update={"duration_s": duration_s, "num_requests": None})
    scenarios: dict[str, Any] = {}
    run_ = ExperimentRun(lab.name, workload, progress=progress)
    complete = False
    try:
        for name, spec in lab.scenarios.items():
            console.rule(f"{lab.name}: {name} ({spec.connector.kind})")
            with Deployment(spec, run_dir=run_.dir / name / "deployment", progress=progress, console=console) as dep:
                if not dep.router_url or not dep.urls("prefill"):
                    raise ProbeError(f"scenario {name!r} is not a P/D deployment with a router")
                console.print(f"{name}: probes ({repeats} per condition)")
                probed = probes(dep, prompt_tokens=prompt_tokens, busy_tokens=busy_tokens, repeats=repeats,
                                seed=lab.seed)
                console.print(f"{name}: the lab's load")
                rows = run_.measure_deployment(name, dep)
            summary = run_.summary()
            scenarios[name] = {"connector": spec.connector.kind, "probes": probed,
                               "load": load_figures(rows, summary["scenarios"][name], run_.kv.get(name, {}))}
        complete = True
    finally:
        run_.finish(complete)
    names = list(scenarios)
    result: dict[str, Any] = {"lab": lab.name, "prompt_tokens": prompt_tokens, "busy_tokens": busy_tokens,
                              "repeats": repeats, "run_dir": str(run_.dir), "scenarios": scenarios}
    if {"nixl", "lmcache"} <= set(names):
        result["lmcache_over_nixl"] = ratios(scenarios["lmcache"], scenarios["nixl"])
    path = results.write("push-pull", result, out)
    return {**result, "path": str(path)}


def ratios(lmcache: dict[str, Any], nixl: dict[str, Any]) -> dict[str, float | None]:
    """LMCache's figure over NIXL's, for the headline figures (below 1: LMCache's is lower)."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    out = {}
    for condition in CONDITIONS:
        for field in ("ttft_ms", "after_prefill_ms"):
            out[f"probe_{condition}_{field}_median"] = ratio(lmcache["probes"][condition][field]["median"],
                                                             nixl["probes"][condition][field]["median"])
    for label, path in (("long_ttft_p50", ("long_ttft_ms", "p50")), ("long_ttft_p99", ("long_ttft_ms", "p99")),
                        ("long_after_prefill_median", ("long_after_prefill_ms", "median")),
                        ("short_ttft_p99", ("short_ttft_ms", "p99")), ("short_itl_p99", ("short_itl_ms", "p99"))):
        out[label] = ratio(lmcache["load"][path[0]][path[1]], nixl["load"][path[0]][path[1]])
    return out
