"""The router control panel of notebook 04: widgets that change the LIVE router (threshold, strategy per pool)
and the load (rate, long-prompt share), re-run a short load, and redraw a plotly FigureWidget in place.

Everything the widgets do goes through `RouterPanel.apply()`, so tests drive it without a browser:

    panel = RouterPanel(dep, base_workload)
    panel.threshold.value = 2048      # a slider release runs apply() (observe), as in the browser
    panel.history[-1]                 # what that run measured
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass

import ipywidgets as widgets
import pandas as pd
import plotly.graph_objects as go

from pdlab.config.base import ConfigError
from pdlab.config.sim import Pools, SimSpec
from pdlab.config.workload import MixedWorkload
from pdlab.deploy import Deployment
from pdlab.experiment.lab import set_router
from pdlab.metrics.summary import scenario_summary
from pdlab.model.catalog import Catalog, load_catalog
from pdlab.router.strategies import STRATEGIES
from pdlab.sim.scenario import simulate
from pdlab.sim.worth import worth


@dataclass(frozen=True)
class PanelRun:
    """One apply-and-measure of the panel: the settings the router confirmed, the load, and what it measured."""

    threshold: int
    prefill_strategy: str
    decode_strategy: str
    rate: float
    long_fraction: float
    short_itl_p99_ms: float | None
    short_itl_max_ms: float | None
    long_ttft_p50_ms: float | None
    disaggregated: int
    """Requests the router sent through prefill -> decode."""
    direct: int
    """Requests the router sent straight to a decode instance."""

    def label(self) -> str:
        return (f"threshold {self.threshold}, {self.prefill_strategy}/{self.decode_strategy}, "
                f"{self.rate:g} req/s, {self.long_fraction:.0%} long")


def summarize_run(rows: pd.DataFrame) -> dict[str, float | int | None]:
    """The panel's figures of one run: short requests' p99 ITL, long requests' median TTFT, requests per path."""
    summary = scenario_summary(rows)
    paths = rows["path"].fillna("").value_counts() if "path" in rows else pd.Series(dtype=int)
    return {
        "short_itl_p99_ms": summary.get("short", {}).get("itl_ms", {}).get("p99"),
        "short_itl_max_ms": summary.get("short", {}).get("itl_ms", {}).get("max"),
        "long_ttft_p50_ms": summary.get("long", {}).get("ttft_ms", {}).get("p50"),
        "disaggregated": int(paths.get("disaggregated", 0)),
        "direct": int(paths.get("direct", 0)),
    }


Measure = Callable[[Deployment, MixedWorkload], pd.DataFrame]


