"""The raw per-request rows of a load run: one CSV line per request, written as each request ends (so an
interrupted run keeps what it measured), read back into pandas for pdlab.metrics.

Times: `start_time` is wall clock (epoch seconds, to line runs up with logs); `start_s` is monotonic seconds
since the load began; `token_times` and `end_s` are monotonic seconds since the request was sent. A token's
place on a run's timeline is `start_s + token_times[i]`.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pandas is imported where rows are read: the locust process that writes them never needs it
    import pandas as pd

#: Column -> meaning. The one definition of the rows schema (docs/metrics.md repeats it for readers).
COLUMNS: dict[str, str] = {
    "request_id": "schedule id (r00000...)",
    "cls": "short, long or probe",
    "scheduled_s": "planned send time, seconds after the load began",
    "start_s": "actual send time, monotonic seconds after the load began",
    "late_s": "start_s - scheduled_s: how late the sender was (an open-loop check)",
    "start_time": "send time, wall clock (epoch seconds)",
    "prompt_tokens": "prompt length as scheduled (exact, tokenizer-counted)",
    "max_tokens": "requested output length",
    "usage_prompt_tokens": "prompt tokens the server reported (empty if it did not)",
    "usage_completion_tokens": "output tokens the server reported (empty if it did not)",
    "token_times": "JSON list: arrival of each streamed token, seconds after send",
    "end_s": "end of the response (or of the failure), seconds after send",
    "path": "routing path from the router's header (disaggregated/direct), empty without a router",
    "prefill_ms": "P/D path: ms from the router receiving the request to the prefill instance's answer (router's "
                  "header), empty otherwise",
    "http_status": "HTTP status, 0 when no response came",
    "status": "ok, http_error, connection_error, incomplete, timeout, interrupted or client_error",
    "error": "error message, empty when ok",
    "server_request_id": "x-request-id the server answered with",
}

#: Statuses that count as failed requests (everything sent that is not `ok`).
FAILED_STATUSES = ("http_error", "connection_error", "incomplete", "timeout", "interrupted", "client_error")


class RowWriter:
    """Appends rows to a CSV file, one flushed line per request."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._file = self.path.open("a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=list(COLUMNS))
        if new:
            self._writer.writeheader()
            self._file.flush()

    def write(self, row: dict[str, Any]) -> None:
        unknown = row.keys() - COLUMNS.keys()
        if unknown:
            raise KeyError(f"unknown row columns: {', '.join(sorted(unknown))}")
        row = dict(row)
        row["token_times"] = json.dumps([round(t, 6) for t in row.get("token_times") or []])
        self._writer.writerow(row)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_rows(path: str | Path) -> pd.DataFrame:
    """The rows file as a DataFrame, `token_times` decoded into lists of floats."""
    import pandas as pd

    frame = pd.read_csv(path, dtype={"request_id": str, "cls": str, "path": str, "status": str, "error": str,
                                     "server_request_id": str}, keep_default_na=False,
                        na_values={c: [""] for c in COLUMNS if c not in ("request_id", "cls", "path", "status",
                                                                          "error", "server_request_id",
                                                                          "token_times")})
    frame["token_times"] = frame["token_times"].map(lambda text: json.loads(text) if text else [])
    return frame


def rows_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Build a rows DataFrame from dicts (hand-made timelines, notebooks); missing columns are filled."""
    import pandas as pd

    frame = pd.DataFrame(rows)
    if "request_id" not in frame:
        frame["request_id"] = [f"r{i:05d}" for i in range(len(frame))]
    defaults: dict[str, Any] = {"status": "ok", "path": "", "error": "", "http_status": 200, "start_s": 0.0,
                                "scheduled_s": 0.0, "late_s": 0.0, "start_time": 0.0, "cls": "short",
                                "server_request_id": ""}
    for column in COLUMNS:
        if column == "token_times":
            frame[column] = [list(t) if isinstance(t, list) else [] for t in frame.get(column, [None] * len(frame))]
        elif column not in frame:
            frame[column] = defaults.get(column, float("nan"))
        elif column in defaults:
            frame[column] = frame[column].fillna(defaults[column])
    return frame[list(COLUMNS) + [c for c in frame.columns if c not in COLUMNS]]
