"""This machine's profile: the probe (`pdlab.calibration.probe`), its fit (`pdlab.calibration.machine`), and
which profile the simulator then uses (`pdlab.sim.scenario.machine_profile`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from pdlab.calibration.machine import (
    DECODE_TERMS,
    MachineFitError,
    decode_features,
    fit_machine,
    lone_prefill_features,
)
from pdlab.calibration.probe import DECODE_TOKENS, decode_step, probe
from pdlab.cli import app
from pdlab.environment import capture
from pdlab.sim.costs import FEATURES, coefficients_by_name
from pdlab.sim.scenario import machine_profile, resolve_profile
from pdlab.sse import StreamRecord

SHIPPED = json.loads(resolve_profile(Path("pdlab-small-fitted")).read_text())
DECODE_CELLS = ((1, 64), (1, 3000), (4, 256), (8, 512), (8, 3448))
LENGTHS = (64, 512, 1024, 2048, 3000)


def synthetic_probe(coefficients: np.ndarray, request_s: float, admission_s: float) -> dict:
    """What a machine whose steps cost exactly `coefficients` would measure (no noise)."""
    decode = [{"batch": b, "context_tokens": c, "prompts": [c // b] * b,
               "step_s": float(decode_features(b, c + b * DECODE_TOKENS / 2) @ coefficients)} for b, c in DECODE_CELLS]
    prefill = [{"prompt_tokens": n, "ttft_s": float(lone_prefill_features(n) @ coefficients) + request_s + admission_s}
               for n in LENGTHS]
    return {"benchmark": "sim-probe", "decode": decode, "prefill": prefill, "mixed": [], "transfer": {}}


def shipped_coefficients() -> np.ndarray:
    return np.array(coefficients_by_name(SHIPPED["features"], SHIPPED["coefficients"]))


def admission_s(profile: dict) -> float:
    return profile["overheads"]["admission_ms"]["colocated"] / 1e3


def test_a_machine_slower_by_two_factors_is_rescaled_by_them() -> None:
    truth = shipped_coefficients()
    decode = [FEATURES.index(t) for t in DECODE_TERMS]
    truth[decode] *= 1.7
    prefill = [FEATURES.index(t) for t in FEATURES if t not in DECODE_TERMS]
    truth[prefill] *= 1.3
    moved = fit_machine(SHIPPED, synthetic_probe(truth, 0.008, 1.7 * admission_s(SHIPPED)))
    fit = moved["machine"]
    assert fit["decode"]["decision"] == fit["prefill"]["decision"] == "rescaled"
    assert fit["decode"]["factor"] == pytest.approx(1.7, rel=1e-6)
    assert fit["prefill"]["factor"] == pytest.approx(1.3, rel=1e-4)
    assert moved["overheads"]["request_ms"] == pytest.approx(8.0, rel=1e-3)
    assert fit["prefill"]["error_after_pct"]["max"] < 0.01
    # the scheduler's Python work beside the steps moves with the decode step
    assert moved["overheads"]["handoff_ms"] == pytest.approx(1.7 * SHIPPED["overheads"]["handoff_ms"])
    assert max(moved["overheads"]["step_jitter_ms"]) == pytest.approx(1.7 * max(SHIPPED["overheads"]["step_jitter_ms"]))


def test_decode_steps_of_another_shape_are_refitted_and_the_probe_then_fits() -> None:
    truth = shipped_coefficients()
    truth[FEATURES.index("decode_seqs")] *= 12  # each sequence costs far more: no single factor holds
    moved = fit_machine(SHIPPED, synthetic_probe(truth, 0.0045, admission_s(SHIPPED)))
    fit = moved["machine"]["decode"]
    assert fit["decision"] == "refitted"
    assert fit["rescaled_error_pct"]["max"] > 10
    assert fit["error_after_pct"]["max"] < 1
    assert moved["coefficients"][moved["features"].index("decode_seqs")] == pytest.approx(
        truth[FEATURES.index("decode_seqs")], rel=1e-3)


def test_a_probe_without_decode_steps_is_refused() -> None:
    probe = synthetic_probe(shipped_coefficients(), 0.0045, 0.0)
    probe["decode"] = probe["decode"][:2]
    with pytest.raises(MachineFitError, match="decode steps"):
        fit_machine(SHIPPED, probe)


def test_the_decode_step_is_timed_over_the_window_every_stream_decodes_in() -> None:
    # Steps end every 20 ms; the second stream starts later, gets two tokens in one chunk (the API server fell
    # behind) and decodes on after the first has ended.
    early = StreamRecord(token_times=[0.10, 0.12, 0.14, 0.16, 0.18, 0.20])
    late = StreamRecord(token_times=[0.14, 0.18, 0.18, 0.20, 0.22, 0.30])
    step = decode_step([early, late])
    assert step["step_s"] == pytest.approx(0.02)


def test_the_probe_fit_writes_a_profile_the_simulator_then_takes_for_this_machine(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    monkeypatch.setenv("PDLAB_RUNS", str(tmp_path / "runs"))
    probe = synthetic_probe(1.9 * shipped_coefficients(), 0.006, admission_s(SHIPPED))
    elsewhere = {**probe, "environment": {**capture(include_busy=False), "cpu": {"family": "6", "model": "143"}}}
    path = tmp_path / "elsewhere.json"
    path.write_text(json.dumps(elsewhere))
    assert machine_profile() is None
    result = CliRunner().invoke(app, ["sim", "probe", "--from", str(path)])
    assert result.exit_code == 0, result.output
    assert "rescaled" in result.output
    assert machine_profile() is None, "a profile probed on another CPU is not this machine's"
    path.write_text(json.dumps({**probe, "environment": capture(include_busy=False)}))
    result = CliRunner().invoke(app, ["sim", "probe", "--from", str(path)])
    assert result.exit_code == 0, result.output
    found = machine_profile()
    assert found is not None and resolve_profile(Path("machine")) == found
    assert json.loads(found.read_text())["machine"]["decode"]["factor"] == pytest.approx(1.9)


def test_the_probe_measures_every_part_on_a_real_pd_pair_and_its_fit_says_what_it_did(live_1p1d) -> None:
    """The quick probe on the session's 1P1D pair (pdlab-tiny): lone prefills, decode and mixed steps, KV reads
    beside an idle and a busy sender, each timed; the fit from them runs. (The shipped profile is pdlab-small's: the
    factors it finds for the tiny model mean nothing, the procedure is what is checked.)"""
    from tests.conftest import ROUTER_THRESHOLD

    dep = live_1p1d
    sender = next(inst for inst in dep.instances if inst.spec.role == "prefill")
    seen = []
    result = probe(dep.router_url, dep.urls("prefill")[0], dep.urls("decode")[0], prefill_pid=sender.pid,
                   threshold=ROUTER_THRESHOLD, quick=True, progress=lambda what, done: seen.append(done))
    assert seen[-1] == pytest.approx(1.0) and seen == sorted(seen)
    assert [r["prompt_tokens"] for r in result["prefill"]] == [16, 64, 128]
    assert all(r["ttft_s"] > 0 for r in result["prefill"])
    assert [r["batch"] for r in result["decode"]] == [1, 1, 3] and all(r["step_s"] > 0 for r in result["decode"])
    assert result["mixed"] and result["mixed"][0]["step_s"] > 0
    idle = [t for t in result["transfer"]["trials"] if t["condition"] == "idle"]
    assert idle and idle[0]["transfers"] == 1 and idle[0]["xfer_ms"] > 0
    probe_json = {"benchmark": "sim-probe", **result}
    profile = fit_machine(SHIPPED, probe_json)
    assert profile["machine"]["decode"]["decision"] in ("rescaled", "refitted")
    assert profile["link"]["bandwidth_gbps"] > 0


def test_each_recorded_probe_reproduces_its_fit_and_the_validation_of_the_run_after_it() -> None:
    """data/results/sim-probe/<stamp>/ records `pdlab sim probe --record` (probe.json, profile.json) taken right
    before a run of the demo lab (shipped in data/sim-runs/hol-blocking/), and that run validated with the probe's
    profile (validation.json): fitting the probe again gives the same profile, and replaying the run gives the same
    numbers (the simulator is seeded). What a probed profile's figures are worth (`pdlab.sim.worth`) quotes it."""
    from pdlab.calibration.validate import validate_runs
    from pdlab.settings import data_dir
    from pdlab.sim.worth import local_worth

    root = data_dir().parent
    records = sorted((data_dir() / "results" / "sim-probe").glob("*/validation.json"))
    assert records, "no recorded probe validation"
    for path in records:
        recorded = json.loads(path.read_text())
        profile = json.loads((path.parent / "profile.json").read_text())
        probe_json = json.loads((path.parent / "probe.json").read_text())
        again = fit_machine({"name": "pdlab-small-fitted", **SHIPPED}, probe_json)
        assert again["coefficients"] == pytest.approx(profile["coefficients"], rel=1e-9)
        replay = validate_runs([root / r["run"] for r in recorded["runs"]], root / recorded["profile"],
                               model=recorded["model"], seeds=recorded["seeds"])
        for old, new in zip(recorded["runs"], replay["runs"], strict=True):
            for key, e in old["errors"].items():
                assert new["errors"][key]["simulated"] == pytest.approx(e["simulated"], rel=1e-6), (old["run"], key)
                assert new["errors"][key]["measured"] == pytest.approx(e["measured"], rel=1e-9), (old["run"], key)
        assert replay["median_error_pct"] == pytest.approx(recorded["median_error_pct"], rel=1e-6)
    worth = local_worth(path.parent / "profile.json")
    assert worth.validated and worth.median_error_pct == pytest.approx(recorded["median_error_pct"])
