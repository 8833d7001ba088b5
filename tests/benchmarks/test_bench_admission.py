"""`pdlab bench admission` against stand-in servers (real processes on loopback): one that serves concurrent
prompts side by side (every pair shares a "step") and one whose prefill holds its event loop (none does)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdlab.benchmarks.admission import expected_window_ms, load_windows_ms, probe, run
from pdlab.cli import app
from tests.standin_process import free_port, standin

US_PER_TOKEN = 300.0  # a 300-word prompt takes ~90 ms: gaps of a few ms are well under half of it


def test_pairs_served_side_by_side_share_and_the_window_spans_the_gaps(tmp_path: Path) -> None:
    with standin(free_port(), "--prefill-us-per-token", str(US_PER_TOKEN)) as url:
        result = run([("standin", "decode", url)], [0.0, 2.0, 5.0], repeats=2, out=tmp_path / "admission.json",
                     progress=False)
        with pytest.raises(FileExistsError, match="does not overwrite"):
            run([("standin", "decode", url)], [0.0], repeats=1, out=tmp_path / "admission.json", progress=False)
    [probed] = result["instances"]
    assert [row["shared"] for row in probed["gaps"]] == [[True, True]] * 3
    assert all(gap >= 0 for row in probed["gaps"][1:] for gap in row["sent_gaps_ms"])
    assert probed["window_ms"] == pytest.approx(5.0) and probed["window_censored"]
    assert load_windows_ms(Path(result["path"])) == {"decode": pytest.approx(5.0)}
    written = json.loads(Path(result["path"]).read_text())
    assert written["benchmark"] == "admission" and "git" in written["environment"]


def test_a_server_that_serves_one_prompt_at_a_time_shares_nothing() -> None:
    with standin(free_port(), "--prefill-us-per-token", str(US_PER_TOKEN), "--blocking-prefill") as url:
        result = probe(url, [0.0, 3.0], repeats=2, progress=False)
    assert [row["shared_fraction"] for row in result["gaps"]] == [0.0, 0.0]
    assert result["window_ms"] == 0.0 and not result["window_censored"]


def test_the_window_is_the_area_under_the_shared_fraction() -> None:
    rows = [{"gap_ms": 0, "shared_fraction": 1.0}, {"gap_ms": 2, "shared_fraction": 0.5},
            {"gap_ms": 4, "shared_fraction": 0.0}, {"gap_ms": 8, "shared_fraction": 0.0}]
    assert expected_window_ms(rows) == pytest.approx(2 * 0.75 + 2 * 0.25)


def test_cli_refuses_gaps_out_of_order_and_reads_what_is_not_a_result(tmp_path: Path) -> None:
    bad = CliRunner().invoke(app, ["bench", "admission", "--url", "http://127.0.0.1:9", "--gaps", "4,2"])
    assert bad.exit_code == 2 and "ascending" in bad.output
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"benchmark": "prefill", "points": []}))
    with pytest.raises(ValueError, match="not a `pdlab bench admission` result"):
        load_windows_ms(other)
    no_role = CliRunner().invoke(app, ["bench", "admission", "--url", "http://127.0.0.1:9"])
    assert no_role.exit_code == 2 and "say the instance's role" in no_role.output
    calibrate = CliRunner().invoke(app, ["sim", "calibrate", "--admission-probe", str(other)])
    assert calibrate.exit_code == 2 and "--admission-probe goes with --from-runs" in calibrate.output
