"""`python -m pdlab.benchmarks.gpu_phases` in its CPU mode: what a GPU will run, run here as a real process on a
small model, and the profile it writes simulated like any other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from pdlab.cli import app
from pdlab.settings import repo_root


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(repo_root() / "src"))
    return subprocess.run([sys.executable, "-m", "pdlab.benchmarks.gpu_phases", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_cpu_mode_writes_a_profile_the_simulator_runs(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    done = run_script("--model", "pdlab-small", "--device", "cpu", "--quick", "--repeats", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr
    profile = json.loads(out.read_text())
    assert profile["kind"] == "fitted" and profile["grid"] == "quick" and profile["gpu"] == "cpu"
    kinds = {(p["prefill_tokens"] > 0, p["prefill_context"] > 0, p["decode_seqs"] > 0) for p in profile["points"]}
    assert kinds == {(True, False, False), (True, True, False), (False, False, True)}  # prompts, chunks, decodes
    assert all(p["step_s"] > 0 for p in profile["points"])
    [mixed] = profile["mixed_steps"]  # a chunk and two decodes in one step, held out of the fit
    assert (mixed["prefill_tokens"], mixed["decode_seqs"]) == (64, 2) and mixed["step_s"] > 0
    assert mixed["profile_s"] > 0 and mixed["error_pct"] == pytest.approx(
        (mixed["profile_s"] - mixed["step_s"]) / mixed["step_s"] * 100)
    prefills = sorted((p["prefill_tokens"], p["step_s"]) for p in profile["points"] if not p["decode_seqs"]
                      and not p["prefill_context"])
    assert prefills[0][0] < prefills[-1][0]  # several prompt lengths (their times are not compared: a busy
    # machine can time a short prompt slower than a long one; the benchmark's figures come from a quiet run)

    spec = yaml.safe_load((repo_root() / "labs" / "sim" / "local-hol.yaml").read_text())
    spec["profile"] = str(out)
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(app, ["sim", "run", str(spec_path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["requests"]["completed"] == 5
    again = run_script("--model", "pdlab-small", "--device", "cpu", "--quick", "--out", str(out))
    assert again.returncode != 0 and "does not overwrite" in again.stderr
    assert json.loads(out.read_text()) == profile  # the first result is untouched


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script would measure")
def test_without_a_gpu_it_says_how_to_check_the_script() -> None:
    done = run_script("--model", "pdlab-small", "--out", "/nonexistent/never-written.json")
    assert done.returncode != 0
    assert "--device cpu --quick" in done.stderr


def test_an_unknown_model_is_named_with_the_catalog() -> None:
    done = run_script("--model", "Llama-9", "--device", "cpu", "--quick")
    assert done.returncode != 0
    assert "'Llama-9' is not in the catalog" in done.stderr and "Llama-3.1-8B" in done.stderr