class RouterPanel:
    """Widgets bound to a deployment with a router. Any control's change (a slider on release) applies the router
    settings through `PUT /admin/config`, re-runs `workload` with the chosen rate and long share, and adds the run
    to `figure` (short p99 ITL and long TTFT against the threshold)."""

    def __init__(self, dep: Deployment, workload: MixedWorkload, measure: Measure, *, max_threshold: int = 8192,
                 step: int = 128) -> None:
        if dep.router_url is None:
            raise ValueError("the router panel needs a deployment with a router (`router:` in the lab spec)")
        self.dep = dep
        self.workload = workload
        self.measure = measure
        self.history: list[PanelRun] = []
        current = set_router(dep)  # an empty update reads the live settings
        options = list(STRATEGIES)
        self.threshold = widgets.IntSlider(value=int(current["threshold"]), min=0, max=max_threshold, step=step,
                                           description="threshold", continuous_update=False,
                                           style={"description_width": "120px"}, layout={"width": "520px"})
        self.prefill_strategy = widgets.Dropdown(options=options, value=current["prefill_strategy"],
                                                 description="prefill pool", style={"description_width": "120px"})
        self.decode_strategy = widgets.Dropdown(options=options, value=current["decode_strategy"],
                                                description="decode pool", style={"description_width": "120px"})
        self.rate = widgets.FloatSlider(value=workload.rate, min=0.25, max=4.0, step=0.25, description="rate (req/s)",
                                        continuous_update=False, style={"description_width": "120px"})
        self.long_fraction = widgets.FloatSlider(value=workload.long_fraction, min=0.0, max=0.6, step=0.05,
                                                 description="long share", continuous_update=False,
                                                 style={"description_width": "120px"})
        self.status = widgets.HTML(value=f"router at {dep.router_url}: move a control to apply it and measure")
        self.figure = go.FigureWidget(layout={
            "title": {"text": "no run yet"}, "xaxis_title": "routing threshold (tokens)",
            "yaxis_title": "milliseconds", "yaxis_type": "log", "height": 420,
            "legend": {"orientation": "h", "y": -0.2}})
        self.figure.add_scatter(x=[], y=[], mode="markers", name="short requests: p99 ITL (ms)", text=[],
                                marker={"size": 11})
        self.figure.add_scatter(x=[], y=[], mode="markers", name="long requests: median TTFT (ms)", text=[],
                                marker={"size": 11, "symbol": "diamond"})
        for control in (self.threshold, self.prefill_strategy, self.decode_strategy, self.rate, self.long_fraction):
            control.observe(self._changed, names="value")
        self.widget = widgets.VBox([
            widgets.HBox([self.threshold, self.prefill_strategy, self.decode_strategy]),
            widgets.HBox([self.rate, self.long_fraction]), self.status, self.figure])

    def _changed(self, _change: dict) -> None:
        self.apply()

    def apply(self) -> PanelRun:
        """Apply the controls' router settings to the live router, run the load, record and draw the run."""
        confirmed = set_router(self.dep, threshold=self.threshold.value,
                               prefill_strategy=self.prefill_strategy.value,
                               decode_strategy=self.decode_strategy.value)
        workload = self.workload.model_copy(update={"rate": self.rate.value,
                                                    "long_fraction": self.long_fraction.value})
        self.status.value = f"applied {confirmed}; running {workload.duration_s:g} s of load ..."
        figures = summarize_run(self.measure(self.dep, workload))
        run = PanelRun(threshold=confirmed["threshold"], prefill_strategy=confirmed["prefill_strategy"],
                       decode_strategy=confirmed["decode_strategy"], rate=workload.rate,
                       long_fraction=workload.long_fraction, **figures)  # type: ignore[arg-type]
        self.history.append(run)
        self._draw()
        self.status.value = (f"last run: {run.label()}: {run.direct} direct, {run.disaggregated} through "
                             "prefill -> decode")
        return run

    def _draw(self) -> None:
        last = self.history[-1]
        with self.figure.batch_update():
            for trace, key in zip(self.figure.data, ("short_itl_p99_ms", "long_ttft_p50_ms"), strict=True):
                trace.x = [run.threshold for run in self.history]
                trace.y = [getattr(run, key) for run in self.history]
                trace.text = [run.label() for run in self.history]
            self.figure.layout.title.text = (
                f"threshold {last.threshold}: short p99 ITL {_ms(last.short_itl_p99_ms)}, "
                f"long TTFT p50 {_ms(last.long_ttft_p50_ms)}")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} ms"


#: What the simulator panel's bars show: (label, path into a simulated summary).
SIM_BARS = [
    ("short TTFT p99", ("short", "ttft_ms", "p99")),
    ("short ITL p99", ("short", "itl_ms", "p99")),
    ("long TTFT p50", ("long", "ttft_ms", "p50")),
    ("long TTFT p99", ("long", "ttft_ms", "p99")),
]


def _dig(data: dict, path: tuple[str, ...]) -> float | None:
    for key in path:
        if not isinstance(data, dict) or data.get(key) is None:
            return None
        data = data[key]
    return data  # type: ignore[return-value]


def sim_variant(spec: SimSpec, *, threshold: int, prefill: int, decode: int, rate: float, link: str,
                tensor_parallel: int | None = None) -> SimSpec:
    """`spec` with the panel's settings: `prefill` 0 means `decode` colocated instances (no disaggregation);
    `tensor_parallel`, GPUs per instance in every pool."""
    pools = Pools(colocated=decode) if prefill == 0 else Pools(prefill=prefill, decode=decode)
    workload = spec.workload
    if workload.poisson is None:
        raise ValueError("the simulator panel needs a `poisson` workload (it sets its rate)")
    workload = workload.model_copy(update={"poisson": workload.poisson.model_copy(update={"rate_rps": rate})})
    update: dict = {"pools": pools, "workload": workload, "link": spec.link.named(link),
                    "router": spec.router.model_copy(update={"threshold": threshold})}
    if tensor_parallel is not None:
        update["engine"] = spec.engine.model_copy(update={"tensor_parallel": tensor_parallel})
        if spec.prefill_engine is not None:
            update["prefill_engine"] = spec.prefill_engine.model_copy(update={"tensor_parallel": tensor_parallel})
    return spec.model_copy(update=update)


TENSOR_PARALLEL_CHOICES = (1, 2, 4, 8)
"""GPUs per instance the simulator panel offers (one node's)."""


