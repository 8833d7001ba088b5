"""Moving a fitted profile to another machine's speed (`pdlab.sim.speed`, `pdlab sim rescale`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdlab.cli import app
from pdlab.sim.calibrate import probe_ttft
from pdlab.sim.costs import ServingOverheads, load_profile
from pdlab.sim.scenario import resolve_profile
from pdlab.sim.speed import SpeedProbeError, rescaled, speed_factor

SHIPPED = resolve_profile(Path("pdlab-small-fitted"))
LENGTHS = (64, 256, 1024, 3000)


def _lone_ttfts(profile_path: Path) -> list[float]:
    cost, profile = load_profile(profile_path)
    overheads = ServingOverheads.from_json(profile.get("overheads"))
    return [probe_ttft(cost, overheads, tokens) for tokens in LENGTHS]


def _probe_file(path: Path, points: list[tuple[int, float]]) -> Path:
    path.write_text(json.dumps({"benchmark": "prefill", "points": [
        {"prompt_tokens": tokens, "ttft_s": seconds, "samples_s": [seconds]} for tokens, seconds in points]}))
    return path


def test_every_time_in_the_profile_moves_by_the_factor_and_nothing_else(tmp_path: Path) -> None:
    profile = json.loads(SHIPPED.read_text())
    moved = rescaled(profile, 2.5)
    assert profile == json.loads(SHIPPED.read_text()), "the original is left as it was"
    assert moved["coefficients"] == pytest.approx([c * 2.5 for c in profile["coefficients"]])
    before, after = profile["overheads"], moved["overheads"]
    for name in ("request_ms", "request_per_stream_ms", "handoff_ms", "sender_wake_ms"):
        assert after[name] == pytest.approx(before[name] * 2.5), name
    assert after["step_jitter_ms"] == pytest.approx([q * 2.5 for q in before["step_jitter_ms"]])
    assert after["step_jitter_pd_ms"] == pytest.approx([q * 2.5 for q in before["step_jitter_pd_ms"]])
    assert after["admission_ms"] == pytest.approx({r: ms * 2.5 for r, ms in before["admission_ms"].items()})
    assert after["sender_wake_cv"] == before["sender_wake_cv"], "a ratio, not a time"
    assert moved["link"]["bandwidth_gbps"] == pytest.approx(profile["link"]["bandwidth_gbps"] / 2.5)
    with pytest.raises(SpeedProbeError):
        rescaled(profile, 0.0)


def test_a_machine_twice_as_slow_is_found_and_simulated_twice_as_slow(tmp_path: Path) -> None:
    slow = [(tokens, 2.0 * seconds) for tokens, seconds in zip(LENGTHS, _lone_ttfts(SHIPPED), strict=True)]
    found = speed_factor(SHIPPED, slow)
    assert found["factor"] == pytest.approx(2.0, rel=1e-6)
    assert found["error_after_pct"]["max"] == pytest.approx(0.0, abs=1e-6)
    moved_path = tmp_path / "moved.json"
    moved_path.write_text(json.dumps(rescaled(json.loads(SHIPPED.read_text()), found["factor"])))
    # Every term of a lone request's time (request overhead, admission, steps) moved: the simulated probe doubles.
    assert _lone_ttfts(moved_path) == pytest.approx([s for _, s in slow], rel=1e-6)


def test_an_uneven_probe_gets_the_geometric_mean_and_its_spread(tmp_path: Path) -> None:
    lone = _lone_ttfts(SHIPPED)
    found = speed_factor(SHIPPED, [(LENGTHS[0], lone[0] * 1.5), (LENGTHS[-1], lone[-1] * 3.0)])
    assert found["factor"] == pytest.approx((1.5 * 3.0) ** 0.5, rel=1e-6)
    assert found["error_after_pct"]["max"] == pytest.approx((1.5 * 3.0) ** 0.5 / 1.5 * 100 - 100, rel=1e-6)
    with pytest.raises(SpeedProbeError, match="at least two"):
        speed_factor(SHIPPED, [(1024, 0.5)])


def test_the_cli_writes_a_new_profile_that_the_simulator_takes_and_never_overwrites(tmp_path: Path) -> None:
    slow = [(tokens, 1.7 * seconds) for tokens, seconds in zip(LENGTHS, _lone_ttfts(SHIPPED), strict=True)]
    probe = _probe_file(tmp_path / "prefill.json", slow)
    out = tmp_path / "here.json"
    runner = CliRunner()
    result = runner.invoke(app, ["sim", "rescale", "--probe", str(probe), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "1.70x slower" in result.output
    moved = json.loads(out.read_text())
    assert moved["speed"]["factor"] == pytest.approx(1.7, rel=1e-6)
    assert moved["speed"]["from"] == "pdlab-small-fitted" and moved["speed"]["probe"] == str(probe)
    assert _lone_ttfts(out) == pytest.approx([s for _, s in slow], rel=1e-6)

    again = runner.invoke(app, ["sim", "rescale", "--probe", str(probe), "--out", str(out)])
    assert again.exit_code == 2 and "does not overwrite" in again.output
    assert json.loads(out.read_text()) == moved
    bad = runner.invoke(app, ["sim", "rescale", "--probe", str(_probe_file(tmp_path / "one.json", slow[:1])),
                              "--out", str(tmp_path / "other.json")])
    assert bad.exit_code == 2 and "at least two" in bad.output and not (tmp_path / "other.json").exists()
    missing = runner.invoke(app, ["sim", "rescale", "--probe", str(tmp_path / "none.json"),
                                  "--out", str(tmp_path / "other.json")])
    assert missing.exit_code == 2 and "not a `pdlab bench prefill` result" in missing.output
