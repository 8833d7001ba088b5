"""pdlab.metrics on hand-built token timelines: every expected value is worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest

from pdlab.load.rows import rows_frame
from pdlab.metrics import (
    build_summary,
    gaps,
    gaps_during_prefills,
    goodput_rate,
    itl_values,
    percentiles,
    request_metrics,
    scenario_summary,
    slo_attainment,
    sweep_table,
)


def timeline():
    return rows_frame([
        # short A: gaps 0.1, 0.1, 1.0, 0.1 -> median 0.1, one stall (1.0 > 5 x 0.1); TPOT (1.4 - 0.1) / 4
        {"request_id": "A", "cls": "short", "start_s": 0.0, "token_times": [0.1, 0.2, 0.3, 1.3, 1.4], "path": "direct"},
        # long B: prefill on the timeline [0.25, 1.25]
        {"request_id": "B", "cls": "long", "start_s": 0.25, "token_times": [1.0, 1.05], "path": "disaggregated"},
        # short C: after B's prefill, steady 0.2 s gaps
        {"request_id": "C", "cls": "short", "start_s": 2.0, "token_times": [0.2, 0.4, 0.6], "path": "direct"},
        # short D: the stream broke after one token -> failed, never timed
        {"request_id": "D", "cls": "short", "start_s": 0.5, "token_times": [0.1], "status": "incomplete",
         "error": "stream ended without [DONE]", "path": "direct"},
        # probe E: a one-token answer, no TPOT and no gap
        {"request_id": "E", "cls": "probe", "start_s": 0.0, "token_times": [0.05], "path": "direct"},
    ])


def test_request_metrics_exact():
    per = request_metrics(timeline()).set_index("request_id")
    assert list(per.index) == ["A", "B", "C", "E"]
    assert per.loc["A", "ttft_s"] == pytest.approx(0.1)
    assert per.loc["A", "e2e_s"] == pytest.approx(1.4)
    assert per.loc["A", "tpot_s"] == pytest.approx(0.325)
    assert per.loc["A", "tokens"] == 5
    assert per.loc["A", "median_itl_s"] == pytest.approx(0.1)
    assert per.loc["A", "stalls"] == 1
    assert per.loc["A", "stall_s"] == pytest.approx(1.0)
    assert per.loc["B", "tpot_s"] == pytest.approx(0.05)
    assert per.loc["B", "stalls"] == 0  # a single gap is its own median
    assert per.loc["C", "tpot_s"] == pytest.approx(0.2)
    assert math.isnan(per.loc["E", "tpot_s"])


def test_usage_count_overrides_streamed_chunks_for_tpot():
    rows = rows_frame([{"token_times": [0.1, 0.5], "usage_completion_tokens": 5}])
    # 5 tokens arrived in 2 chunks: TPOT = (0.5 - 0.1) / (5 - 1)
    assert request_metrics(rows)["tpot_s"].iloc[0] == pytest.approx(0.1)


def test_itl_is_every_gap_and_percentiles_interpolate_linearly():
    values = sorted(itl_values(timeline(), "short"))
    assert values == pytest.approx([0.1, 0.1, 0.1, 0.2, 0.2, 1.0])
    stats = percentiles(values, 1000)
    # ranks (n - 1) * q: p50 at 2.5 -> (100 + 200) / 2; p90 at 4.5 -> (200 + 1000) / 2; p99 at 4.95
    assert stats["p50"] == pytest.approx(150.0)
    assert stats["p90"] == pytest.approx(600.0)
    assert stats["p99"] == pytest.approx(960.0)
    assert stats["max"] == pytest.approx(1000.0)
    assert stats["count"] == 6
    assert percentiles([])["p50"] is None


def test_stall_threshold_is_configurable():
    assert gaps(timeline(), stall_k=5)["stall"].sum() == 1
    assert gaps(timeline(), stall_k=12)["stall"].sum() == 0  # 1.0 is not above 12 x 0.1


def test_short_gaps_during_long_prefill():
    during = gaps_during_prefills(timeline())
    # A's gaps on the timeline: [0.1,0.2] [0.2,0.3] [0.3,1.3] [1.3,1.4]; B's prefill [0.25,1.25]
    assert list(during["request_id"]) == ["A", "A"]
    assert list(during["gap_s"]) == pytest.approx([0.1, 1.0])


def test_slo_attainment_counts_failures_as_misses():
    rows = timeline()
    # TTFT <= 0.15 and TPOT <= 0.1: only E (TTFT 0.05, no TPOT) of 5 sent
    assert slo_attainment(rows, ttft_slo_s=0.15, tpot_slo_s=0.1) == pytest.approx(1 / 5)
    # TTFT <= 0.25 and TPOT <= 0.4: A, C and E; B's TTFT is 1.0, D failed
    assert slo_attainment(rows, ttft_slo_s=0.25, tpot_slo_s=0.4) == pytest.approx(3 / 5)


def test_goodput_rate_is_highest_rate_meeting_target():
    good = {"token_times": [0.1, 0.2], "cls": "short"}
    slow = {"token_times": [2.0, 2.1], "cls": "short"}
    sweep = {
        1.0: rows_frame([good] * 10),
        2.0: rows_frame([good] * 9 + [slow]),  # exactly 90%
        3.0: rows_frame([good] * 8 + [slow] * 2),
        4.0: rows_frame([good] * 9 + [slow]),  # non-monotone data: the highest qualifying rate still wins
    }
    assert goodput_rate(sweep, ttft_slo_s=1.0, tpot_slo_s=0.5) == 4.0
    del sweep[4.0]
    assert goodput_rate(sweep, ttft_slo_s=1.0, tpot_slo_s=0.5) == 2.0
    assert goodput_rate(sweep, ttft_slo_s=0.01, tpot_slo_s=0.5) is None


def test_scenario_summary_shape_and_values():
    summary = scenario_summary(timeline(), scheduled=6)
    assert summary["short"]["itl_ms"]["p50"] == pytest.approx(150.0)
    assert summary["short"]["itl_ms"]["max"] == pytest.approx(1000.0)
    assert summary["short"]["ttft_ms"]["p50"] == pytest.approx(150.0)  # A 100, C 200
    assert summary["long"]["ttft_ms"]["p99"] == pytest.approx(1000.0)
    assert summary["stalls"]["count"] == 1
    assert summary["stalls"]["total_ms"] == pytest.approx(1000.0)
    assert summary["short_itl_during_long_prefill_ms"]["count"] == 2
    assert summary["requests"] == {"sent": 5, "completed": 4, "failed": 1, "scheduled": 6, "not_sent": 1,
                                   "by_status": {"incomplete": 1, "ok": 4}, "late_ms_max": 0.0,
                                   "failures": {"incomplete 200: stream ended without [DONE]": 1}}
    assert summary["by_path"]["disaggregated"]["requests"] == 1
    assert summary["by_path"]["direct"]["ttft_ms"]["count"] == 3  # A, C, E


def test_build_summary_has_scenarios_and_baseline():
    rows = timeline()
    summary = build_summary({"colocated": rows, "disaggregated": rows}, baseline=rows[rows["cls"] != "long"])
    assert set(summary["scenarios"]) == {"colocated", "disaggregated"}
    assert "long" not in summary["baseline"]
    assert summary["baseline"]["short"]["itl_ms"]["count"] == 6


def test_summary_of_a_run_where_nothing_completed():
    rows = rows_frame([{"token_times": [0.1], "status": "incomplete"}, {"token_times": [], "status": "timeout"}])
    summary = scenario_summary(rows, scheduled=2)
    assert summary["stalls"]["count"] == 0
    assert summary["short"]["itl_ms"]["p99"] is None
    assert (summary["requests"]["sent"], summary["requests"]["failed"]) == (2, 2)


def test_sweep_table_lines_per_scenario_and_rate():
    rows = timeline()
    table = sweep_table({("b", 2.0): rows, ("a", 1.0): rows}, ttft_slo_s=0.25, tpot_slo_s=0.4)
    assert list(zip(table["scenario"], table["rate"], strict=True)) == [("a", 1.0), ("b", 2.0)]
    assert table["attainment"].tolist() == pytest.approx([0.6, 0.6])
    assert table["short_itl_p99_ms"].tolist() == pytest.approx([960.0, 960.0])
    assert table["short_itl_max_ms"].tolist() == pytest.approx([1000.0, 1000.0])
    assert table["long_ttft_p99_ms"].tolist() == pytest.approx([1000.0, 1000.0])
    assert table["stalls"].tolist() == [1, 1]


def test_each_request_has_its_worst_gap_and_a_class_counts_requests_that_stalled():
    per = request_metrics(timeline()).set_index("request_id")
    assert per.loc["A", "max_gap_s"] == pytest.approx(1.0)
    assert per.loc["C", "max_gap_s"] == pytest.approx(0.2)
    assert math.isnan(per.loc["E", "max_gap_s"])  # one token, no gap
    short = scenario_summary(timeline())["short"]
    # completed shorts A and C: worst gaps 1.0 and 0.2 s -> p50 600 ms (linear), max 1000 ms
    assert short["worst_gap_ms"]["p50"] == pytest.approx(600)
    assert short["worst_gap_ms"]["max"] == pytest.approx(1000)
    # A stalled once, C never: one of the two requests that had a gap to stall in
    assert short["stalled"] == {"requests": 1, "of": 2, "share": 0.5}
    assert scenario_summary(timeline())["probe"]["stalled"] == {"requests": 0, "of": 0, "share": None}


def test_pd_requests_time_after_prefill_is_their_first_token_less_the_routers_prefill_time():
    rows = rows_frame([
        {"request_id": "P1", "cls": "long", "token_times": [1.5, 1.6], "path": "disaggregated", "prefill_ms": "1200"},
        {"request_id": "P2", "cls": "long", "token_times": [0.9, 1.0], "path": "disaggregated", "prefill_ms": 850.0},
        {"request_id": "S", "cls": "short", "token_times": [0.1, 0.2], "path": "direct", "prefill_ms": ""},
    ])
    by_path = scenario_summary(rows)["by_path"]
    after = by_path["disaggregated"]["after_prefill_ms"]
    assert after["count"] == 2 and after["max"] == pytest.approx(300.0) and after["p50"] == pytest.approx(175.0)
    assert "after_prefill_ms" not in by_path["direct"]  # no prefill leg, nothing to subtract
