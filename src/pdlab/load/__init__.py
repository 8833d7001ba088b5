"""What to send and when (pdlab.load): exact-length prompts, a precomputed open-loop schedule, and a locust
subprocess that streams every request and writes one raw row per request.

    builder = PromptBuilder(model_dir)
    schedule = build_schedule(workload, builder)
    write_schedule(schedule, run_dir / "schedule.jsonl")
    result = run_load(base_url, run_dir / "schedule.jsonl", run_dir, model=served_model)
    rows = read_rows(result.rows_path)

Locust itself is only ever imported by the locust subprocess (`pdlab/load/locustfile.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdlab import lazy_names

if TYPE_CHECKING:
    from pdlab.load.prompts import PromptBuilder, PromptError
    from pdlab.load.rows import COLUMNS, FAILED_STATUSES, RowWriter, read_rows, rows_frame
    from pdlab.load.run import LoadResult, run_load
    from pdlab.load.schedule import ScheduledRequest, build_schedule, read_schedule, write_schedule
    from pdlab.sse import StreamRecord

__getattr__ = lazy_names(__name__, {
    "pdlab.load.prompts": ("PromptBuilder", "PromptError"),
    "pdlab.load.rows": ("COLUMNS", "FAILED_STATUSES", "RowWriter", "read_rows", "rows_frame"),
    "pdlab.load.run": ("LoadResult", "run_load"),
    "pdlab.load.schedule": ("ScheduledRequest", "build_schedule", "read_schedule", "write_schedule"),
    "pdlab.sse": ("StreamRecord",),
})


__all__ = [
    "COLUMNS",
    "FAILED_STATUSES",
    "LoadResult",
    "PromptBuilder",
    "PromptError",
    "RowWriter",
    "ScheduledRequest",
    "StreamRecord",
    "build_schedule",
    "read_rows",
    "read_schedule",
    "rows_frame",
    "run_load",
    "write_schedule",
]
