"""The notebooks' widget panels: each control moves one knob and the panel shows what it moved.

- `RouterPanel` (notebook 04): the LIVE router's threshold (and the load's rate and long share) on a P/D deployment;
  every change applies the setting through `PUT /admin/config`, runs a short load and adds a point per run;
- `StrategyPanel` (notebook 04): the LIVE router's replica choice on a deployment with two replicas and prefix
  caching, under a shared-prefix trace: prefix-cache hit rate and TTFT per strategy;
- `SimPanel` (notebook 07): the simulator on a cluster-scale scenario, re-simulated on every change, the previous
  setting shown beside the current one.

A live panel's run goes on off the kernel's main thread (`BackgroundRun`), so its progress bar moves and its Cancel
button works while the load runs; `wait()` blocks until the runs asked for are done (code cells and tests call it
after setting a control, as a slider release would). Points are only drawn against the knob that made them: the
router panel starts a new series when the load changes, the strategy panel puts strategies on their own axis.

    panel = RouterPanel(dep, base_workload, measure)
    panel.threshold.value = 2048      # what a slider release does: apply, run a load, draw (in the background)
    panel.wait()
    panel.history[-1]                 # what that run measured
"""

from __future__ import annotations

import html
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import ipywidgets as widgets
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from pdlab.config.base import ConfigError
from pdlab.config.sim import Pools, SimSpec
from pdlab.config.workload import MixedWorkload, TraceWorkload
from pdlab.deploy import Deployment
from pdlab.experiment.lab import set_router
from pdlab.metrics.kv import KVTransferStats, scrape_kv_transfer
from pdlab.metrics.summary import scenario_summary
from pdlab.model.catalog import Catalog, load_catalog
from pdlab.router.strategies import STRATEGIES
from pdlab.sim.scenario import simulate
from pdlab.sim.worth import worth

T = TypeVar("T")

#: A job run in the background: given the Cancel event and a progress callback (done, total), returns its result.
Job = Callable[[threading.Event, Callable[[int, int], None]], T]
#: A live panel's load: (deployment, workload, cancel event, progress callback) -> raw rows.
Measure = Callable[..., pd.DataFrame]


class RunCancelled(RuntimeError):
    """The learner pressed Cancel: the run's numbers are dropped."""


class BackgroundRun(Generic[T]):
    """One job at a time off the kernel's main thread, with a progress bar and a Cancel button. A job asked for
    while one runs waits its turn (only the latest waits: a slider dragged over many values runs its last one).
    `wait()` blocks until nothing is running or waiting, and re-raises a job's error."""

    def __init__(self) -> None:
        self.progress = widgets.FloatProgress(value=0.0, min=0.0, max=1.0, description="idle",
                                              style={"description_width": "120px"}, layout={"width": "420px"})
        self.cancel = widgets.Button(description="Cancel", icon="stop", disabled=True,
                                     tooltip="stop the load now; its numbers are dropped")
        self.cancel.on_click(lambda _button: self._stop.set())
        self.widget = widgets.HBox([self.progress, self.cancel])
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._waiting: tuple[Job, Callable[[T], None]] | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def submit(self, job: Job, done: Callable[[T], None]) -> None:
        """Run `job` now, or after the one running; `done(result)` gets its result (not called when cancelled or
        failed: the error is kept for `wait()` and the progress bar says what happened)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                self._waiting = (job, done)
                return
            self._idle.clear()
            self._thread = threading.Thread(target=self._run, args=(job, done), daemon=True)
            self._thread.start()

    def _run(self, job: Job, done: Callable[[T], None]) -> None:
        while True:
            self._stop = threading.Event()
            self.cancel.disabled = False
            self.progress.value, self.progress.bar_style, self.progress.description = 0.0, "info", "running"
            try:
                result = job(self._stop, self._advance)
                if self._stop.is_set():
                    raise RunCancelled("cancelled")
                done(result)
                self.progress.value, self.progress.bar_style, self.progress.description = 1.0, "success", "done"
            except RunCancelled:
                self.progress.bar_style, self.progress.description = "warning", "cancelled"
            except BaseException as error:  # shown in the bar, raised again by wait()
                self._error = error
                self.progress.bar_style, self.progress.description = "danger", "failed"
            finally:
                self.cancel.disabled = True
            with self._lock:
                if self._waiting is None:
                    self._thread = None
                    self._idle.set()
                    return
                job, done = self._waiting
                self._waiting = None

    def _advance(self, finished: int, total: int) -> None:
        if total:
            self.progress.value = min(1.0, finished / total)
            self.progress.description = f"{finished}/{total} requests"

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until no job runs or waits; raise the error a job ended with (once)."""
        if not self._idle.wait(timeout_s):
            raise TimeoutError(f"the panel's run did not end within {timeout_s} s")
        error, self._error = self._error, None
        if error is not None:
            raise error


