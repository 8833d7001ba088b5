"""Plotly figures of a run, each a function of raw rows (or summaries) returning a `go.Figure`, so notebooks
and `write_report` draw the same pictures."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from pdlab.metrics.latency import DEFAULT_STALL_K, gaps, itl_values, prefill_intervals, request_metrics

#: One colour per request class, used by every figure.
CLASS_COLOURS = {"short": "#1f77b4", "long": "#ff7f0e", "probe": "#7f7f7f"}
STALL_COLOUR = "#d62728"


def timeline_figure(rows: pd.DataFrame, stall_k: float = DEFAULT_STALL_K, title: str = "Request timeline",
                    max_requests: int = 400) -> go.Figure:
    """One row per request (by send time): a thick segment from send to first token (TTFT), a tick per
    streamed token, stalled gaps in red, failed requests crossed out, and long prompts' prefills shaded. On the P/D
    path a diamond marks the prefill instance's answer (the router's `prefill_ms`): the TTFT after it is the KV
    transfer, the decode instance's queue and its first step."""
    ordered = rows.sort_values("start_s", kind="stable").head(max_requests).reset_index(drop=True)
    y_of = {rid: i for i, rid in enumerate(ordered["request_id"])}
    labels = [f"{rid} {cls}" for rid, cls in zip(ordered["request_id"], ordered["cls"], strict=True)]
    fig = go.Figure()

    for _, pre in prefill_intervals(ordered).iterrows():
        fig.add_vrect(x0=pre["t0_s"], x1=pre["t1_s"], fillcolor=CLASS_COLOURS["long"], opacity=0.08, line_width=0,
                      layer="below")

    for cls, group in ordered.groupby("cls", sort=True):
        colour = CLASS_COLOURS.get(str(cls), "#2ca02c")
        ttft_x: list[float | None] = []
        ttft_y: list[float | None] = []
        tick_x: list[float] = []
        tick_y: list[float] = []
        for _, row in group.iterrows():
            y = y_of[row["request_id"]]
            times = row["token_times"]
            if times:
                ttft_x += [row["start_s"], row["start_s"] + times[0], None]
                ttft_y += [y, y, None]
                tick_x += [row["start_s"] + t for t in times]
                tick_y += [y] * len(times)
        fig.add_trace(go.Scatter(x=ttft_x, y=ttft_y, mode="lines", line={"color": colour, "width": 5},
                                 name=f"{cls}: TTFT", legendgroup=str(cls), hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=tick_x, y=tick_y, mode="markers", name=f"{cls}: tokens", legendgroup=str(cls),
                                 marker={"symbol": "line-ns-open", "size": 7, "color": colour},
                                 hovertemplate="t=%{x:.3f}s<extra></extra>"))

    if "prefill_ms" in ordered:
        handed = ordered[ordered["prefill_ms"].notna() & ordered["token_times"].map(bool)]
        if not handed.empty:
            prefill_s = handed["prefill_ms"] / 1e3
            rest_s = handed["token_times"].map(lambda times: times[0]) - prefill_s
            fig.add_trace(go.Scatter(
                x=handed["start_s"] + prefill_s, y=[y_of[r] for r in handed["request_id"]], mode="markers",
                marker={"symbol": "diamond", "size": 8, "color": "#9467bd"}, name="prefill answered (P/D)",
                text=[f"prefill {p:.2f} s, then {r:.2f} s to the first token" for p, r in zip(prefill_s, rest_s,
                                                                                              strict=True)],
                hovertemplate="%{text}<extra></extra>"))

    stalled = gaps(ordered, stall_k)
    stalled = stalled[stalled["stall"]]
    if not stalled.empty:
        xs: list[float | None] = []
        ys: list[float | None] = []
        for _, gap in stalled.iterrows():
            y = y_of[gap["request_id"]]
            xs += [gap["t0_s"], gap["t1_s"], None]
            ys += [y, y, None]
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line={"color": STALL_COLOUR, "width": 4},
                                 name=f"stall (> {stall_k:g}x median gap)", hoverinfo="skip"))

    failed = ordered[ordered["status"] != "ok"]
    if not failed.empty:
        fig.add_trace(go.Scatter(x=failed["start_s"] + failed["end_s"], y=[y_of[r] for r in failed["request_id"]],
                                 mode="markers", marker={"symbol": "x", "size": 9, "color": STALL_COLOUR},
                                 name="failed", text=failed["status"] + ": " + failed["error"].astype(str),
                                 hovertemplate="%{text}<extra></extra>"))

    fig.update_layout(title=title, xaxis_title="seconds since the load began", height=max(300, 18 * len(ordered)),
                      yaxis={"tickmode": "array", "tickvals": list(range(len(labels))), "ticktext": labels,
                             "autorange": "reversed"}, legend={"orientation": "h", "y": -0.08})
    return fig


