"""Running a workload against one or more deployments and writing a run directory (its layout:
pdlab.load.rundir): the environment and workload first, each scenario's schedule, rows and KV figures as it is
measured, summary.json (pdlab.metrics.build_summary) after each, and the report at the end.

A run directory is never reused: each run gets a fresh timestamped one. `summary.json` says `"complete": false`
from the moment the directory exists until every scenario has finished, so a run that was interrupted or
crashed is marked as such, and still summarises what it measured.

    with ExperimentRun("hol-blocking", workload) as run:
        for name, spec in lab.scenarios.items():
            with Deployment(spec, run.dir / name) as dep:
                run.measure_deployment(name, dep)
                if name == "colocated":
                    run.measure_deployment("baseline", dep, baseline=True)
"""

from __future__ import annotations

import datetime as dt
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import pandas as pd
import plotly.graph_objects as go
from pydantic import TypeAdapter
from rich.console import Console

from pdlab.config.lab import BASELINE
from pdlab.config.workload import WorkloadSpec
from pdlab.environment import capture
from pdlab.lmcache import figures as lmcache_figures
from pdlab.load import rundir
from pdlab.load.prompts import PromptBuilder
from pdlab.load.rows import read_rows
from pdlab.load.run import run_load
from pdlab.load.schedule import Workload, build_schedule, write_schedule
from pdlab.metrics.kv import KVTransferStats, scrape_kv_transfer
from pdlab.metrics.latency import DEFAULT_STALL_K, completed
from pdlab.metrics.summary import build_summary
from pdlab.report.html import write_report


class DeploymentLike(Protocol):
    """What the runner needs from a `pdlab.deploy.Deployment`."""

    router_url: str | None
    served_model: str
    model_dir: Path
    instances: Sequence[Any]
    """Its instances (`pdlab.deploy.launcher.RunningInstance`: spec, log_path, lmcache)."""
    stand_ins: bool

    def urls(self, role: str) -> list[str]: ...


def _pd_prompts(rows: pd.DataFrame) -> dict[str, int]:
    """The completed requests the router sent through prefill -> decode: request id -> prompt tokens."""
    done = completed(rows)
    done = done[done["path"] == "disaggregated"]
    return {str(rid): int(tokens) for rid, tokens in zip(done["request_id"], done["prompt_tokens"], strict=True)}


def _scrape_or_none(url: str) -> KVTransferStats | None:
    try:
        return scrape_kv_transfer(url)
    except httpx.HTTPError:
        return None


