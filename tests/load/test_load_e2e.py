"""Each workload, for a few seconds, through the router of a real 1P1D vLLM deployment: every request is
recorded with its tokens' times and routing path, and the run directory is complete."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from pdlab.config import parse_workload
from pdlab.experiment.runner import ExperimentRun
from pdlab.load import PromptBuilder, ScheduledRequest, read_rows, run_load, write_schedule
from pdlab.settings import data_dir
from tests.conftest import ROUTER_THRESHOLD

pytestmark = pytest.mark.e2e

WORKLOADS = {
    "mixed": {"kind": "mixed", "seed": 1, "rate": 2.0, "duration_s": 4, "short_tokens": 24,
              "long_tokens": ROUTER_THRESHOLD + 100, "long_fraction": 0.4, "short_output_tokens": 8,
              "long_output_tokens": 4},
    "trace": {"kind": "trace", "path": str(data_dir() / "traces" / "mooncake-conversation-500.jsonl"),
              "num_requests": 6, "time_scale": 0.05, "length_scale": 0.02, "max_output_tokens": 8,
              "long_threshold_tokens": ROUTER_THRESHOLD},
    "probe": {"kind": "probe", "rate": 4.0, "duration_s": 2, "prompt_tokens": 12, "output_tokens": 6},
}


@pytest.mark.parametrize("kind", list(WORKLOADS))
def test_workload_runs_against_the_real_deployment(live_1p1d, tmp_path, kind):
    dep = live_1p1d
    workload = parse_workload(WORKLOADS[kind])
    with ExperimentRun(f"pytest-{kind}", workload, runs_root=tmp_path, progress=False) as run:
        rows = run.measure(kind, dep.router_url, model=dep.served_model, model_dir=dep.model_dir,
                           kv_urls=dep.urls("decode"))
    assert len(rows) == run.scheduled[kind] > 0
    assert (rows["status"] == "ok").all(), rows.loc[rows["status"] != "ok", ["status", "error"]]
    assert (rows["usage_prompt_tokens"] == rows["prompt_tokens"]).all()
    assert (rows["usage_completion_tokens"] == rows["max_tokens"]).all()
    for _, row in rows.iterrows():
        # One time per token, also when vLLM merged a lagging stream's tokens into one chunk (pdlab.sse).
        assert len(row["token_times"]) == row["max_tokens"]
        expected = "disaggregated" if row["prompt_tokens"] >= ROUTER_THRESHOLD else "direct"
        assert row["path"] == expected
        if expected == "disaggregated":  # the router's prefill time is part of the TTFT the client saw
            assert 0 < row["prefill_ms"] < row["token_times"][0] * 1e3
        else:
            assert pd.isna(row["prefill_ms"])
    summary = json.loads((run.dir / "summary.json").read_text())
    assert summary["complete"] is True
    assert summary["scenarios"][kind]["requests"]["completed"] == len(rows)
    assert (run.dir / "report.html").stat().st_size > 10_000
    if (rows["path"] == "disaggregated").any():
        assert summary["kv_transfer"][kind]["bytes"] > 0


def test_a_tied_burst_is_served_in_schedule_order(live_1p1d, tmp_path):
    """Prompts due at one instant (a trace's tied timestamps) reach vLLM in about the schedule's order (users that
    sleep until one instant wake in no particular order: pdlab.load.locustfile). Straight at the decode instance, which
    prefills them itself: what is tested is the load generator, not the router's own upstream connections."""
    dep = live_1p1d
    builder = PromptBuilder(dep.model_dir)
    # Near vLLM's 2,048-token step budget each: every step finishes one prompt, so first tokens come in service order.
    first = ScheduledRequest("r00000", 0.0, "short", builder.prompt(16, key="tied/first"), 16, 2)
    burst = [ScheduledRequest(f"r{i:05d}", 1.0, "short", builder.prompt(2000, key=f"tied/{i}"), 2000, 2)
             for i in range(1, 7)]  # due 1 s in: the users sleep until then
    items = [first, *burst]
    result = run_load(dep.urls("decode")[0], write_schedule(items, tmp_path / "schedule.jsonl"), tmp_path,
                      dep.served_model, progress=False)
    rows = read_rows(result.rows_path)
    assert (rows["status"] == "ok").all(), rows.loc[rows["status"] != "ok", ["status", "error"]]
    rows = rows[rows["request_id"] != first.request_id]
    served = rows.assign(at=rows["start_s"] + rows["token_times"].map(lambda times: times[0])).sort_values("at")
    order = served["request_id"].map(lambda request_id: int(request_id[1:])).tolist()
    # vLLM's API server itself may swap two requests that arrive within a millisecond (it tokenizes them
    # concurrently): allow a few swapped pairs of the 15, where a burst taken last-first has all 15 swapped.
    swapped = sum(later < earlier for i, earlier in enumerate(order) for later in order[i + 1:])
    assert swapped <= 3, f"served in order {order}"