def itl_cdf_figure(scenarios: Mapping[str, pd.DataFrame], cls: str | None = "short",
                   title: str | None = None) -> go.Figure:
    """Empirical CDF of inter-token gaps (ms) per scenario, log x axis: a HOL stall shows as a long right tail."""
    fig = go.Figure()
    for name, rows in scenarios.items():
        values = np.sort(itl_values(rows, cls)) * 1000
        if values.size == 0:
            continue
        fig.add_trace(go.Scatter(x=values, y=np.arange(1, values.size + 1) / values.size, mode="lines", name=name,
                                 line={"shape": "hv"}))
    which = f"{cls} requests" if cls else "all requests"
    fig.update_layout(title=title or f"Inter-token latency CDF ({which})", xaxis_title="ITL (ms)",
                      yaxis_title="share of gaps <= x", xaxis_type="log", yaxis_range=[0, 1.01])
    return fig


def ttft_by_class_figure(scenarios: Mapping[str, pd.DataFrame], title: str = "TTFT by class") -> go.Figure:
    """Box plots of TTFT (ms), one box per scenario within each request class."""
    fig = go.Figure()
    for name, rows in scenarios.items():
        timed = request_metrics(rows)
        fig.add_trace(go.Box(x=timed["cls"], y=timed["ttft_s"] * 1000, name=name, boxpoints="outliers"))
    fig.update_layout(title=title, boxmode="group", xaxis_title="class", yaxis_title="TTFT (ms)", yaxis_type="log")
    return fig


def sweep_figure(frame: pd.DataFrame, x: str = "rate", y: str = "short_itl_p99_ms", color: str = "scenario",
                 title: str | None = None, target: float | None = None) -> go.Figure:
    """A curve per `color` group of `y` against `x` (e.g. p99 ITL or SLO attainment against request rate);
    `target` draws a horizontal line (e.g. 0.9 for goodput)."""
    fig = go.Figure()
    groups = frame.groupby(color, sort=False) if color in frame else [("", frame)]
    for name, group in groups:
        group = group.sort_values(x)
        fig.add_trace(go.Scatter(x=group[x], y=group[y], mode="lines+markers", name=str(name)))
    if target is not None:
        fig.add_hline(y=target, line_dash="dot", annotation_text=f"target {target:g}")
    fig.update_layout(title=title or f"{y} vs {x}", xaxis_title=x, yaxis_title=y)
    return fig


def validation_figure(result: dict, goal_pct: float | None = None,
                      title: str = "Simulated against measured") -> go.Figure:
    """One point per metric of each validated run (`pdlab sim validate`'s result): measured on x, simulated on y,
    log axes; horizontal bars span the measured value's 95% sampling interval, and the band is +-goal around
    equality. Points are coloured by metric (TTFT or ITL, p50 or p99), the run, the error and (for pooled runs)
    each run's own value on hover."""
    goal = (goal_pct if goal_pct is not None else result.get("goal_pct", 10.0)) / 100
    points: dict[str, list[tuple]] = {}
    for run in result["runs"]:
        name = "/".join(Path(run["run"]).parts[-3:])
        for key, e in run["errors"].items():
            cls, metric, pct = key.split(".")
            low, high = e.get("measured_ci95") or (e["measured"], e["measured"])
            label = f"{metric.removesuffix('_ms').upper()} {pct}"
            own = e.get("per_run_measured")
            runs = f"<br>each run's own: {', '.join(f'{v:,.1f}' for v in own)}" if own else ""
            points.setdefault(label, []).append((e["measured"], e["simulated"], e["measured"] - low,
                                                 high - e["measured"], f"{name}<br>{cls} {label}: "
                                                 f"{e['error_pct']:.1f}% off{runs}"))
    fig = go.Figure()
    values = [v for rows in points.values() for row in rows for v in row[:2]]
    if values:
        span = np.array([min(values) / 1.5, max(values) * 1.5])
        fig.add_trace(go.Scatter(x=np.r_[span, span[::-1]], y=np.r_[span * (1 + goal), span[::-1] * (1 - goal)],
                                 mode="lines", fill="toself", fillcolor="rgba(44,160,44,0.15)", line={"width": 0},
                                 name=f"within {goal:.0%}", hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=span, y=span, mode="lines", line={"dash": "dot", "color": "#2ca02c"},
                                 name="simulated = measured", hoverinfo="skip"))
    for label, rows in sorted(points.items()):
        x, y, minus, plus, text = zip(*rows, strict=True)
        fig.add_trace(go.Scatter(x=x, y=y, mode="markers", name=label, text=text,
                                 hovertemplate="%{text}<extra></extra>",
                                 error_x={"type": "data", "symmetric": False, "array": plus, "arrayminus": minus}))
    fig.update_layout(title=title, xaxis_title="measured (ms)", yaxis_title="simulated (ms)", xaxis_type="log",
                      yaxis_type="log")
    return fig


