"""`pdlab run LAB.yaml`: bring up each scenario's deployment in turn on the same cores, send the lab's workload,
and write one run directory (see pdlab.experiment.runner) with a summary and a report.

    run_dir = run_lab(load_lab("labs/hol-blocking.yaml"))
"""

from __future__ import annotations

import datetime as dt
import itertools
import os
import shutil
import signal
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
from rich.console import Console

from pdlab.config.lab import EventSpec, LabSpec
from pdlab.config.workload import MixedWorkload
from pdlab.deploy import Deployment
from pdlab.experiment.runner import ExperimentRun
from pdlab.load import rundir
from pdlab.load.prompts import PromptBuilder
from pdlab.report.figures import sweep_figure
from pdlab.router.admin import AdminError, RouterAdmin
from pdlab.settings import data_dir


class LabError(RuntimeError):
    """A lab that cannot run as specified."""


def quick_workload(lab: LabSpec, duration_s: float | None = None) -> Any:
    """The lab's workload shortened for a quick run (tests, notebooks in CI): same rates and shapes, cut at
    `duration_s` if given, else at the lab's `quick_requests` requests or `quick_duration_s` seconds."""
    if lab.workload is None:
        raise LabError(f"lab {lab.name!r} has no `workload` to run")
    if duration_s is None and lab.experiment.quick_requests is not None:
        return lab.workload.model_copy(update={"duration_s": None, "num_requests": lab.experiment.quick_requests})
    duration = duration_s or lab.experiment.quick_duration_s
    return lab.workload.model_copy(update={"duration_s": duration, "num_requests": None})


#: Lone long prefills timed to size a `prefill_load` workload (the median is kept).
SIZING_PREFILLS = 3


