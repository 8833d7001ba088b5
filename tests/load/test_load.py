"""pdlab.load against the stand-in OpenAI server as a real process: SSE parsing on live streams, locust's own
statistics, exact failure and lost-request counts, and a head-of-line stall made visible."""

from __future__ import annotations

import csv

import httpx
import pytest

from pdlab.config import parse_workload
from pdlab.load import COLUMNS, PromptBuilder, ScheduledRequest, build_schedule, read_rows, run_load, write_schedule
from pdlab.metrics import gaps_during_prefills, request_metrics, scenario_summary
from pdlab.model import resolve
from tests.standin_process import standin

PORTS = iter(range(19100, 19200))


@pytest.fixture(scope="module")
def builder() -> PromptBuilder:
    return PromptBuilder(resolve("pdlab-tiny"))


def schedule_file(builder, tmp_path, **workload):
    spec = parse_workload({"kind": "mixed", "short_tokens": 16, "long_fraction": 0, "short_output_tokens": 10,
                           **workload})
    return write_schedule(build_schedule(spec, builder), tmp_path / "schedule.jsonl")


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_streams_are_timed_token_by_token(builder, tmp_path, api):
    schedule = schedule_file(builder, tmp_path, num_requests=6, rate=30, api=api)
    with standin(next(PORTS), "--token-ms", "2", "--path-header", "direct") as url:
        result = run_load(url, schedule, tmp_path, "pdlab-standin", api=api, progress=False)
    rows = read_rows(result.rows_path)
    assert list(rows.columns) == list(COLUMNS)
    assert (result.scheduled, result.recorded, result.interrupted) == (6, 6, False)
    assert set(rows["status"]) == {"ok"}
    assert all(len(times) == 10 and times == sorted(times) for times in rows["token_times"])
    assert set(rows["usage_completion_tokens"]) == {10}
    assert set(rows["path"]) == {"direct"}
    assert list(rows.sort_values("request_id")["server_request_id"]) == sorted(rows["request_id"])
    assert (rows["late_s"] < 1.0).all()

    # TTFT, ITL and E2E also reached locust's own statistics, per class
    with (tmp_path / "locust_stats.csv").open() as stats_file:
        stats = {(row["Type"], row["Name"]): int(row["Request Count"]) for row in csv.DictReader(stats_file)}
    assert stats[("TTFT", "short")] == 6
    assert stats[("ITL", "short")] == 6 * 9
    assert stats[("E2E", "short")] == 6


def test_a_burst_reaches_the_server_in_schedule_order(builder, tmp_path):
    """Requests due at one instant (a trace's tied timestamps) must arrive in schedule order: a burst at the start,
    and one after the server closed the idle connections and while it is busy (a blocking prefill). Users sleeping
    until one instant wake in no particular order, and used to send in it; a request on its way also yields to the
    others before its bytes leave (urllib3's connection check). The stand-in runs on asyncio's loop: uvloop may hand
    requests that arrived together to the app last-first, which no client can prevent."""
    burst = ["hello"] * 8
    prompts = [*burst, "word " * 4000, *burst]  # the long one blocks the server for 0.4 s from 1.8 s on
    offsets = [0.0] * 8 + [1.8] + [2.0] * 8
    items = [ScheduledRequest(f"r{i:05d}", offset, "short", prompt, len(prompt.split()) + 1, 2)
             for i, (offset, prompt) in enumerate(zip(offsets, prompts, strict=True))]
    schedule = write_schedule(items, tmp_path / "schedule.jsonl")
    with standin(next(PORTS), "--keep-alive-s", "1", "--blocking-prefill", "--prefill-us-per-token", "100",
                 "--event-loop", "asyncio") as url:
        result = run_load(url, schedule, tmp_path, "pdlab-standin", progress=False)
        received = [r["request_id"] for r in httpx.get(url + "/standin/records").json()["requests"]
                    if r["path"] == "/v1/completions"]
    assert result.recorded == len(items)
    assert received == [item.request_id for item in items]


def test_http_failures_are_counted_exactly(builder, tmp_path):
    schedule = schedule_file(builder, tmp_path, num_requests=9, rate=50)
    with standin(next(PORTS), "--fail-every", "3") as url:
        result = run_load(url, schedule, tmp_path, "pdlab-standin", progress=False)
    rows = read_rows(result.rows_path)
    failed = rows[rows["status"] != "ok"]
    assert len(failed) == 3
    assert set(failed["http_status"]) == {500}
    assert set(failed["error"]) == {"injected failure"}
    counts = scenario_summary(rows, scheduled=result.scheduled)["requests"]
    assert (counts["sent"], counts["completed"], counts["failed"], counts["not_sent"]) == (9, 6, 3, 0)


def test_a_server_dying_mid_stream_loses_every_request_and_each_is_counted(builder, tmp_path):
    schedule = schedule_file(builder, tmp_path, num_requests=5, rate=50, arrival="uniform")
    with standin(next(PORTS), "--token-ms", "20", "--die-after-tokens", "3") as url:
        result = run_load(url, schedule, tmp_path, "pdlab-standin", progress=False)
    rows = read_rows(result.rows_path)
    assert result.recorded == 5
    assert set(rows["status"]) <= {"incomplete", "connection_error"}
    assert "incomplete" in set(rows["status"])  # at least the request that was streaming when it died
    counts = scenario_summary(rows, scheduled=result.scheduled)["requests"]
    assert (counts["sent"], counts["completed"], counts["failed"], counts["not_sent"]) == (5, 0, 5, 0)


def test_a_blocking_prefill_shows_as_stalls_in_short_streams(builder, tmp_path):
    long_prompt = builder.prompt(3000, key="long")
    items = [ScheduledRequest(f"r{i:05d}", 0.02 * i, "short", builder.prompt(16, key=f"s{i}"), 16, 60)
             for i in range(3)]
    items.append(ScheduledRequest("r00003", 0.15, "long", long_prompt, 3000, 4))
    schedule = write_schedule(items, tmp_path / "schedule.jsonl")
    # ~2,600 words x 200 us: the stand-in holds every stream for about half a second
    with standin(next(PORTS), "--token-ms", "5", "--prefill-us-per-token", "200", "--blocking-prefill") as url:
        result = run_load(url, schedule, tmp_path, "pdlab-standin", progress=False)
    rows = read_rows(result.rows_path)
    assert set(rows["status"]) == {"ok"}
    per = request_metrics(rows).set_index("request_id")
    assert all(per.loc[f"r{i:05d}", "stalls"] >= 1 for i in range(3))
    during = gaps_during_prefills(rows)
    assert set(during["request_id"]) == {"r00000", "r00001", "r00002"}
    assert during["stall"].any()


def test_an_empty_schedule_finishes_with_no_rows(tmp_path):
    schedule = write_schedule([], tmp_path / "schedule.jsonl")
    with standin(next(PORTS)) as url:
        result = run_load(url, schedule, tmp_path, "pdlab-standin", progress=False)
    assert (result.scheduled, result.recorded, result.interrupted) == (0, 0, False)
    assert read_rows(result.rows_path).empty


def test_a_silent_server_times_requests_out(builder, tmp_path):
    schedule = schedule_file(builder, tmp_path, num_requests=2, rate=20, short_output_tokens=3)
    with standin(next(PORTS), "--token-ms", "1500") as url:
        result = run_load(url, schedule, tmp_path, "pdlab-standin", timeout_s=0.5, progress=False)
    rows = read_rows(result.rows_path)
    assert list(rows["status"]) == ["timeout", "timeout"]
    assert all(len(times) == 1 for times in rows["token_times"])  # the first token came, then nothing