def validation_summary(result: dict) -> str:
    """One line of `pdlab sim validate`'s result: within the goal, median and max error, and (where the record has
    them) inside the measured 95% interval and within the goal or between the runs' own values."""
    goal = result.get("goal_pct", 10.0)
    parts = [f"{result['within_goal']}/{result['metrics']} metrics within {goal:.0f}%, median error "
             f"{result['median_error_pct']:.1f}%, max {result['max_error_pct']:.1f}%"]
    if sampling := result.get("sampling"):
        parts.append(f"inside the measured 95% interval: {sampling['simulator_within_ci']}/{sampling['metrics']}")
    if each := result.get("each_run"):
        parts.append(f"within {goal:.0f}% or between the {each['runs']} runs' own values: "
                     f"{each['within_goal_or_between']}/{each['metrics']}")
    return "; ".join(parts)


def counts_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Requests per class and status (for the report's table)."""
    return rows.pivot_table(index="cls", columns="status", values="request_id", aggfunc="count", fill_value=0)


__all__ = ["counts_table", "hol_figure", "itl_cdf_figure", "sweep_figure", "timeline_figure", "transfer_figure",
           "ttft_by_class_figure", "validation_figure", "validation_summary"]


#: The parts of a P/D request's time to first token, in order, with their colours (transfer_figure).
TRANSFER_PARTS = (("prefill", "prefill_s", "#ff7f0e"), ("wait", "wait_s", "#c7c7c7"),
                  ("KV transfer", "transfer_s", "#9467bd"), ("first decode step", "step_s", "#1f77b4"))


def transfer_figure(traces: Mapping[str, Sequence], title: str = "Each request's time to first token, in parts"
                    ) -> go.Figure:
    """One bar per traced P/D request (`pdlab.metrics.kv.TransferTrace`), grouped by label (a link rate, a
    condition): prefill, wait, KV transfer and first decode step laid end to end, in milliseconds (LMCache's
    traces: the push right after the prefill, then the wait). Hover a KV segment for its bytes and rate."""
    rows = [(f"{label} · {trace.prompt_tokens:,} tokens · #{i + 1}", trace)
            for label, group in traces.items() for i, trace in enumerate(group)]
    names = [name for name, _ in rows]
    fig = go.Figure()
    parts = TRANSFER_PARTS
    if rows and all(trace.connector == "lmcache" for _, trace in rows):  # pushed as the prefill ends, then loaded
        parts = (TRANSFER_PARTS[0], TRANSFER_PARTS[2], TRANSFER_PARTS[1], TRANSFER_PARTS[3])
    for part, attribute, colour in parts:
        values = [getattr(trace, attribute) * 1e3 for _, trace in rows]
        text = [f"{part}: {value:,.1f} ms" + (f"<br>{trace.bytes / 1e6:,.2f} MB in {trace.blocks} {trace.unit}s, "
                                              f"{(trace.throughput_mb_s or 0) * 8:,.0f} Mbit/s"
                                              if attribute == "transfer_s" else "")
                for value, (_, trace) in zip(values, rows, strict=True)]
        fig.add_trace(go.Bar(y=names, x=values, orientation="h", name=part, marker_color=colour, text=text,
                             hovertemplate="%{text}<extra></extra>", textposition="none"))
    fig.update_layout(title=title, barmode="stack", xaxis_title="milliseconds since call 1 was sent",
                      yaxis={"autorange": "reversed"}, height=max(260, 40 * len(rows) + 120),
                      legend={"orientation": "h", "y": -0.2})
    return fig


def hol_figure(summary: Mapping, cls: str = "short", title: str | None = None) -> go.Figure:
    """The per-request head-of-line figures of a run's summary, one bar per scenario (and the baseline, `alone`):
    the share of `cls` requests that stalled at least once (left) and each one's worst gap, p50 and p99 over the
    requests (right, log scale)."""
    from plotly.subplots import make_subplots

    blocks = dict(summary.get("scenarios") or {})
    if summary.get("baseline"):
        blocks["alone"] = summary["baseline"]

    def get(block: Mapping, *path: str) -> float | None:
        node: object = block.get(cls)
        for key in path:
            node = node.get(key) if isinstance(node, Mapping) else None
        return node  # type: ignore[return-value]

    names = list(blocks)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=(
        f"{cls} requests that stalled at least once (%)", f"each {cls} request's worst gap (ms)"))
    shares = [get(b, "stalled", "share") for b in blocks.values()]
    fig.add_bar(x=names, y=[None if s is None else 100 * s for s in shares], name="stalled", row=1, col=1,
                marker_color=STALL_COLOUR, text=[f"{get(b, 'stalled', 'requests')} of {get(b, 'stalled', 'of')}"
                                                 for b in blocks.values()])
    for stat, colour in (("p50", "#aec7e8"), ("p99", CLASS_COLOURS.get(cls, "#1f77b4"))):
        fig.add_bar(x=names, y=[get(b, "worst_gap_ms", stat) for b in blocks.values()], name=f"worst gap {stat}",
                    marker_color=colour, row=1, col=2)
    fig.update_yaxes(type="log", row=1, col=2)
    fig.update_layout(title=title or "Head-of-line blocking per request", barmode="group", height=420,
                      legend={"orientation": "h", "y": -0.2})
    return fig
