"""`pdlab bench streams` against a stand-in server (a real process on loopback), its slope, and the simulator's
side of it (`pdlab sim calibrate --streams-probe`): the per-stream request overhead is what the measured slope
has beyond the simulated one."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from pdlab.benchmarks.streams import STREAM_TOKENS, check_streams, load_points, run, slope_per_stream
from pdlab.calibration.calibrate import per_stream_overhead_s, streams_probe_ttft
from pdlab.cli import app
from pdlab.sim.costs import FittedCost, ServingOverheads
from tests.standin_process import free_port, standin


def running(url: str) -> float:
    """The requests a stand-in is serving (its vLLM-style gauge)."""
    [line] = [line for line in httpx.get(url + "/metrics").text.splitlines()
              if line.startswith("vllm:num_requests_running{")]
    return float(line.split()[-1])


def test_short_prompts_are_timed_beside_each_count_of_running_streams(tmp_path: Path) -> None:
    with standin(free_port(), "--token-ms", "5", "--prefill-us-per-token", "100") as url:
        result = run([("standin", "decode", url)], [0, 1, 3], repeats=3, out=tmp_path / "streams.json",
                     progress=False)
        with pytest.raises(FileExistsError, match="does not overwrite"):
            run([("standin", "decode", url)], [1, 2], repeats=1, out=tmp_path / "streams.json", progress=False)
        asked = [r["max_tokens"] for r in httpx.get(url + "/standin/records").json()["requests"]]
        # every stream is closed once its count's probes are done: the stand-in sees it at its next token, long
        # before its 2,000 tokens (10 s) would have ended it
        deadline = time.monotonic() + 5
        while running(url) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running(url) == 0
    assert sorted(asked) == [1] * 9 + [STREAM_TOKENS] * 4  # 0 + 1 + 3 streams, 3 probes per count
    [probed] = result["instances"]
    assert [p["streams"] for p in probed["points"]] == [0, 1, 3]
    assert all(len(p["ttft_s"]) == 3 and min(p["ttft_s"]) > 0 for p in probed["points"])
    assert probed["slope_ms_per_stream"] == pytest.approx(
        slope_per_stream([(p["streams"], p["median_ttft_s"]) for p in probed["points"]]) * 1e3)
    [loaded] = load_points(Path(result["path"]))
    assert loaded["role"] == "decode" and loaded["prompt_tokens"] > 0
    written = json.loads(Path(result["path"]).read_text())
    assert written["benchmark"] == "streams" and "git" in written["environment"]


def test_the_slope_leaves_out_the_idle_instance_and_bad_counts_are_refused(tmp_path: Path) -> None:
    assert slope_per_stream([(0, 1.0), (1, 0.030), (2, 0.035), (4, 0.045)]) == pytest.approx(0.005)
    for bad in ([0, 1], [2, 1, 4], [1, 1, 2], [-1, 1, 2], []):
        with pytest.raises(ValueError, match="at least two of one or more"):
            check_streams(bad)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"benchmark": "admission", "window_ms": {}}))
    with pytest.raises(ValueError, match="not a `pdlab bench streams` result"):
        load_points(other)
    bad_cli = CliRunner().invoke(app, ["bench", "streams", "--url", "http://127.0.0.1:9", "--streams", "0,4,2"])
    assert bad_cli.exit_code == 2 and "ascending" in bad_cli.output
    no_role = CliRunner().invoke(app, ["bench", "streams", "--url", "http://127.0.0.1:9", "--role", "prefill"])
    assert no_role.exit_code == 2 and "colocated, decode" in no_role.output
    calibrate = CliRunner().invoke(app, ["sim", "calibrate", "--streams-probe", str(other)])
    assert calibrate.exit_code == 2 and "--streams-probe goes with --from-runs" in calibrate.output


def test_the_overhead_is_the_slope_the_steps_do_not_explain() -> None:
    """A simulated instance with a known per-stream overhead, probed as the bench probes: the overhead recovered
    from its TTFTs is that overhead; with none, none (the steps' own growth is not counted twice); on a slower
    machine, the same."""
    cost = FittedCost((0.008, 0.0003, 0.0, 0.0001, 1e-6, 0.0))
    plain = ServingOverheads(request_s=0.003)

    def probed(per_stream_s: float) -> dict:
        overheads = ServingOverheads(request_s=0.003, request_per_stream_s=per_stream_s)
        return {"role": "decode", "prompt_tokens": 64,
                "points": [(k, streams_probe_ttft(cost, overheads, "decode", k, 64)) for k in (0, 1, 2, 4, 8)]}

    none, found = per_stream_overhead_s(cost, plain, [probed(0.0)])
    assert none == pytest.approx(0.0, abs=2e-4) and found[0]["simulated_ms_per_stream"] > 0
    recovered, found = per_stream_overhead_s(cost, plain, [probed(0.002)])
    assert recovered == pytest.approx(0.002, rel=0.15) and found[0]["speed_scale"] == pytest.approx(1.0)
    # the same instance on a machine twice as slow: the probe is scaled back to the costs' speed
    slow = probed(0.002)
    slow["points"] = [(k, 2 * seconds) for k, seconds in slow["points"]]
    again, found = per_stream_overhead_s(cost, plain, [slow])
    assert again == pytest.approx(recovered) and found[0]["speed_scale"] == pytest.approx(0.5)
