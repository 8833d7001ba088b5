"""The overhead benchmark runs end to end (tiny numbers) and writes the documented JSON shape."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from pdlab.benchmarks.router import run_router_bench, vllm_router_executable


def test_bench_writes_the_documented_shape(tmp_path):
    result = run_router_bench(tmp_path, requests=20, warmup=2, rounds=2, base_port=18600)
    written = json.loads((tmp_path / "router-overhead.json").read_text())
    assert written == result
    targets = {"direct", "pdlab", "pdlab_direct_path"}
    if vllm_router_executable():
        targets |= {"vllm_router", "vllm_router_direct_path"}
    assert set(written["concurrency"]) == {"1", "8"}
    for point in written["concurrency"].values():
        assert set(point) == targets
        for entry in point.values():
            assert 0 < entry["ttfb_ms"]["p50"] <= entry["ttfb_ms"]["p99"]
            assert entry["rps"] > 0 and entry["requests"] == 20
    assert written["summary"]["pdlab"]["rps_ratio_at_c8"] > 0
    assert written["environment"]["git"]["commit"]
    assert written["environment"]["packages"]["pdlab"]


def test_a_port_in_use_is_a_clear_error_not_a_measurement_of_someone_else(tmp_path):
    """A server left on one of the benchmark's ports would answer its health checks and be measured instead."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 18652))
        held.listen()
        done = subprocess.run([str(Path(sys.executable).parent / "pdlab"), "bench", "router", "--requests", "10",
                               "--base-port", "18650", "--out", str(tmp_path / "out")],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "18652" in done.stderr and "--base-port" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out" / "router-overhead.json").exists()