class ExperimentRun:
    """One run directory: measure scenarios into it, then close it with a summary and a report.

    Use it as a context manager; leaving the block normally marks the run complete, leaving it by an
    exception (Ctrl-C included) marks it incomplete and re-raises."""

    def __init__(self, lab: str, workload: Workload, *, runs_root: str | Path | None = None,
                 run_dir: Path | None = None, stall_k: float = DEFAULT_STALL_K, progress: bool = True):
        self.lab = lab
        self.workload = workload
        self.stall_k = stall_k
        self.progress = progress
        self.dir = rundir.new_run_dir(lab, runs_root) if run_dir is None else rundir.fresh_run_dir(Path(run_dir))
        self.started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        self.scheduled: dict[str, int] = {}
        self.kv: dict[str, dict] = {}
        self.complete = False
        self._builders: dict[str, PromptBuilder] = {}
        rundir.write_json(self.dir / rundir.ENVIRONMENT, capture())
        self.set_workload(workload)

    def set_workload(self, workload: Workload) -> None:
        """The workload every scenario gets from now on (e.g. once a `prefill_load` workload is sized), saved as
        workload.json; refused once a scenario has been measured, so that all scenarios see the same load."""
        if self.scheduled:
            raise ValueError("the run's workload cannot change after a scenario was measured")
        self.workload = workload
        rundir.write_json(self.dir / rundir.WORKLOAD, TypeAdapter(WorkloadSpec).dump_python(workload, mode="json"))
        self.write_summary()

    def __enter__(self) -> ExperimentRun:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.finish(complete=exc_type is None)

    def measure(self, scenario: str, base_url: str, *, model: str, model_dir: str | Path, baseline: bool = False,
                kv_urls: Sequence[str] = (), workload: Workload | None = None, stop: threading.Event | None = None,
                on_progress: Callable[[int, int], None] | None = None,
                lmcache_logs: Mapping[str, Sequence[Path]] | None = None) -> pd.DataFrame:
        """Send the workload at `base_url` (router or instance) and record it as `scenario`. With `baseline`,
        long requests are left out of the same schedule (short and probe requests keep their times): the
        short requests alone, for comparison. `kv_urls` are instances whose NIXL figures are scraped before and
        after. `workload` replaces the run's workload for this scenario (e.g. one rate of a sweep; it is saved
        as `<scenario>/workload.json`). `stop` and `on_progress` go to `run_load` (a widget's Cancel button and
        progress bar). `lmcache_logs`: an LMCache P/D deployment's instance logs by role (`prefill`: senders,
        `decode`: receivers); what LMCache pushed and loaded for the load's P/D requests goes into the scenario's
        KV figures (`lmcache`). Returns the raw rows."""
        if scenario in self.scheduled:
            raise ValueError(f"scenario {scenario!r} was already measured in this run")
        out = self.dir / scenario
        out.mkdir(exist_ok=True)  # a Deployment may already keep its logs there
        if workload is not None:
            rundir.write_json(out / rundir.WORKLOAD, TypeAdapter(WorkloadSpec).dump_python(workload, mode="json"))
        workload = workload or self.workload
        with Console(stderr=True, quiet=not self.progress).status(f"{scenario}: building the schedule"):
            schedule = build_schedule(workload, self.builder(model_dir))
        if baseline:
            schedule = [item for item in schedule if item.cls != "long"]
        self.scheduled[scenario] = len(schedule)
        schedule_path = write_schedule(schedule, out / rundir.SCHEDULE)
        before = {url: _scrape_or_none(url) for url in kv_urls}
        log_ends = {role: {path: lmcache_figures.log_end(path) for path in paths}
                    for role, paths in (lmcache_logs or {}).items()}
        result = run_load(base_url, schedule_path, out, model, api=workload.api, users=workload.users,
                          timeout_s=workload.timeout_s, progress=self.progress, label=scenario, stop=stop,
                          on_progress=on_progress)
        rows = read_rows(result.rows_path)
        if kv_urls:
            after = {url: _scrape_or_none(url) for url in kv_urls}
            # An instance that is gone (a failure drill) has no figures to give; count the ones still up.
            counted = [url for url in kv_urls if before[url] is not None and after[url] is not None]
            moved = sum((after[url] - before[url] for url in counted), KVTransferStats())  # type: ignore[operator]
            self.kv[scenario] = {"instances": counted, "unreachable": sorted(set(kv_urls) - set(counted)),
                                 **moved.as_dict()}
            if log_ends:
                self.kv[scenario]["lmcache"] = lmcache_figures.pd_account(
                    _pd_prompts(rows), log_ends.get("prefill", {}), log_ends.get("decode", {}))
            rundir.write_json(out / rundir.KV, self.kv[scenario])
        self.write_summary()
        return rows

    def measure_deployment(self, scenario: str, deployment: DeploymentLike, *, baseline: bool = False) -> pd.DataFrame:
        """`measure` against a running `pdlab.deploy.Deployment`: through its router when it has one, else its
        first instance; KV figures (NIXL's, and preemptions) from every instance."""
        target = deployment.router_url or next(
            iter(deployment.urls("colocated") + deployment.urls("decode") + deployment.urls("prefill")), None)
        if target is None:
            raise ValueError(f"deployment for {scenario!r} has no router and no instance to send to")
        kv_urls = deployment.urls("decode") + deployment.urls("prefill") + deployment.urls("colocated")
        lmcache_logs: dict[str, list[Path]] = {}
        for inst in [] if deployment.stand_ins else deployment.instances:  # stand-ins log no LMCache lines
            if inst.lmcache is not None:
                lmcache_logs.setdefault(inst.spec.role, []).append(inst.log_path)
        rows = self.measure(scenario, target, model=deployment.served_model, model_dir=deployment.model_dir,
                            baseline=baseline, kv_urls=kv_urls, lmcache_logs=lmcache_logs)
        source = Path(getattr(deployment, "run_dir", "")) / rundir.DEPLOYMENT.name
        if baseline and source.is_file():
            # The baseline borrows another scenario's deployment: say which, as every scenario does (the simulator's
            # validation replays a run on the deployment it ran on).
            target = self.dir / scenario / rundir.DEPLOYMENT
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
        return rows

    def builder(self, model_dir: str | Path) -> PromptBuilder:
        key = str(model_dir)
        if key not in self._builders:
            self._builders[key] = PromptBuilder(model_dir)
        return self._builders[key]

    def summary(self) -> dict:
        """summary.json's content from whatever rows exist now."""
        rows = {name: read_rows(self.dir / name / rundir.ROWS) for name in self.scheduled
                if (self.dir / name / rundir.ROWS).exists()}
        scenarios = {name: frame for name, frame in rows.items() if name != BASELINE}
        figures = build_summary(scenarios, rows.get(BASELINE), self.stall_k, self.scheduled)
        for name in self.scheduled:  # a scenario stopped before its first row still shows its counts
            if name not in rows and name != BASELINE:
                figures["scenarios"][name] = {"requests": {"scheduled": self.scheduled[name], "sent": 0,
                                                           "completed": 0, "failed": 0,
                                                           "not_sent": self.scheduled[name]}}
        return {"lab": self.lab, "started": self.started, "complete": self.complete,
                "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds") if self.complete else None,
                **figures, "kv_transfer": self.kv}

    def write_summary(self) -> Path:
        return rundir.write_json(self.dir / rundir.SUMMARY, self.summary())

    def finish(self, complete: bool, figures: list[tuple[str, go.Figure]] | None = None) -> Path:
        """Write the final summary (`complete` as given) and the report (plus `figures`); returns the run
        directory."""
        self.complete = complete
        self.write_summary()
        write_report(self.dir, figures)
        return self.dir


