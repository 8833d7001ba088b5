"""Router overhead, side by side in one run: a streaming client straight to a fast stand-in upstream ("direct"),
through the pdlab router, and through the Rust `vllm-router` (when installed), at concurrency 1 and 8.

Like is compared with like. `pdlab` and `vllm_router`: both routers in P/D mode (pdlab with threshold 0), every
request prefilled on one stand-in, then decoded on another (two upstream calls). `pdlab_direct_path` and
`vllm_router_direct_path`: one upstream call (pdlab with a threshold above the prompt; vllm-router in its regular
mode). "direct" sends the same request straight to the decode stand-in.
Stand-ins answer instantly (`--token-ms 0`), so what differs between targets is the router's cost.

With `profile=True` the pdlab router runs under cProfile (`PDLAB_ROUTER_PROFILE`): its stats are written beside the
result (`pdlab-router.prof`, readable with `python -m pstats` or snakeviz), and `profile_breakdown` adds where its
time went, per package and per function, in ms per request. The profiler slows the pdlab router, so a profiled
run's timings are not its overhead: `pdlab bench router --profile --record` files it under
data/results/router-profile/, never beside the overhead records.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pstats
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import psutil
import uvloop
from rich.console import Console

from pdlab.config.router import RouterSpec, RouterUpstreams
from pdlab.deploy.plan import port_in_use
from pdlab.deploy.process import ManagedProcess, serving
from pdlab.environment import capture
from pdlab.router.admin import RouterAdmin
from pdlab.router.process import router_command
from pdlab.settings import ADMIN_TOKEN_ENV, ROUTER_PROFILE_ENV

HOST = "127.0.0.1"
MODEL = "pdlab-tiny"
PROMPT = "The quick brown fox jumps over the lazy dog while the router counts every token of this prompt."
CONCURRENCIES = (1, 8)
#: Reference figures measured by hand on this machine kind (vllm-router against a stand-in), and pdlab's goal.
REFERENCE = {"vllm_router_added_p50_ms_at_c1": "2-2.5", "vllm_router_rps_ratio_at_c8": 0.71}
GOAL = {"pdlab_added_p50_ms_at_c1": "<= vllm_router's", "pdlab_router_cpu_ms_per_request": "<= vllm_router's",
        "pdlab_rps_ratio_at_c8": ">= 0.80"}


def vllm_router_executable() -> str | None:
    """The `vllm-router` console script: beside this Python first (a venv not on PATH), then on PATH."""
    beside = Path(sys.executable).with_name("vllm-router")
    return str(beside) if beside.exists() else shutil.which("vllm-router")


async def _load(url: str, concurrency: int, requests: int, warmup: int, max_tokens: int
                ) -> tuple[list[float], float]:
    """Closed-loop streaming load: `concurrency` workers, each sending its next request when the last ends.
    TTFB is from sending the request to the first body chunk (the first SSE event)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(base_url=url, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=30.0)) as client:

        async def one() -> float:
            started = time.perf_counter()
            async with client.post("/v1/completions", json=body) as response:
                if response.status != 200:
                    raise RuntimeError(f"{url}: HTTP {response.status}: {(await response.read())[:300]!r}")
                ttfb = None
                async for _ in response.content.iter_any():
                    if ttfb is None:
                        ttfb = time.perf_counter() - started
            return ttfb if ttfb is not None else time.perf_counter() - started

        async def phase(total: int) -> tuple[list[float], float]:
            remaining = [total]
            samples: list[float] = []

            async def worker() -> None:
                while remaining[0] > 0:
                    remaining[0] -= 1
                    samples.append(await one())

            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return samples, time.perf_counter() - started

        await phase(warmup)
        return await phase(requests)


def _measure(url: str, concurrency: int, requests: int, warmup: int, max_tokens: int) -> tuple[list[float], float]:
    """TTFB samples (s) of `requests` measured requests, and the seconds they took."""
    return uvloop.run(_load(url, concurrency, requests, warmup, max_tokens))


