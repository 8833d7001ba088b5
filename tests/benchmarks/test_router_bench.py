"""The overhead benchmark runs end to end (tiny numbers) and writes the documented JSON shape."""

from __future__ import annotations

import json

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
