"""The GPU tier against the P/D papers' published measurements (`pdlab sim published`, labs/sim/published/), and
the line every simulated figure carries about what it is worth (`pdlab.sim.worth`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdlab.calibration.published import load_setup, validate_setup
from pdlab.cli import app
from pdlab.config.sim import SimSpec
from pdlab.model.catalog import load_catalog
from pdlab.settings import data_dir, repo_root
from pdlab.sim.worth import worth

SETUPS = sorted((repo_root() / "labs" / "sim" / "published").glob("*.yaml"))
RECORDS = sorted((data_dir() / "results" / "sim-published").glob("*.json"))


def test_every_published_setup_loads_and_names_the_file_its_figures_come_from() -> None:
    assert {p.name.split("-")[0] for p in SETUPS} == {"distserve", "splitwise"}
    for path in SETUPS:
        setup = load_setup(path)
        assert setup.name == path.stem
        assert "/blob/" in setup.source and len(setup.source.split("/blob/")[1].split("/")[0]) == 40, path


def test_the_recorded_comparison_reproduces_from_the_setups() -> None:
    """data/results/sim-published/ records every setup simulated beside its figures; simulating them again gives the
    same numbers. A change to the GPU tier that moves them must record them again (`pdlab sim published
    --record`) and update docs/simulator.md's table."""
    recorded = {s["name"]: s for s in json.loads(RECORDS[-1].read_text())["setups"]}
    assert set(recorded) == {p.stem for p in SETUPS}
    catalog = load_catalog()
    for path in SETUPS:
        again = validate_setup(load_setup(path), catalog)
        old = recorded[path.stem]
        assert [p["simulated_ms"] for p in again["points"]] == pytest.approx(
            [p["simulated_ms"] for p in old["points"]], rel=1e-9), path.stem
        assert [p["published_ms"] for p in again["points"]] == [p["published_ms"] for p in old["points"]]


def test_a_figure_the_source_contradicts_is_shown_and_not_counted() -> None:
    setup = load_setup(repo_root() / "labs" / "sim" / "published" / "splitwise-llama2-70b-a100-tp2.yaml")
    result = validate_setup(setup)
    noted = [p for p in result["points"] if p["note"]]
    assert len(noted) == 1 and noted[0]["batch"] == 64
    assert result["count"] == len(result["points"]) - 1 == 19


def test_a_gpu_setup_a_published_measurement_covers_carries_its_error_and_another_says_not_validated() -> None:
    def spec(hardware: str, model: str, tp: int) -> SimSpec:
        return SimSpec.model_validate({"hardware": hardware, "model": model, "engine": {"tensor_parallel": tp},
                                       "workload": {"requests": [{"at_s": 0, "prompt_tokens": 8,
                                                                  "output_tokens": 2}]}})

    covered = worth(spec("H100-SXM5-80GB", "Llama-2-70B", 8))
    assert covered.validated and "splitwise-llama2-70b-h100-tp8" in covered.text
    recorded = {s["name"]: s for s in json.loads(RECORDS[-1].read_text())["setups"]}
    assert covered.median_error_pct == recorded["splitwise-llama2-70b-h100-tp8"]["median_error_pct"]
    elsewhere = worth(spec("H200-SXM-141GB", "Llama-3.1-70B", 8))
    assert not elsewhere.validated and elsewhere.text.startswith("not validated on H200-SXM-141GB")
    # the nearest in the roofline's terms: the same chip (H100), a 70B model, the same tensor parallelism
    assert "nearest published setup splitwise-llama2-70b-h100-tp8" in elsewhere.text


def test_sim_run_prints_what_its_figures_are_worth() -> None:
    result = CliRunner().invoke(app, ["sim", "run", str(repo_root() / "labs" / "sim" / "llama70b-h200-efa.yaml")])
    assert result.exit_code == 0, result.output
    assert "what these figures are worth: not validated on H200-SXM-141GB" in " ".join(result.output.split())


def test_a_local_profile_carries_its_own_sittings_validation(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PDLAB_RUNS", str(tmp_path))  # no probe of this machine: the shipped profile
    spec = SimSpec.model_validate({"model": "pdlab-small", "profile": "pdlab-small-fitted", "dtype_bytes": 4,
                                   "workload": {"requests": [{"at_s": 0, "prompt_tokens": 8, "output_tokens": 2}]}})
    line = worth(spec)
    assert line.validated and line.text.startswith("pdlab-small-fitted's validated error on its calibration machine")