def _stats(samples: list[float], elapsed: float) -> dict[str, Any]:
    ttfb_ms = np.array(samples) * 1e3
    return {"ttfb_ms": {"p50": round(float(np.percentile(ttfb_ms, 50)), 3),
                        "p99": round(float(np.percentile(ttfb_ms, 99)), 3),
                        "mean": round(float(ttfb_ms.mean()), 3)},
            "rps": round(len(samples) / elapsed, 1), "requests": len(samples)}


def _cpu_seconds(proc: ManagedProcess | None) -> float:
    """User + system CPU time of a process: what the router costs per request, whatever the contention."""
    if proc is None:
        return 0.0
    times = psutil.Process(proc.pid).cpu_times()
    return times.user + times.system


#: Where a profiled router's time goes, by the file a function lives in (first match wins).
PROFILE_GROUPS = (("pdlab upstream client", "/pdlab/router/upstream.py"), ("pdlab router", "/pdlab/router/"),
                  ("pdlab other", "/pdlab/"), ("aiohttp (health checks)", "/aiohttp/"),
                  ("uvicorn + httptools (server)", "/uvicorn/"),
                  ("prometheus_client", "/prometheus_client/"), ("json", "/json/"), ("asyncio", "/asyncio/"),
                  ("C built-ins (socket writes, parsers)", "~"))
PROFILE_FILE = "pdlab-router.prof"


def profile_breakdown(stats_path: Path, requests: int, top: int = 15) -> dict[str, Any]:
    """A profiled router's own time (tottime, the event loop's idle wait left out) per package and its `top`
    functions, in ms per request."""
    stats = pstats.Stats(str(stats_path)).stats  # type: ignore[attr-defined]
    groups: dict[str, float] = {}
    rows = []
    for (file, line, func), (_, calls, own, _cum, _callers) in stats.items():
        if file.endswith("asyncio/runners.py") and func == "run":
            continue  # the loop's wait in epoll, charged to asyncio.run by cProfile: idle, not work
        group = next((name for name, part in PROFILE_GROUPS if part in file), "other")
        groups[group] = groups.get(group, 0.0) + own
        rows.append((own, calls, f"{Path(file).name}:{line}({func})" if file != "~" else func))
    rows.sort(reverse=True)
    per = 1e3 / max(requests, 1)
    return {"requests": requests, "ms_per_request_by_package": {
                name: round(t * per, 4) for name, t in sorted(groups.items(), key=lambda kv: -kv[1])},
            "ms_per_request_total": round(sum(groups.values()) * per, 4),
            "top_functions": [{"function": name, "calls_per_request": round(calls / max(requests, 1), 2),
                               "ms_per_request": round(own * per, 4)} for own, calls, name in rows[:top]]}


#: Loopback ports the benchmark uses, from --base-port on.
PORTS = 7


class PortsBusy(RuntimeError):
    """A port the benchmark needs is taken."""