@dataclass(frozen=True)
class PanelRun:
    """One apply-and-measure of the router panel: the settings the router confirmed, the load, what it measured."""

    threshold: int
    rate: float
    long_fraction: float
    short_stalled_share: float | None
    """Share of the short requests that stalled at least once (a gap over 5x their median gap)."""
    short_worst_gap_p99_ms: float | None
    """p99 over short requests of each one's longest gap."""
    short_itl_p99_ms: float | None
    short_itl_max_ms: float | None
    long_ttft_p50_ms: float | None
    disaggregated: int
    """Requests the router sent through prefill -> decode."""
    direct: int
    """Requests the router sent straight to a decode instance."""

    @property
    def load(self) -> str:
        """The run's load, which names its series: points of one series differ only in the threshold."""
        return f"{self.rate:g} req/s, {self.long_fraction:.0%} long"

    def label(self) -> str:
        return f"threshold {self.threshold}, {self.load}"

    def figures(self) -> str:
        """What it measured, in words ("-" for a figure the run could not give, e.g. no short request finished)."""
        return (f"{_pct(self.short_stalled_share)} of short requests stalled, worst gap p99 "
                f"{_ms(self.short_worst_gap_p99_ms)}; long TTFT p50 {_ms(self.long_ttft_p50_ms)}")


