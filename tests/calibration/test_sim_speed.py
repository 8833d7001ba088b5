"""Moving a fitted profile to another machine's speed (`pdlab.calibration.speed`, `pdlab sim rescale`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdlab.calibration.calibrate import probe_ttft
from pdlab.calibration.speed import ATTENTION_FEATURES, SpeedProbeError, cpu_differences, rescaled, speed_factor
from pdlab.cli import app
from pdlab.sim.costs import FEATURES, FittedCost, ServingOverheads, load_profile
from pdlab.sim.scenario import resolve_profile

SHIPPED = resolve_profile(Path("pdlab-small-fitted"))
LENGTHS = (64, 256, 1024, 3000)


def _lone_ttfts(profile_path: Path) -> list[float]:
    cost, profile = load_profile(profile_path)
    overheads = ServingOverheads.from_json(profile.get("overheads"))
    return [probe_ttft(cost, overheads, tokens) for tokens in LENGTHS]


def _flat(output: str) -> str:
    """Console output with the terminal's line wrapping undone."""
    return " ".join(output.split())


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
    for name in ("request_ms", "request_per_stream_ms", "handoff_ms"):
        assert after[name] == pytest.approx(before[name] * 2.5), name
    assert after["step_jitter_ms"] == pytest.approx([q * 2.5 for q in before["step_jitter_ms"]])
    assert after["step_jitter_pd_ms"] == pytest.approx([q * 2.5 for q in before["step_jitter_pd_ms"]])
    assert after["admission_ms"] == pytest.approx({r: ms * 2.5 for r, ms in before["admission_ms"].items()})
    assert after["sender_wake_cv"] == before["sender_wake_cv"], "a ratio, not a time"
    # The KV transfer is memory copies and a thread's wake-ups, not the model's arithmetic: it stays.
    assert after["sender_wake_ms"] == before["sender_wake_ms"]
    assert moved["link"] == profile["link"]
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


def test_attention_that_slowed_more_than_the_rest_gets_its_own_factor(tmp_path: Path) -> None:
    """Another CPU's kernels: the arithmetic 2x slower, the prefill's attention 3x. Both factors are found, and
    the profile they write times the probe as measured."""
    cost, profile = load_profile(SHIPPED)
    overheads = ServingOverheads.from_json(profile.get("overheads"))
    attention_only = json.loads(SHIPPED.read_text())
    attention_only["coefficients"] = [c if name in ATTENTION_FEATURES else 0.0
                                      for name, c in zip(attention_only["features"], attention_only["coefficients"],
                                                         strict=True)]
    attention_path = tmp_path / "attention.json"
    attention_path.write_text(json.dumps(attention_only))
    attention_cost, _ = load_profile(attention_path)
    # what the attention-only profile adds to a lone request beyond the request overheads
    nothing = FittedCost((0.0,) * len(FEATURES))
    attention = [probe_ttft(attention_cost, overheads, n) - probe_ttft(nothing, overheads, n) for n in LENGTHS]
    lone = _lone_ttfts(SHIPPED)
    slow = [(n, 2.0 * (t - a) + 3.0 * a) for n, t, a in zip(LENGTHS, lone, attention, strict=True)]
    found = speed_factor(SHIPPED, slow)
    assert found["factor"] == pytest.approx(2.0, rel=1e-3)
    assert found["attention_factor"] == pytest.approx(3.0, rel=1e-3)
    assert found["error_after_pct"]["max"] < 0.1
    moved_path = tmp_path / "moved.json"
    moved_path.write_text(json.dumps(rescaled(json.loads(SHIPPED.read_text()), 2.0, 3.0)))
    assert _lone_ttfts(moved_path) == pytest.approx([s for _, s in slow], rel=1e-6)
    assert cost.coefficients[FEATURES.index("decode_context")] * 2.0 == pytest.approx(
        load_profile(moved_path)[0].coefficients[FEATURES.index("decode_context")]), "decode is arithmetic"


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