@dataclass(frozen=True)
class RunData:
    """A run directory read back (for notebooks): its summary, environment and each scenario's raw rows."""

    dir: Path
    summary: dict
    environment: dict
    rows: dict[str, pd.DataFrame]
    """Scenario name (and `baseline`) -> raw rows."""


def read_run(run_dir: str | Path) -> RunData:
    """Read a run directory written by ExperimentRun."""
    run_dir = Path(run_dir)
    summary = rundir.read_summary(run_dir)
    return RunData(run_dir, summary, rundir.read_environment(run_dir), rundir.point_rows(run_dir, summary))


def run_workload(base_url: str, workload: Workload, *, model: str, model_dir: str | Path, lab: str = "adhoc",
                 scenario: str = "default", baseline: bool = False, runs_root: str | Path | None = None,
                 stall_k: float = DEFAULT_STALL_K, progress: bool = True) -> Path:
    """One scenario in a fresh run directory (and, with `baseline`, the short requests alone right after, at
    the same URL). Returns the run directory."""
    with ExperimentRun(lab, workload, runs_root=runs_root, stall_k=stall_k, progress=progress) as run:
        run.measure(scenario, base_url, model=model, model_dir=model_dir)
        if baseline:
            run.measure(BASELINE, base_url, model=model, model_dir=model_dir, baseline=True)
    return run.dir
