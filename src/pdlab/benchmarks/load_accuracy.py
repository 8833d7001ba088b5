"""How faithful is pdlab's load generator? Sends open-loop load at a stand-in server whose timing is known
(no prefill delay, a fixed gap between tokens) and records how late sends were and how much the measured TTFT and
ITL exceed what the server did (`pdlab bench load-accuracy`).
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdlab.config import parse_workload
from pdlab.deploy.process import serving
from pdlab.load import PromptBuilder, build_schedule, read_rows, run_load, write_schedule
from pdlab.metrics import itl_values, percentiles, request_metrics
from pdlab.model import resolve

PORT = 19900


def run(rates: Sequence[float] = (5.0, 20.0, 50.0), requests: int = 60, token_ms: float = 10.0,
        output_tokens: int = 32, log_dir: Path | None = None) -> dict[str, Any]:
    """Poisson load of `requests` 16-token prompts at each rate against a stand-in streaming a token every
    `token_ms`; per rate: completed requests, how late sends were, TTFT and ITL (ms), and ITL beyond the server's."""
    builder = PromptBuilder(resolve("pdlab-tiny"))
    url = f"http://127.0.0.1:{PORT}"
    argv = [sys.executable, "-m", "pdlab.benchmarks.standin", "--port", str(PORT), "--token-ms", str(token_ms)]
    results = []
    with tempfile.TemporaryDirectory() as tmp, serving("standin", argv, f"{url}/health",
                                                        (log_dir or Path(tmp)) / "standin.log"):
        for rate in rates:
            spec = parse_workload({"kind": "mixed", "num_requests": requests, "rate": rate, "arrival": "poisson",
                                   "short_tokens": 16, "long_fraction": 0, "short_output_tokens": output_tokens})
            run_dir = Path(tmp) / f"rate-{rate:g}"
            schedule = write_schedule(build_schedule(spec, builder), run_dir / "schedule.jsonl")
            rows = read_rows(run_load(url, schedule, run_dir, "pdlab-standin", progress=False).rows_path)
            per = request_metrics(rows)
            itl = percentiles(itl_values(rows), 1000)
            results.append({
                "rate": rate, "requests": requests, "completed": int((rows["status"] == "ok").sum()),
                "late_ms": percentiles(rows["late_s"], 1000), "ttft_ms": percentiles(per["ttft_s"], 1000),
                "itl_ms": itl, "itl_excess_p50_ms": itl["p50"] - token_ms if itl["p50"] is not None else None,
            })
    return {"server": {"kind": "pdlab.benchmarks.standin", "token_ms": token_ms, "prefill_ms": 0,
                       "output_tokens": output_tokens}, "results": results}