def size_workload(workload: MixedWorkload, url: str, model: str, model_dir: str | Path,
                  console: Console | None = None) -> MixedWorkload:
    """`workload` with its rate set from this machine's speed: time SIZING_PREFILLS lone prefills of each long
    length (one at a time, a one-token answer, distinct prompts so no cache answers) at `url`, an instance that
    prefills (colocated, or a NIXL prefill instance), and size the load with the median of each."""
    builder = PromptBuilder(model_dir)
    lengths = workload.long_lengths()
    medians: dict[int, float] = {}
    status = (console or Console(stderr=True)).status(
        f"sizing the load: timing {SIZING_PREFILLS} lone prefills of "
        f"{' and '.join(f'{n:,}' for n in lengths)} tokens on this machine")
    with status, httpx.Client(timeout=300) as client:
        for tokens in lengths:
            times = []
            for i in range(SIZING_PREFILLS):
                prompt = builder.prompt(tokens, key=f"{workload.seed}/sizing/{tokens}/{i}")
                started = time.perf_counter()
                response = client.post(url + "/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True})
                if response.status_code != 200:
                    raise LabError(f"sizing the load: {url} answered HTTP {response.status_code}: "
                                   f"{response.text[:300]}")
                times.append(time.perf_counter() - started)
            medians[tokens] = statistics.median(times)
    sized = workload.sized(workload.mean_prefill_s(medians))
    if console is not None:
        each = ", ".join(f"{n:,} tokens {s:.2f} s" for n, s in medians.items())
        console.print(f"load sized for this machine: a lone long prefill takes {sized.prefill_s:.2f} s on average "
                      f"({each}), so {workload.prefill_load:.0%} prefill load is "
                      f"{sized.rate * workload.long_fraction:.2f} long prompts/s ({sized.rate:.2f} requests/s in all)")
    return sized


def _sizing_url(dep: Deployment) -> str:
    """An instance that prefills and takes a plain request: colocated first, else a NIXL prefill instance, else
    an LMCache decode instance (an LMCache sender must not get a plain request; the receiver prefills on a core of
    its own as the sender does, and serves short prompts plainly anyway)."""
    if dep.urls("colocated"):
        return dep.urls("colocated")[0]
    if dep.spec.connector.kind == "lmcache":
        return dep.urls("decode")[0]
    return dep.urls("prefill")[0]


def set_router(dep: Deployment, **settings: Any) -> dict:
    """Change live router settings through its admin API; returns the config it now runs with (no settings: reads
    it)."""
    if dep.router_url is None:
        raise LabError("this deployment has no router to configure")
    try:
        return RouterAdmin(dep.router_url, dep.admin_token).update(**settings)
    except AdminError as error:
        raise LabError(str(error)) from None


class Drills:
    """A scenario's events, each fired at its time on a thread of its own while the load runs; `finish` waits for
    those still running (a restart outlasts a short load) and cancels those not yet due."""

    def __init__(self, dep: Deployment, scenario: str, events: list[EventSpec], console: Console):
        self.dep, self.scenario, self.console = dep, scenario, console
        names = {inst.name for inst in dep.instances}
        self.events = [e for e in events if e.instance in names and (not e.scenarios or scenario in e.scenarios)]
        self.failures: list[str] = []
        self._timers: list[threading.Timer] = []

    def fire(self, event: EventSpec) -> None:
        self.console.print(f"[yellow]{self.scenario}: t={event.at_s:g}s: {event.action} {event.instance}[/yellow]")
        try:
            if event.action == "restart":
                self.dep.restart(event.instance)
                self.console.print(f"[yellow]{self.scenario}: {event.instance} is back[/yellow]")
            else:
                process = self.dep.instance(event.instance).process
                if event.action == "kill_leader":
                    os.kill(process.pid, signal.SIGKILL)
                else:
                    process.kill()
        except Exception as error:  # a drill that failed is reported, and the run goes on
            self.failures.append(f"{event.action} {event.instance}: {type(error).__name__}: {error}")

    def start(self) -> None:
        for event in self.events:
            timer = threading.Timer(event.at_s, self.fire, args=(event,))
            timer.daemon = True
            self._timers.append(timer)
            timer.start()

    def finish(self) -> None:
        for timer in self._timers:
            timer.cancel()  # those not yet due never fire; those firing now finish
        for timer in self._timers:
            timer.join()
        if self.failures:
            raise LabError(f"{self.scenario}: drill(s) failed: {'; '.join(self.failures)}")


def _measure(run: ExperimentRun, name: str, dep: Deployment, events: list[EventSpec], console: Console,
             baseline: bool = False) -> None:
    drills = Drills(dep, name, [] if baseline else events, console)
    drills.start()
    try:
        run.measure_deployment(name, dep, baseline=baseline)
    finally:
        drills.finish()


def _scaled_events(lab: LabSpec, workload: Any) -> list[EventSpec]:
    """The lab's events, their times scaled to a shortened (quick) load, so a drill still happens inside it."""
    full = getattr(lab.workload, "duration_s", None)
    now = getattr(workload, "duration_s", None)
    if not full or not now or now >= full:
        return list(lab.experiment.events)
    return [event.model_copy(update={"at_s": event.at_s * now / full}) for event in lab.experiment.events]


def run_lab(lab: LabSpec, *, quick: bool = False, duration_s: float | None = None,
            runs_root: str | Path | None = None, run_dir: Path | None = None, progress: bool = True,
            console: Console | None = None, only: list[str] | None = None, stand_ins: bool = False) -> Path:
    """Run every scenario of `lab` (or those in `only`) and return the run directory. Interrupted runs keep what
    they measured, marked incomplete. `stand_ins`: stand-in servers in place of vLLM (pdlab.benchmarks.standin),
    for a quick drill of the router, the launcher and the load (e.g. the fault drills), not for measurements of
    serving."""
    console = console or Console(stderr=True)
    if not lab.scenarios:
        raise LabError(f"lab {lab.name!r} has no `scenarios` to measure (`pdlab up` it instead)")
    try:
        points = lab.points(only or ())
    except ValueError as error:
        raise LabError(str(error)) from None
    workload = quick_workload(lab, duration_s) if quick or duration_s else lab.workload
    if workload is None:
        raise LabError(f"lab {lab.name!r} has no `workload` to run")
    exp = lab.experiment
    events = _scaled_events(lab, workload)
    sweep_rows: list[dict] = []
    figures = []
    run = ExperimentRun(lab.name, workload, runs_root=runs_root, run_dir=run_dir, stall_k=exp.stall_k,
                        progress=progress)
    complete = False
    try:
        for name, group in itertools.groupby(points, key=lambda point: point.scenario):
            console.rule(f"{lab.name}: {name}")
            with Deployment(lab.scenarios[name], run_dir=run.dir / name / "deployment", progress=progress,
                            console=console, stand_ins=stand_ins) as dep:
                if isinstance(run.workload, MixedWorkload) and run.workload.needs_sizing:
                    run.set_workload(size_workload(run.workload, _sizing_url(dep), dep.served_model, dep.model_dir,
                                                   console))
                for point in group:
                    if point.router:  # a sweep's value, set live
                        set_router(dep, **point.router)
                    _measure(run, point.name, dep, events, console, baseline=point.baseline)
                    if point.router:
                        figures_now = run.summary()["scenarios"][point.name]
                        sweep_rows.append({"scenario": name, **point.router, **_headline(figures_now)})
        complete = True
    finally:
        if sweep_rows:
            frame = pd.DataFrame(sweep_rows)
            frame.to_csv(run.dir / rundir.SWEEP, index=False)
            setting = exp.sweep.setting if exp.sweep else "threshold"
            figures = [(f"Sweep of {setting}: {label}", sweep_figure(frame, x=setting, y=column))
                       for label, column in (("short-request ITL p99", "short_itl_p99_ms"),
                                             ("short-request TTFT p99", "short_ttft_p99_ms"),
                                             ("long-prompt TTFT p99", "long_ttft_p99_ms"))]
        run.finish(complete, figures)
    return run.dir


def run_at_url(lab: LabSpec, url: str, *, model: str, model_dir: str | Path, scenario: str = "endpoint",
               quick: bool = False, duration_s: float | None = None, runs_root: str | Path | None = None,
               run_dir: Path | None = None, progress: bool = True) -> Path:
    """Send `lab`'s workload to an endpoint that is already serving (a cluster's router, a deployment started
    elsewhere) instead of deploying the lab's scenarios; one scenario, named `scenario`, in a fresh run directory
    with the same summary and report as a local run. `model` is the served model's name, `model_dir` a directory
    with its tokenizer (prompts are built to exact token counts)."""
    workload = quick_workload(lab, duration_s) if quick or duration_s else lab.workload
    if workload is None:
        raise LabError(f"lab {lab.name!r} has no `workload` to send")
    run = ExperimentRun(lab.name, workload, runs_root=runs_root, run_dir=run_dir, stall_k=lab.experiment.stall_k,
                        progress=progress)
    complete = False
    try:
        if isinstance(workload, MixedWorkload) and workload.needs_sizing:
            # The endpoint's own first-token time for a lone long prompt (through its router, whatever path it takes).
            run.set_workload(size_workload(workload, url.rstrip("/"), model, model_dir, Console(stderr=True)))
        run.measure(scenario, url, model=model, model_dir=model_dir)
        complete = True
    finally:
        run.finish(complete, [])
    return run.dir


RECORDED_FILES = (rundir.SUMMARY, rundir.ENVIRONMENT, rundir.WORKLOAD, rundir.SWEEP)


def record_run(run_dir: Path) -> Path:
    """Copy a run's summary, environment and workload to data/results/<lab>/<timestamp>/ (when the run started,
    wherever it ran: `--out DIR` names the run, not the record), for readers without the time or the hardware to
    run it (raw rows and the report stay in runs/). Never overwrites a recorded run."""
    summary = rundir.read_summary(run_dir)
    started = dt.datetime.fromisoformat(summary["started"]).astimezone() if summary.get("started") else None
    target = rundir.new_run_dir(summary["lab"], data_dir() / "results", when=started)
    for name in RECORDED_FILES:
        if (run_dir / name).exists():
            shutil.copyfile(run_dir / name, target / name)
    return target


def _headline(scenario: dict) -> dict[str, float | None]:
    def get(*path: str) -> float | None:
        node: Any = scenario
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        return node

    return {"short_itl_p50_ms": get("short", "itl_ms", "p50"), "short_itl_p99_ms": get("short", "itl_ms", "p99"),
            "short_ttft_p99_ms": get("short", "ttft_ms", "p99"), "long_ttft_p50_ms": get("long", "ttft_ms", "p50"),
            "long_ttft_p99_ms": get("long", "ttft_ms", "p99"), "stalls": get("stalls", "count")}
