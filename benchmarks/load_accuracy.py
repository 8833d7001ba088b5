"""How faithful is pdlab's load generator? Sends open-loop load at a stand-in server whose timing is known
(no prefill delay, a fixed gap between tokens) and records how late sends were and how much the measured
TTFT and ITL exceed what the server did. Writes data/results/load-accuracy.json with the environment.

    PYTHONPATH=src python benchmarks/load_accuracy.py [--rates 5 20 50] [--requests 60] [--token-ms 10]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdlab.config import parse_workload
from pdlab.environment import capture as environment
from pdlab.load import PromptBuilder, build_schedule, read_rows, run_load, write_schedule
from pdlab.metrics import itl_values, percentiles, request_metrics
from pdlab.model import resolve
from pdlab.settings import data_dir

PORT = 19900


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=[5.0, 20.0, 50.0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--token-ms", type=float, default=10.0)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=data_dir() / "results" / "load-accuracy.json")
    args = parser.parse_args()

    builder = PromptBuilder(resolve("pdlab-tiny"))
    server = subprocess.Popen([sys.executable, "-m", "pdlab.benchmarks.standin", "--port", str(PORT), "--token-ms",
                               str(args.token_ms)])
    url = f"http://127.0.0.1:{PORT}"
    results = []
    try:
        for _ in range(200):
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        for rate in args.rates:
            spec = parse_workload({"kind": "mixed", "num_requests": args.requests, "rate": rate, "arrival": "poisson",
                                   "short_tokens": 16, "long_fraction": 0, "short_output_tokens": args.output_tokens})
            with tempfile.TemporaryDirectory() as tmp:
                schedule = write_schedule(build_schedule(spec, builder), Path(tmp) / "schedule.jsonl")
                result = run_load(url, schedule, tmp, "pdlab-standin", progress=False)
                rows = read_rows(result.rows_path)
            per = request_metrics(rows)
            itl = percentiles(itl_values(rows), 1000)
            results.append({
                "rate": rate, "requests": args.requests, "completed": int((rows["status"] == "ok").sum()),
                "late_ms": percentiles(rows["late_s"], 1000), "ttft_ms": percentiles(per["ttft_s"], 1000),
                "itl_ms": itl, "itl_excess_p50_ms": itl["p50"] - args.token_ms if itl["p50"] is not None else None,
            })
            print(json.dumps(results[-1]))
    finally:
        server.terminate()
        server.wait(timeout=10)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": "load-accuracy", "server": {"kind": "pdlab.benchmarks.standin", "token_ms": args.token_ms,
                                                        "prefill_ms": 0, "output_tokens": args.output_tokens},
              "results": results, "environment": environment()}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
