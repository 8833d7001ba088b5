"""pdlab's locust user: sends a precomputed schedule open-loop and streams every response.

Run only as a subprocess (`pdlab.load.run.run_load` does it): importing locust monkey-patches the process with
gevent, which breaks Jupyter kernels and asyncio code.

    python -m locust -f src/pdlab/load/locustfile.py --headless -u 32 -r 32 --host http://127.0.0.1:8000 \
        --pdlab-schedule schedule.jsonl --pdlab-rows rows.csv --pdlab-model pdlab-small

Each user takes the next request of the shared schedule and sleeps until its send time, so arrivals follow
the schedule, not the server's speed (open loop); a request sent late because every user was busy shows up in
the `late_s` column. Requests due at one instant go out in schedule order (`Feed.wait_turn`), each over an open
connection (`ScheduledUser.warm`). Besides the raw rows, TTFT, ITL and E2E are fired as locust request events
(request types `TTFT`, `ITL`, `E2E`, named by class) so locust's own stats and CSV carry them.
"""

from __future__ import annotations

import atexit
import contextlib
import csv
import io
import json
import time
from typing import Any

import gevent
import requests
from gevent.event import Event
from locust import HttpUser, events, task
from locust.exception import StopUser
from locust.stats import PERCENTILES_TO_REPORT, StatsCSV

from pdlab.load.rows import RowWriter
from pdlab.load.schedule import ScheduledRequest, read_schedule
from pdlab.settings import PATH_HEADER, PREFILL_MS_HEADER, REQUEST_ID_HEADER
from pdlab.sse import STREAM_OPTIONS, StreamRecord

#: The longest a request waits for the one due at the same instant before it to leave (`Feed.wait_turn`): past
#: it the load generator is overloaded (`late_s` shows it) or that request's connection stalled.
_TIE_WAIT_S = 0.5
#: A user whose connection will have idled this long by its next send (or that has none yet) opens it first:
#: requests sent over new connections at one instant reached vLLM last-first (measured on a tied burst), and
#: servers close idle connections (uvicorn and vLLM after 5 s unless told otherwise: settings.HTTP_KEEP_ALIVE_S).
_WARM_IF_IDLE_S = 1.0
#: How long before its send time such a user opens the connection.
_WARM_LEAD_S = 0.5


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    parser.add_argument("--pdlab-schedule", required=True, help="schedule file (JSON lines)")
    parser.add_argument("--pdlab-rows", required=True, help="rows CSV to append to")
    parser.add_argument("--pdlab-model", required=True, help="model name to put in requests")
    parser.add_argument("--pdlab-api", default="completions", choices=["completions", "chat"])
    parser.add_argument("--pdlab-timeout", type=float, default=600.0,
                        help="seconds without a byte from the server before a request fails")


class Feed:
    """The schedule shared by all users of this locust process, and the rows file they write to."""

    def __init__(self, schedule: list[ScheduledRequest], rows: RowWriter):
        self.schedule = schedule
        self.rows = rows
        self.next_index = 0
        self.finished = 0
        self.t0: float | None = None
        self.all_done = Event()
        self.sent = [Event() for _ in schedule]
        """Set once each request's body has been written (`SentBody`): requests due at one instant go in schedule
        order (`wait_turn`)."""
        if not schedule:
            self.all_done.set()

    def take(self) -> tuple[int, ScheduledRequest] | None:
        if self.t0 is None:
            self.t0 = time.perf_counter()  # the load begins when the first user asks for work
        if self.next_index >= len(self.schedule):
            return None
        index = self.next_index
        self.next_index += 1
        return index, self.schedule[index]

    def wait_turn(self, index: int) -> None:
        """When the request before `index` is due at the same instant, wait until its bytes have left. Users
        sleeping until one instant wake in no particular order (gevent's timers count from each user's own "now"),
        and a request on its way yields too (urllib3 polls the pooled connection before writing, and gevent's poll
        switches greenlets even with a zero timeout); a trace's tied timestamps must still arrive as the trace lists
        them. Bounded: a late predecessor does not hold this one back for long."""
        if index and self.schedule[index - 1].offset_s == self.schedule[index].offset_s:
            self.sent[index - 1].wait(timeout=_TIE_WAIT_S)

    def finish(self, row: dict[str, Any]) -> None:
        self.rows.write(row)
        self.finished += 1
        if self.finished == len(self.schedule):
            self.all_done.set()