def test_a_probe_from_another_cpu_or_with_a_wide_spread_is_flagged(tmp_path: Path) -> None:
    calibrated_on = json.loads(SHIPPED.read_text())["environment"]
    other_cpu = {"cpu": {**calibrated_on["cpu"], "model": "1", "isa": ["avx2"]}}
    assert cpu_differences(calibrated_on, calibrated_on) == []
    assert cpu_differences(calibrated_on, {}) == [], "a probe that does not say its CPU is not flagged"
    assert cpu_differences(calibrated_on, other_cpu) == [
        f"model: {calibrated_on['cpu']['model']} -> 1", f"isa: {', '.join(calibrated_on['cpu']['isa'])} -> avx2"]

    lone = _lone_ttfts(SHIPPED)
    runner = CliRunner()
    even = _probe_file(tmp_path / "even.json", [(t, 2.0 * s) for t, s in zip(LENGTHS, lone, strict=True)])
    quiet = runner.invoke(app, ["sim", "rescale", "--probe", str(even), "--out", str(tmp_path / "even-out.json")])
    assert quiet.exit_code == 0 and "warning" not in quiet.output, quiet.output

    moved_cpu = tmp_path / "cpu.json"
    moved_cpu.write_text(json.dumps({**json.loads(even.read_text()), "environment": other_cpu}))
    flagged = runner.invoke(app, ["sim", "rescale", "--probe", str(moved_cpu), "--out", str(tmp_path / "c.json")])
    assert flagged.exit_code == 0 and "another CPU" in _flat(flagged.output) and "isa:" in _flat(flagged.output)
    assert json.loads((tmp_path / "c.json").read_text())["speed"]["cpu_differences"][0].startswith("model:")

    uneven = _probe_file(tmp_path / "uneven.json", [(LENGTHS[0], lone[0] * 1.5), (LENGTHS[-1], lone[-1] * 3.0)])
    spread = runner.invoke(app, ["sim", "rescale", "--probe", str(uneven), "--out", str(tmp_path / "u.json")])
    assert spread.exit_code == 0 and "% off" in _flat(spread.output) and "pdlab sim sitting" in _flat(spread.output)


RECORDED = Path(__file__).resolve().parents[2] / "data" / "results" / "sim-rescale" / "20261204-avx2-host"


@pytest.mark.parametrize("name", ["shipped", "rescaled-start", "rescaled-end"])
def test_the_recorded_rescale_on_another_cpu_reproduces(name: str) -> None:
    """data/results/sim-rescale/ records the shipped profile, and the shipped profile rescaled by a probe taken
    before and after the runs, validated on runs of an AVX2-only host (docs/simulator.md): each rescaled profile
    follows from its probe, and replaying the runs gives the recorded numbers again (the simulator is seeded)."""
    from pdlab.benchmarks.prefill import load_points
    from pdlab.calibration.validate import validate_runs

    root = RECORDED.parents[3]
    recorded = json.loads((RECORDED / name / "validation.json").read_text())
    profile = resolve_profile(Path(recorded["profile"]))
    if name != "shipped":
        moved = json.loads(profile.read_text())
        found = speed_factor(SHIPPED, load_points(root / moved["speed"]["probe"]))
        assert found["factor"] == pytest.approx(moved["speed"]["factor"], rel=1e-9)
        assert found["attention_factor"] == pytest.approx(moved["speed"]["attention_factor"], rel=1e-9)
        again_moved = rescaled(json.loads(SHIPPED.read_text()), found["factor"], found["attention_factor"])
        assert moved["coefficients"] == pytest.approx(again_moved["coefficients"], rel=1e-9)
        assert found["attention_factor"] > 1.5 * found["factor"], "this CPU's attention slowed more than the rest"
        assert moved["speed"]["cpu_differences"], "the runs' host is not the calibration machine's CPU"
    again = validate_runs([root / r["run"] for r in recorded["runs"]], profile, model=recorded["model"],
                          seeds=recorded["seeds"])
    assert again["max_error_pct"] == pytest.approx(recorded["max_error_pct"], rel=1e-6)
    assert again["median_error_pct"] == pytest.approx(recorded["median_error_pct"], rel=1e-6)
