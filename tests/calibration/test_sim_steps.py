"""`pdlab sim steps`: decode steps read back from streamed tokens, priced with a profile and compared with the
simulator's. Exact schedules by hand; a synthetic run simulated under a known profile reads back at that
profile's prices; the shipped 1P1D runs read back; runs it cannot read are clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from pdlab.calibration.steps import compare_steps, read_steps, steps_of_run
from pdlab.calibration.validate import RunDirError
from pdlab.cli import app
from pdlab.settings import data_dir
from pdlab.sim.costs import FittedCost
from tests.calibration.test_sim_validate import TRUTH, make_run, write_profile


def test_tokens_close_together_are_one_step_with_the_batch_and_context_they_decoded() -> None:
    # A: prompt 100, first token at 0, then decodes every 10 ms; B: prompt 50, first token at 15 ms, then
    # decodes in A's steps (0.1 ms after A's token, as a step hands its tokens out one after another).
    steps = read_steps([(100, [0.0, 0.010, 0.020, 0.030]), (50, [0.015, 0.0201, 0.0301])])
    assert steps.batch.tolist() == [1, 2, 2]
    assert steps.context.tolist() == [101, 102 + 51, 103 + 52]
    assert np.allclose(steps.ends, [0.010, 0.0201, 0.0301])
    assert np.allclose(steps.duration[1:], [0.0101, 0.010])
    assert steps.steady.tolist() == [False, False, True]  # B joined at the second step


def test_a_stream_after_an_idle_gap_is_not_a_step_of_the_one_before() -> None:
    steps = read_steps([(10, [0.0, 0.01, 0.02]), (10, [1.0, 1.01, 1.02])])
    assert steps.batch.tolist() == [1, 1, 1, 1]
    assert steps.steady.tolist() == [False, True, False, True]  # 0.02 -> 1.01 is idle time, not a step


def test_steps_are_priced_by_batch_group_and_prefill_steps_set_aside() -> None:
    cost = FittedCost((0.005, 0.0, 0.0, 0.001, 1e-6, 0.0))
    one = [(1000, [0.0, *np.cumsum([0.0060] * 5)])]  # 5 ms + 1 ms + 1000 us of context: ~6 ms a step
    steps = read_steps(one)
    slow = read_steps([(1000, [0.0, 0.006, 0.012, 0.2, 0.206])])  # the third step also prefilled a prompt
    [group, *rest] = compare_steps(steps, slow, cost)
    assert group["batch"] == "1" and all(g["measured"]["steps"] == 0 for g in rest)
    assert group["measured"]["steps"] == 4 and group["measured"]["with_prefill"] == 0
    assert group["measured"]["step_ms_median"] == pytest.approx(6.0)
    assert group["model_ms_median"] == pytest.approx(5 + 1 + 1.0035, abs=0.01)
    assert group["simulated"]["with_prefill"] == 1 and group["simulated"]["steps"] == 2


def test_a_run_simulated_under_a_profile_reads_back_at_its_prices(tmp_path: Path) -> None:
    truth = write_profile(tmp_path / "truth.json", TRUTH)
    slow = write_profile(tmp_path / "slow.json", FittedCost(tuple(2 * c for c in TRUTH.coefficients)))
    run = make_run(tmp_path / "run", truth, {"prefill": 1, "decode": 1})
    same = steps_of_run(run, truth, model="pdlab-small")
    read = [g for g in same["groups"] if g["measured"]["steps"]]
    assert read and sum(g["measured"]["tokens"] for g in read) > 100
    for group in read:
        assert group["measured"] == group["simulated"]
        assert group["measured"]["step_ms_median"] == pytest.approx(group["model_ms_median"], rel=1e-3)
    doubled = steps_of_run(run, slow, model="pdlab-small")
    for group in (g for g in doubled["groups"] if g["measured"]["steps"]):
        assert group["model_ms_median"] == pytest.approx(2 * group["measured"]["step_ms_median"], rel=1e-2)
        assert group["simulated"]["step_ms_median"] > 1.5 * group["measured"]["step_ms_median"]


def test_the_shipped_runs_read_back_and_a_colocated_pair_is_refused() -> None:
    runs = data_dir() / "sim-runs" / "hol-blocking" / "20261201-123946"
    result = CliRunner().invoke(app, ["sim", "steps", str(runs / "disaggregated"), "--profile", "pdlab-small-fitted",
                                      "--json"])
    assert result.exit_code == 0, result.output
    [read] = json.loads(result.output)
    single = read["groups"][0]
    assert single["batch"] == "1" and single["measured"]["steps"] > 1000
    result = CliRunner().invoke(app, ["sim", "steps", str(runs / "colocated"), "--profile", "pdlab-small-fitted"])
    assert result.exit_code == 2 and "2 instances" in result.output
    with pytest.raises(RunDirError, match="one instance streamed every token"):
        steps_of_run(runs / "colocated", data_dir() / "catalog" / "profiles" / "pdlab-small-fitted.json",
                     model="pdlab-small")