class SimPanel:
    """Widgets over the simulator: any change re-simulates `spec` (well under a second) and redraws the bars.
    `apply()` is what a change runs; `summary` is the last simulated summary."""

    def __init__(self, spec: SimSpec, catalog: Catalog | None = None, max_instances: int = 12) -> None:
        self.spec = spec
        self.catalog = catalog or load_catalog()
        if spec.workload.poisson is None:
            raise ValueError("the simulator panel needs a `poisson` workload (it sets its rate)")
        style = {"description_width": "140px"}
        self.threshold = widgets.IntSlider(value=spec.router.threshold, min=0, max=32768, step=256,
                                           description="threshold", continuous_update=False, style=style)
        self.prefill = widgets.IntSlider(value=spec.pools.prefill, min=0, max=max_instances,
                                         description="prefill (0: coloc.)", continuous_update=False, style=style)
        self.decode = widgets.IntSlider(value=spec.pools.decode or spec.pools.colocated, min=1, max=max_instances,
                                        description="decode", continuous_update=False, style=style)
        self.rate = widgets.FloatSlider(value=spec.workload.poisson.rate_rps, min=1, max=80, step=1,
                                        description="rate (req/s)", continuous_update=False, style=style)
        self.link = widgets.Dropdown(options=sorted(self.catalog.links), value=spec.link.name, description="link",
                                     style=style)
        # A fitted profile prices its own machine's instances: only the roofline has GPUs to count.
        self.gpus = widgets.Dropdown(options=TENSOR_PARALLEL_CHOICES, value=spec.engine.tensor_parallel,
                                     description="GPUs per instance", disabled=spec.profile is not None, style=style)
        self.status = widgets.HTML()
        self.figure = go.FigureWidget(layout={"title": {"text": ""}, "yaxis_title": "milliseconds",
                                              "yaxis_type": "log", "height": 380})
        self.figure.add_bar(x=[label for label, _ in SIM_BARS], y=[0.0] * len(SIM_BARS))
        self.summary: dict = {}
        for control in (self.threshold, self.prefill, self.decode, self.rate, self.link, self.gpus):
            control.observe(lambda _change: self.apply(), names="value")
        self.widget = widgets.VBox([widgets.HBox([self.threshold, self.rate, self.link]),
                                    widgets.HBox([self.prefill, self.decode, self.gpus]), self.status, self.figure])
        self.apply()

    def current(self) -> SimSpec:
        return sim_variant(self.spec, threshold=self.threshold.value, prefill=self.prefill.value,
                           decode=self.decode.value, rate=self.rate.value, link=self.link.value,
                           tensor_parallel=None if self.gpus.disabled else self.gpus.value)

    def apply(self) -> dict:
        """Simulate the panel's settings and redraw; settings the simulator refuses (a model that does not fit
        its GPUs, heads that do not split over them) are said in the status line, the last figure kept."""
        spec = self.current()
        try:
            self.summary, _ = simulate(spec, catalog=self.catalog)
        except (ConfigError, ValueError) as error:
            self.status.value = f"<span style='color:#b00'>not simulated: {html.escape(str(error))}</span>"
            return self.summary
        goodput = self.summary["goodput"]
        pools = spec.pools
        shape = f"{pools.colocated} colocated" if pools.colocated else f"{pools.prefill}P{pools.decode}D"
        with self.figure.batch_update():
            self.figure.data[0].y = [_dig(self.summary, path) for _, path in SIM_BARS]
            self.figure.layout.title.text = (f"{spec.model} on {spec.hardware}, {shape}, {self.rate.value:g} req/s: "
                                             f"SLO attainment {goodput['attainment']:.0%}")
        paths, stalls = self.summary["paths"], self.summary["stalls"]
        self.status.value = (f"{paths['disaggregated']} requests disaggregated, {paths['direct']} direct; "
                             f"{stalls['count']} stalls > {stalls['threshold_ms']:g} ms; "
                             f"{self.summary['unfinished']} unfinished<br><small>what these figures are worth: "
                             f"{html.escape(worth(spec).text)}</small>")
        return self.summary


def sim_table(summaries: dict[str, dict]) -> pd.DataFrame:
    """Simulated summaries side by side: the panel's figures (ms), stalls and SLO attainment."""
    table = {name: {**{f"{label} (ms)": _dig(summary, path) for label, path in SIM_BARS},
                    "stalls": summary["stalls"]["count"], "SLO attainment": summary["goodput"]["attainment"]}
             for name, summary in summaries.items()}
    return pd.DataFrame(table)