def _get(data: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(data, dict) or data.get(key) is None:
            return None
        data = data[key]
    return data


def summarize_run(rows: pd.DataFrame) -> dict[str, float | int | None]:
    """The router panel's figures of one run: the short requests' stalls (share stalled, worst gap p99, ITL p99 and
    max), the long requests' median TTFT, requests per path."""
    summary = scenario_summary(rows)
    paths = rows["path"].fillna("").value_counts() if "path" in rows else pd.Series(dtype=int)
    return {
        "short_stalled_share": _get(summary, "short", "stalled", "share"),
        "short_worst_gap_p99_ms": _get(summary, "short", "worst_gap_ms", "p99"),
        "short_itl_p99_ms": _get(summary, "short", "itl_ms", "p99"),
        "short_itl_max_ms": _get(summary, "short", "itl_ms", "max"),
        "long_ttft_p50_ms": _get(summary, "long", "ttft_ms", "p50"),
        "disaggregated": int(paths.get("disaggregated", 0)),
        "direct": int(paths.get("direct", 0)),
    }


_STYLE = {"description_width": "120px"}


class RouterPanel:
    """The threshold of a P/D deployment's live router, and the load. A control's change (a slider on release)
    applies the threshold through `PUT /admin/config`, runs `workload` at the chosen rate and long share in the
    background, and adds the run to `figure`: against the threshold, the share of short requests that stalled
    (left) and the long prompts' median TTFT (right); one series per load."""

    def __init__(self, dep: Deployment, workload: MixedWorkload, measure: Measure, *, max_threshold: int = 8192,
                 step: int = 128) -> None:
        if dep.router_url is None:
            raise ValueError("the router panel needs a deployment with a router (`router:` in the lab spec)")
        self.dep, self.workload, self.measure = dep, workload, measure
        self.history: list[PanelRun] = []
        current = set_router(dep)  # an empty update reads the live settings
        self.threshold = widgets.IntSlider(value=int(current["threshold"]), min=0, max=max_threshold, step=step,
                                           description="threshold", continuous_update=False, style=_STYLE,
                                           layout={"width": "520px"})
        self.rate = widgets.FloatSlider(value=workload.rate, min=0.25, max=max(4.0, 2 * workload.rate), step=0.25,
                                        description="rate (req/s)", continuous_update=False, style=_STYLE)
        self.long_fraction = widgets.FloatSlider(value=workload.long_fraction, min=0.0, max=0.6, step=0.05,
                                                 description="long share", continuous_update=False, style=_STYLE)
        self.status = widgets.HTML(value=f"router at {dep.router_url}: move a control to apply it and measure")
        self.runs: BackgroundRun[PanelRun] = BackgroundRun()
        self.figure = go.FigureWidget(make_subplots(rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=(
            "short requests that stalled (%)", "long prompts' median TTFT (ms)")))
        self.figure.update_layout(title={"text": "no run yet"}, height=420, legend={"orientation": "h", "y": -0.25})
        self.figure.update_xaxes(title_text="routing threshold (tokens)")
        self.figure.update_yaxes(rangemode="tozero", row=1, col=1)
        self.figure.update_yaxes(type="log", row=1, col=2)
        for control in (self.threshold, self.rate, self.long_fraction):
            control.observe(lambda _change: self.apply(), names="value")
        self.widget = widgets.VBox([self.threshold, widgets.HBox([self.rate, self.long_fraction]),
                                    self.runs.widget, self.status, self.figure])

    def apply(self) -> None:
        """Measure the controls' settings in the background (see `wait`)."""
        threshold, rate, long_fraction = self.threshold.value, self.rate.value, self.long_fraction.value
        self.runs.submit(lambda stop, advance: self._measure(threshold, rate, long_fraction, stop, advance),
                         self._record)

    def wait(self, timeout_s: float | None = None) -> PanelRun:
        """Block until the runs asked for are measured and drawn; returns the last."""
        self.runs.wait(timeout_s)
        return self.history[-1]

    def _measure(self, threshold: int, rate: float, long_fraction: float, stop: threading.Event,
                 advance: Callable[[int, int], None]) -> PanelRun:
        confirmed = set_router(self.dep, threshold=threshold)
        workload = self.workload.model_copy(update={"rate": rate, "long_fraction": long_fraction})
        self.status.value = f"threshold {confirmed['threshold']} applied; running {workload.duration_s:g} s of load"
        rows = self.measure(self.dep, workload, stop=stop, on_progress=advance)
        return PanelRun(threshold=confirmed["threshold"], rate=rate, long_fraction=long_fraction,
                        **summarize_run(rows))  # type: ignore[arg-type]

    def _record(self, run: PanelRun) -> None:
        self.history.append(run)
        loads = list(dict.fromkeys(r.load for r in self.history))
        with self.figure.batch_update():
            self.figure.data = ()
            for n, load in enumerate(loads):
                mine = [r for r in self.history if r.load == load]
                text = [r.label() for r in mine]
                marker = {"size": 11, "symbol": ["circle", "square", "diamond", "triangle-up"][n % 4]}
                self.figure.add_scatter(x=[r.threshold for r in mine], text=text, mode="markers", name=load,
                                        y=[None if r.short_stalled_share is None else 100 * r.short_stalled_share
                                           for r in mine], marker=marker, legendgroup=load, row=1, col=1)
                self.figure.add_scatter(x=[r.threshold for r in mine], y=[r.long_ttft_p50_ms for r in mine],
                                        text=text, mode="markers", name=load, marker=marker, legendgroup=load,
                                        showlegend=False, row=1, col=2)
            self.figure.layout.title.text = f"threshold {run.threshold}: {run.figures()}"
        self.status.value = (f"last run: {run.label()}: {run.direct} direct, {run.disaggregated} through "
                             "prefill -> decode")


@dataclass(frozen=True)
class StrategyRun:
    """One run of the strategy panel."""

    strategy: str
    requests: int
    prefix_hit_rate: float | None
    """Share of prompt tokens the replicas found in their prefix caches (vLLM's counters, over all replicas)."""
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None


def engine_counters(dep: Deployment) -> KVTransferStats:
    """vLLM's counters (KV transfers, preemptions, prefix cache) summed over a deployment's instances."""
    return sum((scrape_kv_transfer(inst.url) for inst in dep.instances), KVTransferStats())


class StrategyPanel:
    """The replica strategy of a live router over two (or more) replicas with prefix caching, under a shared-prefix
    trace. Choosing a strategy applies it, replays the trace in the background, and adds a point per run: the
    replicas' prefix-cache hit rate (left) and the requests' TTFT p50 (right), strategies on their own axis. Each
    run replays the trace with new document text (its own seed), so no strategy inherits another's warm caches."""

    def __init__(self, dep: Deployment, workload: TraceWorkload, measure: Measure, *, pool: str = "decode",
                 strategies: Sequence[str] = ("roundrobin", "prefixaware", "kvaware", "leastloaded")) -> None:
        if dep.router_url is None:
            raise ValueError("the strategy panel needs a deployment with a router (`router:` in the lab spec)")
        self.dep, self.workload, self.measure, self.pool = dep, workload, measure, f"{pool}_strategy"
        self.history: list[StrategyRun] = []
        unknown = sorted(set(strategies) - set(STRATEGIES))
        if unknown:
            raise ValueError(f"unknown strategies {unknown}; known: {sorted(STRATEGIES)}")
        current = set_router(dep)[self.pool]
        self.strategy = widgets.Dropdown(options=list(strategies), value=current if current in strategies
                                         else strategies[0], description=f"{pool} pool", style=_STYLE)
        self.status = widgets.HTML(value="choose a strategy to apply it and replay the trace")
        self.runs: BackgroundRun[StrategyRun] = BackgroundRun()
        self.figure = go.FigureWidget(make_subplots(rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=(
            "prefix-cache hit rate (%)", "TTFT (ms)")))
        self.figure.update_layout(title={"text": "no run yet"}, height=400, showlegend=True,
                                  legend={"orientation": "h", "y": -0.25})
        self.figure.update_xaxes(type="category", categoryorder="array", categoryarray=list(strategies))
        self.figure.update_yaxes(range=[0, 100], row=1, col=1)
        self.strategy.observe(lambda _change: self.apply(), names="value")
        self.widget = widgets.VBox([self.strategy, self.runs.widget, self.status, self.figure])

    def apply(self) -> None:
        strategy, seed = self.strategy.value, self.workload.seed + 1 + len(self.history)
        self.runs.submit(lambda stop, advance: self._measure(strategy, seed, stop, advance), self._record)

    def wait(self, timeout_s: float | None = None) -> StrategyRun:
        self.runs.wait(timeout_s)
        return self.history[-1]

    def _measure(self, strategy: str, seed: int, stop: threading.Event,
                 advance: Callable[[int, int], None]) -> StrategyRun:
        set_router(self.dep, **{self.pool: strategy})
        self.status.value = f"{strategy} applied; replaying {self.workload.duration_s:g} s of the trace"
        before = engine_counters(self.dep)
        rows = self.measure(self.dep, self.workload.model_copy(update={"seed": seed}), stop=stop, on_progress=advance)
        moved = engine_counters(self.dep) - before
        ttft = _get(scenario_summary(rows), "all", "ttft_ms") or {}
        return StrategyRun(strategy, int((rows["status"] == "ok").sum()), moved.prefix_hit_rate, ttft.get("p50"),
                           ttft.get("p99"))

    def _record(self, run: StrategyRun) -> None:
        self.history.append(run)
        runs = self.history
        x = [r.strategy for r in runs]
        text = [f"run {i + 1}: {r.strategy}, {r.requests} requests" for i, r in enumerate(runs)]
        with self.figure.batch_update():
            self.figure.data = ()
            self.figure.add_scatter(x=x, y=[None if r.prefix_hit_rate is None else 100 * r.prefix_hit_rate
                                            for r in runs], text=text, mode="markers", name="hit rate",
                                    marker={"size": 12, "color": "#2ca02c"}, row=1, col=1)
            for stat, colour in (("p50", "#1f77b4"), ("p99", "#ff7f0e")):
                self.figure.add_scatter(x=x, y=[getattr(r, f"ttft_{stat}_ms") for r in runs], text=text,
                                        mode="markers", name=f"TTFT {stat}", marker={"size": 12, "color": colour},
                                        row=1, col=2)
            self.figure.layout.title.text = (f"{run.strategy}: {_pct(run.prefix_hit_rate)} of prompt tokens from "
                                             f"the prefix cache, TTFT p50 {_ms(run.ttft_p50_ms)}")
        self.status.value = f"last run: {run.strategy}, {run.requests} requests"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} ms"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