@events.init.add_listener
def _on_init(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    if options is None:
        return
    feed = Feed(read_schedule(options.pdlab_schedule), RowWriter(options.pdlab_rows))
    # The feed lives on the user class: locust creates users itself, so this is how they share one schedule.
    ScheduledUser.feed = feed

    def quit_when_done() -> None:
        feed.all_done.wait()
        if environment.runner is not None:
            environment.runner.quit()

    gevent.spawn(quit_when_done)
    if options.csv_prefix:
        # Locust rewrites its CSV files once a second and not at exit (its shutdown only closes them): write the
        # final statistics after it has closed them, instead of waiting up to a second for its next round.
        atexit.register(_write_final_csvs, environment, options.csv_prefix)


def _write_final_csvs(environment: Any, prefix: str) -> None:
    """`<prefix>_stats.csv`, `_failures.csv` and `_exceptions.csv` with the run's final statistics, by locust's own
    CSV writer (the one its web UI serves them with). `_stats_history.csv` keeps the rows locust appended."""
    writer = StatsCSV(environment, PERCENTILES_TO_REPORT)
    for suffix, write in (("stats", writer.requests_csv), ("failures", writer.failures_csv),
                          ("exceptions", writer.exceptions_csv)):
        with open(f"{prefix}_{suffix}.csv", "w", newline="") as file:
            write(csv.writer(file))


@events.quit.add_listener  # not `quitting`: that fires before the users are stopped and write their last rows
def _on_quit(**_: Any) -> None:
    feed = getattr(ScheduledUser, "feed", None)
    if feed is not None:
        feed.rows.close()


class ScheduledUser(HttpUser):
    """Sends the next scheduled request at its time, streams the answer, records one row."""

    feed: Feed
    idle_since: float = float("-inf")
    """When this user's connection last finished an exchange (-inf: it has none yet)."""

    def wait_time(self) -> float:
        return 0.0

    def on_start(self) -> None:
        self.warm()

    @task
    def send_next(self) -> None:
        taken = self.feed.take()
        if taken is None:
            raise StopUser()
        index, item = taken
        assert self.feed.t0 is not None
        send_at = self.feed.t0 + item.offset_s
        if send_at - self.idle_since > _WARM_IF_IDLE_S:
            gevent.sleep(max(0.0, send_at - _WARM_LEAD_S - time.perf_counter()))
            self.warm()
        delay = send_at - time.perf_counter()
        if delay > 0:
            gevent.sleep(delay)
        self.feed.wait_turn(index)
        try:
            self.feed.finish(self.send(item, self.feed.sent[index]))
        finally:
            self.feed.sent[index].set()  # a request that failed before writing does not hold the next one back
        self.idle_since = time.perf_counter()

    def warm(self) -> None:
        """Open (or re-open) the connection with a GET of the OpenAI model list, which every server here answers.
        Sent with requests' own Session.send: the same connection pool, but no locust request event, so locust's
        statistics hold the schedule's requests only."""
        # Whatever fails is ignored (the send opens its own): a user that raised here would stop, and its share of
        # the load with it.
        with contextlib.suppress(Exception):
            self.client.send(requests.Request("GET", f"{self.host}/v1/models").prepare(), timeout=5).close()
        self.idle_since = time.perf_counter()

    def body(self, item: ScheduledRequest) -> tuple[str, dict[str, Any]]:
        options = self.environment.parsed_options
        common = {"model": options.pdlab_model, "max_tokens": item.max_tokens, "temperature": 0.0,
                  "ignore_eos": True, "stream": True, "stream_options": STREAM_OPTIONS}
        if options.pdlab_api == "chat":
            return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": item.prompt}]}
        return "/v1/completions", {**common, "prompt": item.prompt}

    def send(self, item: ScheduledRequest, sent: Event) -> dict[str, Any]:
        """Send `item`, stream its answer, return its row; `sent` is set once the request's bytes have left."""
        path, body = self.body(item)
        record = StreamRecord()
        row: dict[str, Any] = {"request_id": item.request_id, "cls": item.cls, "scheduled_s": item.offset_s,
                               "prompt_tokens": item.prompt_tokens, "max_tokens": item.max_tokens,
                               "http_status": 0, "path": "", "prefill_ms": "", "error": "", "server_request_id": ""}
        start = time.perf_counter()
        row["start_time"] = time.time()
        row["start_s"] = round(start - self.feed.t0, 6)
        row["late_s"] = round(row["start_s"] - item.offset_s, 6)
        status = "ok"
        try:
            with self.client.post(path, data=SentBody(body, sent), stream=True, catch_response=True, name=f"{item.cls}",
                                  headers={REQUEST_ID_HEADER: item.request_id, "Content-Type": "application/json"},
                                  timeout=self.environment.parsed_options.pdlab_timeout) as response:
                row["http_status"] = response.status_code or 0
                row["path"] = response.headers.get(PATH_HEADER, "") if response.status_code else ""
                row["server_request_id"] = response.headers.get(REQUEST_ID_HEADER, "") if response.status_code else ""
                row["prefill_ms"] = response.headers.get(PREFILL_MS_HEADER, "") if response.status_code else ""
                if not response.status_code:
                    timed_out = _is_timeout(response.error)
                    status, row["error"] = ("timeout" if timed_out else "connection_error"), str(response.error)
                elif response.status_code >= 400:
                    status, row["error"] = "http_error", _error_message(response)
                else:
                    try:
                        for line in response.iter_lines():
                            record.feed(line, time.perf_counter() - start)
                    except Exception as error:  # the server died, cut the stream, or was too slow
                        record.error = f"{type(error).__name__}: {error}"
                        status = "timeout" if _is_timeout(error) else "incomplete"
                    if not record.complete:
                        status = "incomplete" if status == "ok" else status
                        row["error"] = record.error or "stream ended without [DONE]"
                if status == "ok":
                    response.success()
                else:
                    response.failure(row["error"] or status)
        except gevent.GreenletExit:
            status, row["error"] = "interrupted", "the load was stopped before the answer ended"
            raise
        except Exception as error:  # whatever went wrong, the request was sent: it must still get its row
            status, row["error"] = "client_error", f"{type(error).__name__}: {error}"
        finally:
            row["end_s"] = round(time.perf_counter() - start, 6)
            row["status"] = status
            row["token_times"] = record.token_times
            row["usage_prompt_tokens"] = record.usage_prompt_tokens
            row["usage_completion_tokens"] = record.usage_completion_tokens
            if status == "interrupted":
                self.feed.finish(row)
        if status == "ok":
            self.fire_latencies(item.cls, record.token_times)
        return row

    def fire_latencies(self, cls: str, times: list[float]) -> None:
        """TTFT, every ITL and E2E as locust request events, so locust's UI and CSV show them per class."""
        if not times:
            return
        fire = self.environment.events.request.fire
        fire(request_type="TTFT", name=cls, response_time=times[0] * 1000, response_length=0, exception=None,
             context={})
        for before, after in zip(times, times[1:], strict=False):
            fire(request_type="ITL", name=cls, response_time=(after - before) * 1000, response_length=0,
                 exception=None, context={})
        fire(request_type="E2E", name=cls, response_time=times[-1] * 1000, response_length=0, exception=None,
             context={})


class SentBody(io.BytesIO):
    """A request's JSON body that sets `sent` when read to its end: urllib3 reads a file body chunk by chunk,
    writing each before reading the next, so the end is read once the last byte is in the socket. requests sizes it
    (Content-Length), so it goes out exactly as `json=` would."""

    def __init__(self, body: dict[str, Any], sent: Event):
        super().__init__(json.dumps(body).encode())
        self.sent = sent

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        if not data:
            self.sent.set()
        return data


def _is_timeout(error: BaseException | None) -> bool:
    """Whether a read or connect timeout is behind `error` (requests wraps urllib3's ReadTimeoutError raised
    mid-stream in a ConnectionError, so the chain and the wrapped arguments are searched)."""
    seen: set[int] = set()
    stack: list[object] = [error]
    while stack:
        item = stack.pop()
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, TimeoutError) or "timeout" in type(item).__name__.lower():
            return True
        stack += [item.__cause__, item.__context__, *item.args]
    return False


def _error_message(response: Any) -> str:
    try:
        error = response.json().get("error", {})
        return error.get("message", "") if isinstance(error, dict) else str(error)
    except Exception:
        return (response.text or "")[:200]
