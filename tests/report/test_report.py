"""pdlab.report's figures on a hand-built timeline (the same one as tests/metrics/test_metrics.py)."""

from __future__ import annotations

import pandas as pd
import pytest

from pdlab.report import (
    itl_cdf_figure,
    sweep_figure,
    timeline_figure,
    ttft_by_class_figure,
    validation_figure,
    validation_summary,
)
from tests.metrics.test_metrics import timeline


def test_timeline_marks_ttft_tokens_stalls_failures_and_long_prefills():
    fig = timeline_figure(timeline())
    by_name = {trace.name: trace for trace in fig.data}
    stall = next(trace for name, trace in by_name.items() if name.startswith("stall"))
    assert [x for x in stall.x if x is not None] == pytest.approx([0.3, 1.3])  # A's 1.0 s gap
    assert len(by_name["short: tokens"].x) == 5 + 1 + 3  # A, D (its one token before the stream broke), C
    assert list(by_name["failed"].text) == ["incomplete: stream ended without [DONE]"]
    shapes = [shape for shape in fig.layout.shapes if shape.type == "rect"]
    assert [v for s in shapes for v in (s.x0, s.x1)] == pytest.approx([0.25, 1.25])  # B's prefill
    assert list(fig.layout.yaxis.ticktext) == ["A short", "E probe", "B long", "D short", "C short"]


def test_timeline_marks_the_prefill_answer_of_pd_requests():
    rows = timeline()
    assert "prefill answered (P/D)" not in {trace.name for trace in timeline_figure(rows).data}
    rows["prefill_ms"] = [float("nan")] * len(rows)
    b = rows.index[rows["request_id"] == "B"][0]
    rows.loc[b, "prefill_ms"] = 600.0
    [marker] = [t for t in timeline_figure(rows).data if t.name == "prefill answered (P/D)"]
    first = rows.loc[b, "start_s"] + rows.loc[b, "token_times"][0]
    assert list(marker.x) == pytest.approx([rows.loc[b, "start_s"] + 0.6])
    assert f"then {first - rows.loc[b, 'start_s'] - 0.6:.2f} s" in marker.text[0]


def test_itl_cdf_has_one_step_per_gap_and_ends_at_one():
    fig = itl_cdf_figure({"one": timeline(), "two": timeline()})
    assert [trace.name for trace in fig.data] == ["one", "two"]
    assert list(fig.data[0].x) == pytest.approx([100, 100, 100, 200, 200, 1000])
    assert fig.data[0].y[-1] == 1.0


def test_ttft_by_class_and_sweep_figures():
    fig = ttft_by_class_figure({"s": timeline()})
    assert sorted(fig.data[0].y) == pytest.approx([50, 100, 200, 1000])
    sweep = pd.DataFrame({"scenario": ["a", "a", "b"], "rate": [2.0, 1.0, 1.0], "attainment": [0.5, 1.0, 0.95]})
    fig = sweep_figure(sweep, y="attainment", target=0.9)
    assert list(fig.data[0].x) == [1.0, 2.0]
    assert [trace.name for trace in fig.data] == ["a", "b"]


def test_validation_figure_puts_each_metric_at_measured_simulated_with_its_interval():
    result = {"goal_pct": 10.0, "runs": [{"run": "data/sim-runs/lab/20261130-000000/colocated", "errors": {
        "short.ttft_ms.p50": {"measured": 40.0, "simulated": 44.0, "error_pct": 10.0, "measured_ci95": [38.0, 45.0]},
        "short.itl_ms.p99": {"measured": 20.0, "simulated": 15.0, "error_pct": 25.0, "measured_ci95": [19.0, 22.0],
                             "per_run_measured": [18.5, 21.0, 14.0]},
        "long.ttft_ms.p50": {"measured": 1500.0, "simulated": 1400.0, "error_pct": 6.7}}}]}
    fig = validation_figure(result)
    band, diagonal, *points = fig.data
    assert band.fill == "toself" and list(diagonal.x) == list(diagonal.y)
    by_name = {trace.name: trace for trace in points}
    assert set(by_name) == {"ITL p99", "TTFT p50"}
    ttft = by_name["TTFT p50"]
    assert list(ttft.x) == [40.0, 1500.0] and list(ttft.y) == [44.0, 1400.0]
    assert list(ttft.error_x.arrayminus) == [2.0, 0.0] and list(ttft.error_x.array) == [5.0, 0.0]
    assert "lab/20261130-000000/colocated" in ttft.text[0] and "10.0% off" in ttft.text[0]
    assert "each run's own" not in ttft.text[0]  # not pooled: nothing beside the one run
    assert "each run's own: 18.5, 21.0, 14.0" in by_name["ITL p99"].text[0]
    assert fig.layout.xaxis.type == fig.layout.yaxis.type == "log"



def test_validation_summary_says_what_the_record_holds():
    bare = {"goal_pct": 10.0, "within_goal": 3, "metrics": 4, "median_error_pct": 4.04, "max_error_pct": 23.44,
            "sampling": None, "each_run": None}
    assert validation_summary(bare) == "3/4 metrics within 10%, median error 4.0%, max 23.4%"
    full = bare | {"sampling": {"simulator_within_ci": 2, "metrics": 4},
                   "each_run": {"runs": 3, "simulator_between": 1, "within_goal_or_between": 4, "metrics": 4}}
    assert validation_summary(full) == ("3/4 metrics within 10%, median error 4.0%, max 23.4%; inside the measured 95% "
                                        "interval: 2/4; within 10% or between the 3 runs' own values: 4/4")


def test_transfer_figure_lays_each_connectors_parts_in_the_order_they_happen():
    """NIXL's read comes between two waits (drawn: prefill, wait, transfer, step); LMCache's push right after the
    prefill, then the wait for the load (drawn: prefill, transfer, wait, step). Hovering the KV part says what
    moved, in the connector's own unit."""
    from pdlab.metrics.kv import TransferTrace
    from pdlab.report.figures import transfer_figure

    common = {"prompt_tokens": 1000, "prefill_s": 0.15, "decode_first_token_s": 0.9, "transfer_s": 0.8,
              "bytes": 4.19e6, "step_s": 0.01}
    pushed = TransferTrace(**common, blocks=4, block_tokens=256, connector="lmcache")
    pulled = TransferTrace(**common, blocks=8)
    assert (pushed.unit, pulled.unit, pulled.block_tokens) == ("chunk", "block", 128)
    assert pushed.wait_s == pytest.approx(0.09)
    lmcache = transfer_figure({"40 Mbit/s": [pushed]})
    assert [bar.name for bar in lmcache.data] == ["prefill", "KV transfer", "wait", "first decode step"]
    assert "4.19 MB in 4 chunks" in lmcache.data[1].text[0]
    nixl = transfer_figure({"40 Mbit/s": [pulled]})
    assert [bar.name for bar in nixl.data] == ["prefill", "wait", "KV transfer", "first decode step"]
    assert "in 8 blocks" in nixl.data[2].text[0]