def run_router_bench(out: Path, requests: int = 2000, warmup: int = 100, max_tokens: int = 4, base_port: int = 18500,
                     rounds: int = 5, console: Console | None = None, profile: bool = False) -> dict[str, Any]:
    """Start the stand-ins and routers, measure every target at each concurrency, write `out/router-overhead.json`.
    With `profile`, the pdlab router runs under cProfile and the result says where its time went (`profile`).
    Returns the result."""
    from pdlab.model import resolve

    console = console or Console(stderr=True)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = resolve(MODEL)
    prefill_port, decode_port, router_port, vr_port, vr_metrics_port, vr_direct_port, vr_direct_metrics_port = (
        base_port + i for i in range(PORTS))
    prefill_url, decode_url = f"http://{HOST}:{prefill_port}", f"http://{HOST}:{decode_port}"
    router_url, vr_url = f"http://{HOST}:{router_port}", f"http://{HOST}:{vr_port}"
    vr_direct_url = f"http://{HOST}:{vr_direct_port}"
    token = os.urandom(12).hex()
    standin = [sys.executable, "-m", "pdlab.benchmarks.standin", "--host", HOST, "--model", MODEL, "--token-ms", "0"]
    pdlab_argv = router_command(RouterSpec(port=router_port, threshold=0), RouterUpstreams(
        prefill=[prefill_url], decode=[decode_url], model=MODEL, tokenizer=tokenizer_dir)) + ["--log-level", "warning"]
    admin = RouterAdmin(router_url, token)
    vr_exe = vllm_router_executable()
    result: dict[str, Any] = {
        "benchmark": "router-overhead",
        "setup": {
            "upstream": "pdlab.benchmarks.standin --token-ms 0 (streams max_tokens SSE events at once)",
            "request": {"endpoint": "/v1/completions", "stream": True, "max_tokens": max_tokens,
                        "prompt_words": len(PROMPT.split())},
            "requests_per_point": requests, "warmup_per_point": warmup, "interleaved_rounds": rounds,
            "targets": {
                "direct": "client -> decode stand-in",
                "pdlab": "client -> pdlab router (threshold 0: prefill stand-in, then decode stand-in)",
                "pdlab_direct_path": "client -> pdlab router (threshold above the prompt: decode stand-in only)",
                "vllm_router": "client -> vllm-router --vllm-pd-disaggregation --kv-connector nixl --policy "
                               "round_robin (prefill stand-in, then decode stand-in)",
                "vllm_router_direct_path": "client -> vllm-router --worker-urls (regular mode): decode stand-in "
                                           "only",
            },
            "router_cpu_ms_per_request": "user+system CPU of the router process per request (contention-free cost)",
            "client": "aiohttp (uvloop), closed loop, in the benchmark process; everything shares this machine's cores",
        },
        "reference": REFERENCE,
        "goal": GOAL,
        "concurrency": {},
    }
    busy = [port for port in range(base_port, base_port + PORTS) if port_in_use(HOST, port)]
    if busy:  # else a server left from another run would answer the health checks and be measured
        raise PortsBusy(f"port{'s' * (len(busy) > 1)} {', '.join(map(str, busy))} on {HOST} already in use (another "
                        "`pdlab bench router` running?): stop what holds them, or pass --base-port")
    with contextlib.ExitStack() as stack:
        def serve(name: str, argv: list[str], health: str, log: str, env: dict[str, str] | None = None):
            return stack.enter_context(serving(name, argv, health, out / log, env))

        with console.status("starting stand-ins and routers ..."):
            procs = {
                "prefill": serve("standin-prefill", [*standin, "--port", str(prefill_port), "--name", "prefill-0"],
                                 f"{prefill_url}/health", "standin-prefill.log"),
                "decode": serve("standin-decode", [*standin, "--port", str(decode_port), "--name", "decode-0"],
                                f"{decode_url}/health", "standin-decode.log"),
                "pdlab": serve("pdlab-router", pdlab_argv, f"{router_url}/health", "pdlab-router.log",
                               {ADMIN_TOKEN_ENV: token,
                                **({ROUTER_PROFILE_ENV: str((out / PROFILE_FILE).resolve())} if profile else {})}),
            }
            if vr_exe:
                vr_argv = [vr_exe, "--vllm-pd-disaggregation", "--prefill", prefill_url, "--decode", decode_url,
                           "--kv-connector", "nixl", "--policy", "round_robin", "--host", HOST, "--port",
                           str(vr_port), "--prometheus-port", str(vr_metrics_port), "--log-level", "warning"]
                # Its regular (non-P/D) mode in front of the decode stand-in: the like-for-like peer of pdlab's
                # direct path.
                vr_direct_argv = [vr_exe, "--worker-urls", decode_url, "--policy", "round_robin", "--host", HOST,
                                  "--port", str(vr_direct_port), "--prometheus-port", str(vr_direct_metrics_port),
                                  "--log-level", "warning"]
                result["setup"]["vllm_router_argv"] = [Path(vr_argv[0]).name, *vr_argv[1:]]
                result["setup"]["vllm_router_direct_path_argv"] = [Path(vr_exe).name, *vr_direct_argv[1:]]
                procs["vllm_router"] = serve("vllm-router", vr_argv, f"{vr_url}/health", "vllm-router.log")
                procs["vllm_router_direct_path"] = serve("vllm-router-direct", vr_direct_argv,
                                                         f"{vr_direct_url}/health", "vllm-router-direct.log")
            else:
                result["setup"]["vllm_router"] = "not installed (pip install vllm-router): not measured"
        targets = {"direct": decode_url, "pdlab": router_url, "pdlab_direct_path": router_url}
        if vr_exe:
            targets["vllm_router"] = vr_url
            targets["vllm_router_direct_path"] = vr_direct_url
        for concurrency in CONCURRENCIES:
            # Interleaved rounds: every target gets a slice of each stretch of time, so a burst of load from
            # elsewhere on the machine does not land on one target only.
            samples: dict[str, list[float]] = {name: [] for name in targets}
            elapsed = dict.fromkeys(targets, 0.0)
            cpu = dict.fromkeys(targets, 0.0)
            per_round = max(1, requests // rounds)
            for round_no in range(rounds):
                for name, url in targets.items():
                    if name.startswith("pdlab"):
                        admin.update(threshold=1_000_000 if name == "pdlab_direct_path" else 0)
                    router_proc = procs.get("pdlab" if name.startswith("pdlab") else name)
                    with console.status(f"concurrency {concurrency}, round {round_no + 1}/{rounds}: {name} ..."):
                        cpu_before = _cpu_seconds(router_proc)
                        got, took = _measure(url, concurrency, per_round, warmup if round_no == 0 else 0,
                                             max_tokens)
                        cpu[name] += _cpu_seconds(router_proc) - cpu_before
                    samples[name] += got
                    elapsed[name] += took
            point: dict[str, Any] = {}
            for name in targets:
                point[name] = _stats(samples[name], elapsed[name])
                if name != "direct":  # includes the warm-up requests: divide by all of them
                    point[name]["router_cpu_ms_per_request"] = round(cpu[name] * 1e3 / (len(samples[name]) + warmup), 3)
                console.print(f"c={concurrency} {name:18s} ttfb p50 {point[name]['ttfb_ms']['p50']:7.3f} ms  "
                              f"p99 {point[name]['ttfb_ms']['p99']:7.3f} ms  {point[name]['rps']:8.1f} req/s")
            result["concurrency"][str(concurrency)] = point
    result["summary"] = _summary(result["concurrency"])
    if profile:  # the router has stopped and written its stats
        served = sum(point[name]["requests"] + warmup for point in result["concurrency"].values()
                     for name in ("pdlab", "pdlab_direct_path"))
        result["profile"] = {"stats": PROFILE_FILE, "note": "the pdlab router ran under cProfile: its timings here "
                             "are slowed by the profiler and are not its overhead",
                             **profile_breakdown(out / PROFILE_FILE, served)}
    result["environment"] = capture()
    text = json.dumps(result, indent=2) + "\n"
    (out / "router-overhead.json").write_text(text)
    console.print(json.dumps(result["summary"], indent=2))
    return result


def _summary(points: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Overhead relative to direct: added TTFB p50 at concurrency 1, throughput kept at concurrency 8."""
    summary: dict[str, Any] = {}
    c1, c8 = points.get("1", {}), points.get("8", {})
    for name in ("pdlab", "vllm_router", "pdlab_direct_path", "vllm_router_direct_path"):
        entry: dict[str, Any] = {}
        if name in c1 and "direct" in c1:
            entry["added_ttfb_p50_ms_at_c1"] = round(c1[name]["ttfb_ms"]["p50"] - c1["direct"]["ttfb_ms"]["p50"], 3)
        if name in c8 and "direct" in c8:
            entry["rps_ratio_at_c8"] = round(c8[name]["rps"] / c8["direct"]["rps"], 3)
        if entry:
            summary[name] = entry
    return summary
