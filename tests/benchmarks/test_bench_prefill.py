"""`pdlab bench prefill` against a stand-in server (a real process on loopback) whose prefill takes a known time
per prompt token."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdlab.benchmarks.prefill import ProbeError, load_points, probe, run
from pdlab.cli import app
from tests.standin_process import standin

US_PER_TOKEN = 2000.0  # 2 ms per prompt token


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def slow_prefill() -> str:
    with standin(closed_port(), "--prefill-us-per-token", str(US_PER_TOKEN)) as url:
        yield url


def test_each_length_is_timed_and_the_fastest_kept(slow_prefill: str, tmp_path: Path) -> None:
    result = run(slow_prefill, [10, 100, 300], repeats=2, out=tmp_path / "prefill.json", progress=False)
    points = result["points"]
    assert [p["prompt_tokens"] for p in points] == [10, 100, 300]
    for point in points:
        assert len(point["samples_s"]) == 2 and point["ttft_s"] == min(point["samples_s"])
        # the stand-in counts the token ids it was sent: its prefill delay is exactly tokens x 2 ms
        assert point["ttft_s"] >= point["prompt_tokens"] * US_PER_TOKEN / 1e6
    assert points[2]["ttft_s"] - points[0]["ttft_s"] > 0.9 * 290 * US_PER_TOKEN / 1e6  # grows with the prompt
    written = json.loads(Path(result["path"]).read_text())
    assert written["benchmark"] == "prefill" and "git" in written["environment"]
    assert load_points(Path(result["path"])) == [(p["prompt_tokens"], p["ttft_s"]) for p in points]
    with pytest.raises(FileExistsError, match="does not overwrite"):
        run(slow_prefill, [10], repeats=1, out=tmp_path / "prefill.json", progress=False)


def test_cli_probes_a_running_instance(slow_prefill: str, tmp_path: Path) -> None:
    out = tmp_path / "cli.json"
    result = CliRunner().invoke(app, ["bench", "prefill", "--url", slow_prefill, "--lengths", "5,50",
                                      "--repeats", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "50 tokens" in result.output and out.exists()
    bad = CliRunner().invoke(app, ["bench", "prefill", "--url", slow_prefill, "--lengths", "5,x"])
    assert bad.exit_code == 2 and "comma-separated integers" in bad.output


def test_an_unreachable_instance_is_a_clear_error(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(ProbeError, match=f"{url}/v1/models"):
        probe(url, [10], progress=False, timeout_s=5)
    result = CliRunner().invoke(app, ["bench", "prefill", "--url", url, "--out", str(tmp_path / "x.json")])
    assert result.exit_code == 1 and "error" in result.output and not (tmp_path / "x.json").exists()


def test_a_file_that_is_not_a_probe_result_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"benchmark": "startup"}))
    with pytest.raises(ValueError, match="not a `pdlab bench prefill` result"):
        load_points(bad)
