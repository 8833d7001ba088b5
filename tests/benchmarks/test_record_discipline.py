"""Recorded results are never rewritten as a side effect: every benchmark command and `pdlab sim validate`, run as a
user types it (the console script in a subprocess, small sizes, stand-ins or the session's deployment), writes to
`--out` or under runs/ and leaves `git status data/` as it was; only `--record` files a result under data/results/,
and always as a new file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdlab.deploy import Deployment
from tests.conftest import REPO, TEST_MODEL, run_pdlab
from tests.standin_process import free_port, standin


def data_status() -> str:
    """What git says about data/: changed, new and deleted files (untracked ones each listed)."""
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "data/"], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """runs/ for this test (`$PDLAB_RUNS`), and data/ checked to be as it was after the test's commands."""
    monkeypatch.setenv("PDLAB_RUNS", str(tmp_path / "runs"))
    before = data_status()
    yield tmp_path / "runs"
    assert data_status() == before, "a command wrote under data/ without --record"


def pdlab(*args: str) -> subprocess.CompletedProcess:
    done = run_pdlab(*args, timeout=300)
    assert done.returncode == 0, f"pdlab {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done


def written(runs: Path, bench: str) -> dict:
    """The one result a command wrote under runs/bench/<bench>/."""
    [path] = (runs / "bench" / bench).glob("*.json")
    return json.loads(path.read_text())


def test_probes_of_a_served_instance_write_under_runs(runs: Path) -> None:
    with standin(free_port(), "--prefill-us-per-token", "200", "--token-ms", "2") as url:
        pdlab("bench", "prefill", "--url", url, "--lengths", "16,32", "--repeats", "1")
        pdlab("bench", "admission", "--url", url, "--role", "colocated", "--gaps", "0,2", "--repeats", "1",
              "--prompt-words", "8")
        pdlab("bench", "streams", "--url", url, "--role", "decode", "--streams", "0,1,2", "--repeats", "2",
              "--prompt-words", "8")
    assert [p["prompt_tokens"] for p in written(runs, "prefill")["points"]] == [16, 32]
    assert written(runs, "admission")["environment"] and written(runs, "streams")["environment"]


def test_back_to_back_writes_under_runs(runs: Path) -> None:
    with standin(free_port(), "--prefill-us-per-token", "1000", "--blocking-prefill", "--event-loop", "asyncio") \
            as prefill, standin(free_port(), "--token-ms", "2") as decode:
        pdlab("bench", "backtoback", "--prefill-url", prefill, "--decode-url", decode, "--prompts", "2",
              "--tokens", "20", "--rounds", "1", "--conditions", "alone,queued", "--profile", "none")
    assert set(written(runs, "backtoback")["summary"]) == {"alone", "queued"}


def test_router_overhead_writes_under_runs(runs: Path) -> None:
    pdlab("bench", "router", "--requests", "10", "--warmup", "1", "--rounds", "1", "--base-port", "18710")
    [result] = (runs / "bench" / "router").glob("*/router-overhead.json")
    assert json.loads(result.read_text())["concurrency"]


def test_phases_sim_speed_and_gpu_phases_write_under_runs(runs: Path) -> None:
    pdlab("bench", "phases", "--model", TEST_MODEL, "--lengths", "4", "--batches", "1", "--contexts", "4",
          "--repeats", "1")
    assert [row["tokens"] for row in json.loads(next((runs / "bench" / "phases").glob("*.json")).read_text())
            ["prefill"]] == [4]
    pdlab("bench", "sim-speed", "--requests", "50", "--repeats", "1")
    pdlab("bench", "lmcache-copy", "--model", TEST_MODEL, "--tokens", "300", "--repeats", "1")
    assert written(runs, "lmcache-copy")["cases"]["load, whole blocks"]["gb_per_s"] > 0
    assert written(runs, "sim-speed")["results"][0]["requests"] == 50
    done = subprocess.run([sys.executable, "-m", "pdlab.benchmarks.gpu_phases", "--model", "pdlab-small",
                           "--device", "cpu", "--quick", "--repeats", "1"], capture_output=True, text=True,
                          cwd=REPO, env=os.environ.copy(), timeout=300)
    assert done.returncode == 0, done.stderr
    assert written(runs, "gpu")["kind"] == "fitted"


def test_load_accuracy_writes_under_runs(runs: Path) -> None:
    pdlab("bench", "load-accuracy", "--rates", "20", "--requests", "5", "--token-ms", "2")
    [row] = written(runs, "load-accuracy")["results"]
    assert row["completed"] == 5


def test_validation_writes_under_runs(runs: Path) -> None:
    run_dir = REPO / "data" / "sim-runs" / "hol-blocking" / "20261130-191027" / "baseline"
    pdlab("sim", "validate", str(run_dir), "--profile", "pdlab-small-fitted", "--seeds", "1")
    [validation] = (runs / "sim-validation").glob("*/validation.json")
    assert json.loads(validation.read_text())["runs"]


def test_startup_writes_under_runs(runs: Path, tmp_path: Path) -> None:
    lab = yaml.safe_load((REPO / "labs" / "local-colocated.yaml").read_text())
    deployment = lab["deployment"]
    deployment["name"] = lab["name"] = "pytest-startup"
    deployment["model"]["name"] = TEST_MODEL
    deployment["instances"] = deployment["instances"][:1]
    deployment["instances"][0]["port"] = 8145  # clear of the lab specs' and the other tests' ports
    path = tmp_path / "startup.yaml"
    path.write_text(yaml.safe_dump(lab))
    pdlab("bench", "startup", str(path))
    assert written(runs, "startup")["summary"]["repeats"] == 1


def test_transfer_writes_under_runs(runs: Path, live_1p1d: Deployment) -> None:
    pdlab("bench", "transfer", "--deployment", live_1p1d.spec.name, "--conditions", "idle", "--repeats", "1",
          "--prompt-tokens", "300")
    assert set(written(runs, "transfer")["summary"]) == {"idle"}


def test_record_files_a_new_result_under_data_results_and_never_overwrites(runs: Path) -> None:
    recorded = REPO / "data" / "results" / "sim-speed"
    before = set(recorded.glob("*.json"))
    try:
        first = pdlab("bench", "sim-speed", "--requests", "20", "--repeats", "1", "--record")
        second = pdlab("bench", "sim-speed", "--requests", "20", "--repeats", "1", "--record")
        new = set(recorded.glob("*.json")) - before
        assert len(new) == 2, "two records, two new files"
        for done in (first, second):
            [line] = [line for line in done.stdout.splitlines() if line.startswith("recorded: ")]
            assert Path(line.removeprefix("recorded: ")) in new
        assert all(json.loads(path.read_text())["environment"]["cpu"] for path in new)
    finally:
        for path in set(recorded.glob("*.json")) - before:
            path.unlink()
        if recorded.is_dir() and not any(recorded.iterdir()):
            recorded.rmdir()
