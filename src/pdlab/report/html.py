"""One self-contained HTML page per run: the key numbers, then the figures (plotly's JS inlined once)."""

from __future__ import annotations

import html
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go

from pdlab.load import rundir
from pdlab.report.figures import itl_cdf_figure, timeline_figure, ttft_by_class_figure

#: The figures the headline table shows, as (label, path into a scenario summary).
HEADLINE = [
    ("short ITL p50 (ms)", ("short", "itl_ms", "p50")),
    ("short ITL p99 (ms)", ("short", "itl_ms", "p99")),
    ("short ITL max (ms)", ("short", "itl_ms", "max")),
    ("short TTFT p50 (ms)", ("short", "ttft_ms", "p50")),
    ("short TTFT p99 (ms)", ("short", "ttft_ms", "p99")),
    ("short stalled (share of requests)", ("short", "stalled", "share")),
    ("short worst gap p50 (ms)", ("short", "worst_gap_ms", "p50")),
    ("short worst gap p99 (ms)", ("short", "worst_gap_ms", "p99")),
    ("long TTFT p50 (ms)", ("long", "ttft_ms", "p50")),
    ("long TTFT p99 (ms)", ("long", "ttft_ms", "p99")),
    ("stalls", ("stalls", "count")),
    ("sent", ("requests", "sent")),
    ("completed", ("requests", "completed")),
    ("failed", ("requests", "failed")),
]


def _dig(data: dict | None, path: tuple[str, ...]) -> object:
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def headline_table(summary: dict) -> pd.DataFrame:
    """Scenarios (and the baseline) as columns, the headline figures as rows."""
    blocks = dict(summary.get("scenarios") or {})
    if summary.get("baseline"):
        blocks["baseline"] = summary["baseline"]
    table = {name: [_dig(block, path) for _, path in HEADLINE] for name, block in blocks.items()}
    return pd.DataFrame(table, index=[label for label, _ in HEADLINE])


def write_report(run_dir: str | Path, figures: list[tuple[str, go.Figure]] | None = None) -> Path:
    """Write `run_dir/report.html` from `summary.json` and each scenario's `rows.csv`; `figures` adds more
    (title, figure) pairs, e.g. sweep curves. Returns the page's path."""
    run_dir = Path(run_dir)
    summary = rundir.read_summary(run_dir)
    stall_k = float(summary.get("stall_k") or 5.0)
    rows = rundir.point_rows(run_dir, summary)
    drawn: list[tuple[str, go.Figure]] = []
    if rows:
        has_short = any((frame["cls"] == "short").any() for frame in rows.values())
        drawn.append(("Inter-token latency", itl_cdf_figure(rows, "short" if has_short else None)))
        drawn.append(("TTFT by class", ttft_by_class_figure(rows)))
        for name, frame in rows.items():
            drawn.append((f"Timeline: {name}", timeline_figure(frame, stall_k, title=f"{name}: request timeline")))
    drawn += figures or []

    status = "complete" if summary.get("complete", True) else "INCOMPLETE (interrupted or failed)"
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>pdlab run {html.escape(str(summary.get('lab', '')))}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}</style></head><body>",
        f"<h1>{html.escape(str(summary.get('lab', 'run')))}: {html.escape(str(summary.get('started', '')))}</h1>",
        f"<p>Status: <b>{html.escape(status)}</b>. Stall: a gap longer than {stall_k:g} x the request's median "
        "inter-token gap. Latencies count completed requests only.</p>",
        headline_table(summary).to_html(float_format=lambda v: f"{v:,.1f}", na_rep="-"),
    ]
    for i, (title, fig) in enumerate(drawn):
        parts.append(f"<h2>{html.escape(title)}</h2>")
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))  # the JS once, inlined
    parts.append("</body></html>")
    out = run_dir / rundir.REPORT
    out.write_text("\n".join(parts))
    return out