#: What the simulator panel's millisecond bars show: (label, path into a simulated summary).
SIM_BARS = [
    ("short TTFT p99", ("short", "ttft_ms", "p99")),
    ("short ITL p99", ("short", "itl_ms", "p99")),
    ("long TTFT p50", ("long", "ttft_ms", "p50")),
    ("long TTFT p99", ("long", "ttft_ms", "p99")),
]
#: Its percentage bars.
SIM_SHARES = [
    ("SLO attainment", ("goodput", "attainment")),
    ("prefix-cache hits", ("prefix_cache", "hit_rate")),
]


def _dig(data: dict, path: tuple[str, ...]) -> float | None:
    return _get(data, *path)


def trace_rate(spec: SimSpec) -> float:
    """A trace workload's request rate as recorded (requests per second of its span)."""
    from pdlab.sim.workload import arrivals

    trace = spec.workload.trace
    assert trace is not None
    times = [a.at_s for a in arrivals(spec.workload.model_copy(update={"trace": trace.model_copy(
        update={"time_scale": 1.0})}), spec.engine.block_size)]
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 1.0


def sim_variant(spec: SimSpec, *, threshold: int, prefill: int, decode: int, rate: float, link: str,
                tensor_parallel: int | None = None, prefill_strategy: str | None = None,
                decode_strategy: str | None = None) -> SimSpec:
    """`spec` with the panel's settings: `prefill` 0 means `decode` colocated instances (no disaggregation);
    `tensor_parallel`, GPUs per instance in every pool; `rate` sets a Poisson workload's rate, or replays a trace
    faster or slower to reach it."""
    pools = Pools(colocated=decode) if prefill == 0 else Pools(prefill=prefill, decode=decode)
    workload = spec.workload
    if workload.poisson is not None:
        workload = workload.model_copy(update={"poisson": workload.poisson.model_copy(update={"rate_rps": rate})})
    elif workload.trace is not None:
        scale = workload.trace.time_scale * trace_rate(spec) / rate
        workload = workload.model_copy(update={"trace": workload.trace.model_copy(update={"time_scale": scale})})
    else:
        raise ValueError("the simulator panel needs a `poisson` or `trace` workload (it sets its rate)")
    router = {"threshold": threshold}
    router.update({k: v for k, v in (("prefill_strategy", prefill_strategy), ("decode_strategy", decode_strategy))
                   if v is not None})
    update: dict = {"pools": pools, "workload": workload, "link": spec.link.named(link),
                    "router": spec.router.model_copy(update=router)}
    if tensor_parallel is not None:
        update["engine"] = spec.engine.model_copy(update={"tensor_parallel": tensor_parallel})
        if spec.prefill_engine is not None:
            update["prefill_engine"] = spec.prefill_engine.model_copy(update={"tensor_parallel": tensor_parallel})
    return spec.model_copy(update=update)


TENSOR_PARALLEL_CHOICES = (1, 2, 4, 8)
"""GPUs per instance the simulator panel offers (one node's)."""


@dataclass(frozen=True)
class SimPoint:
    """One simulated setting of the panel: what it was and what it gave."""

    label: str
    summary: dict
    worth: str = ""
    """What the figures are worth (pdlab.sim.worth: the profile's validated error, or "not validated")."""


class SimPanel:
    """Widgets over the simulator: any change re-simulates `spec` (about a second) in the background and redraws.
    The bars show the setting before the last change (grey) beside the current one (blue), so a change is read as
    the effect of the one knob just moved; milliseconds on the left, shares (SLO attainment, prefix-cache hits) on
    the right. `apply()` is what a change runs, `wait()` blocks until it is drawn; `summary` is the last simulated
    summary."""

    def __init__(self, spec: SimSpec, catalog: Catalog | None = None, max_instances: int = 12) -> None:
        self.spec = spec
        self.catalog = catalog or load_catalog()
        if spec.workload.poisson is not None:
            rate = spec.workload.poisson.rate_rps
        elif spec.workload.trace is not None:
            rate = trace_rate(spec)
        else:
            raise ValueError("the simulator panel needs a `poisson` or `trace` workload (it sets its rate)")
        self.threshold = widgets.IntSlider(value=spec.router.threshold, min=0, max=32768, step=256,
                                           description="threshold", continuous_update=False, style=_STYLE)
        self.prefill = widgets.IntSlider(value=spec.pools.prefill, min=0, max=max_instances,
                                         description="prefill (0: coloc.)", continuous_update=False, style=_STYLE)
        self.decode = widgets.IntSlider(value=spec.pools.decode or spec.pools.colocated, min=1, max=max_instances,
                                        description="decode", continuous_update=False, style=_STYLE)
        self.rate = widgets.FloatSlider(value=round(rate), min=1, max=max(80, 2 * round(rate)), step=1,
                                        description="rate (req/s)", continuous_update=False, style=_STYLE)
        self.link = widgets.Dropdown(options=sorted(self.catalog.links), value=spec.link.name, description="link",
                                     style=_STYLE)
        # A fitted profile prices its own machine's instances: only the roofline has GPUs to count.
        self.gpus = widgets.Dropdown(options=TENSOR_PARALLEL_CHOICES, value=spec.engine.tensor_parallel,
                                     description="GPUs per instance", disabled=spec.profile is not None, style=_STYLE)
        self.prefill_strategy = widgets.Dropdown(options=list(STRATEGIES), value=spec.router.prefill_strategy,
                                                 description="prefill pool", style=_STYLE)
        self.decode_strategy = widgets.Dropdown(options=list(STRATEGIES), value=spec.router.decode_strategy,
                                                description="decode pool", style=_STYLE)
        self.status = widgets.HTML()
        self.runs: BackgroundRun[SimPoint] = BackgroundRun()
        self.runs.cancel.tooltip = "drop this simulation's result"
        self.figure = go.FigureWidget(make_subplots(rows=1, cols=2, column_widths=[0.65, 0.35],
                                                    horizontal_spacing=0.1, subplot_titles=("milliseconds", "%")))
        for name, colour in (("before", "#c7c7c7"), ("now", "#1f77b4")):
            self.figure.add_bar(x=[label for label, _ in SIM_BARS], y=[None] * len(SIM_BARS), name=name,
                                marker_color=colour, legendgroup=name, row=1, col=1)
            self.figure.add_bar(x=[label for label, _ in SIM_SHARES], y=[None] * len(SIM_SHARES), name=name,
                                marker_color=colour, legendgroup=name, showlegend=False, row=1, col=2)
        self.figure.update_layout(title={"text": ""}, barmode="group", height=420,
                                  legend={"orientation": "h", "y": -0.2})
        self.figure.update_yaxes(type="log", row=1, col=1)
        self.figure.update_yaxes(range=[0, 100], row=1, col=2)
        self.points: list[SimPoint] = []
        self.summary: dict = {}
        for control in (self.threshold, self.prefill, self.decode, self.rate, self.link, self.gpus,
                        self.prefill_strategy, self.decode_strategy):
            control.observe(lambda _change: self.apply(), names="value")
        self.widget = widgets.VBox([widgets.HBox([self.threshold, self.rate, self.link]),
                                    widgets.HBox([self.prefill, self.decode, self.gpus]),
                                    widgets.HBox([self.prefill_strategy, self.decode_strategy]),
                                    self.runs.widget, self.status, self.figure])
        self.apply()
        self.wait()

    def current(self) -> SimSpec:
        return sim_variant(self.spec, threshold=self.threshold.value, prefill=self.prefill.value,
                           decode=self.decode.value, rate=self.rate.value, link=self.link.value,
                           tensor_parallel=None if self.gpus.disabled else self.gpus.value,
                           prefill_strategy=self.prefill_strategy.value, decode_strategy=self.decode_strategy.value)

    def label(self, spec: SimSpec) -> str:
        pools = spec.pools
        shape = f"{pools.colocated} colocated" if pools.colocated else f"{pools.prefill}P{pools.decode}D"
        strategies = spec.router.decode_strategy if pools.colocated else \
            f"{spec.router.prefill_strategy}/{spec.router.decode_strategy}"
        return f"{shape}, {self.rate.value:g} req/s, {strategies}"

    def apply(self) -> None:
        """Simulate the panel's settings in the background and redraw; settings the simulator refuses (a model
        that does not fit its GPUs, heads that do not split over them) are said in the status line, the last
        figure kept."""
        try:
            spec = self.current()
        except (ConfigError, ValueError) as error:
            self._refused(error)
            return
        label = self.label(spec)
        self.runs.submit(lambda stop, advance: self._simulate(spec, label), self._record)

    def wait(self, timeout_s: float | None = None) -> dict:
        self.runs.wait(timeout_s)
        return self.summary

    def _simulate(self, spec: SimSpec, label: str) -> SimPoint | None:
        self.status.value = f"simulating {label} ..."
        try:
            summary, _ = simulate(spec, catalog=self.catalog)
        except (ConfigError, ValueError) as error:
            self._refused(error)
            return None
        return SimPoint(label, summary, worth(spec).text)

    def _refused(self, error: Exception) -> None:
        self.status.value = f"<span style='color:#b00'>not simulated: {html.escape(str(error))}</span>"

    def _record(self, point: SimPoint | None) -> None:
        if point is None:
            return
        before = self.points[-1] if self.points else None
        self.points.append(point)
        self.summary = point.summary
        with self.figure.batch_update():
            for offset, shown in ((0, before), (2, point)):
                for bars, trace in ((SIM_BARS, self.figure.data[offset]), (SIM_SHARES, self.figure.data[offset + 1])):
                    scale = 100 if bars is SIM_SHARES else 1
                    trace.y = [None if shown is None or (v := _dig(shown.summary, path)) is None else v * scale
                               for _, path in bars]
                    trace.name = "before" if offset == 0 else "now"
                    trace.hovertext = [shown.label if shown else ""] * len(bars)
            self.figure.layout.title.text = (f"{self.spec.model} on {self.spec.hardware}, {point.label}: SLO "
                                             f"attainment {_pct(_dig(point.summary, ('goodput', 'attainment')))}")
        s = point.summary
        hits = _dig(s, ("prefix_cache", "hit_rate"))
        self.status.value = (f"now: {point.label}" + (f"; before: {before.label}" if before else "") +
                             f". {s['paths']['disaggregated']} requests disaggregated, {s['paths']['direct']} direct; "
                             f"{s['stalls']['count']} stalls > {s['stalls']['threshold_ms']:g} ms; "
                             f"{s['unfinished']} unfinished" +
                             (f"; {hits:.0%} of prompt tokens from prefix caches" if hits else "") +
                             f"<br><small>what these figures are worth: {html.escape(point.worth)}</small>")


def sim_table(summaries: dict[str, dict]) -> pd.DataFrame:
    """Simulated summaries side by side: the panel's figures (ms), stalls, SLO attainment and prefix-cache hits."""
    table = {name: {**{f"{label} (ms)": _dig(summary, path) for label, path in SIM_BARS},
                    "stalls": summary["stalls"]["count"], "SLO attainment": summary["goodput"]["attainment"],
                    "prefix-cache hits": _dig(summary, ("prefix_cache", "hit_rate"))}
             for name, summary in summaries.items()}
    return pd.DataFrame(table)


__all__ = ["BackgroundRun", "PanelRun", "RouterPanel", "SimPanel", "SimPoint", "StrategyPanel", "StrategyRun",
           "engine_counters", "sim_table", "sim_variant", "summarize_run"]
