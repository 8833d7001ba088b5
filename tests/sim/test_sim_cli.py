"""`pdlab sim run` and `pdlab sim search` on the shipped specs; bad specs fail naming the field."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from pdlab.cli import app
from pdlab.settings import repo_root

LABS = repo_root() / "labs" / "sim"


def invoke(*args: str):
    result = CliRunner().invoke(app, ["sim", *args])
    return result


def test_run_json_has_the_measured_summary_shape() -> None:
    result = invoke("run", str(LABS / "local-hol.yaml"), "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    for cls in ("short", "long"):
        assert set(summary[cls]["ttft_ms"]) >= {"p50", "p99"}
    assert set(summary["short"]["itl_ms"]) >= {"p50", "p99", "max"}
    assert summary["requests"] == {"sent": 5, "completed": 5, "failed": 0}
    assert summary["stalls"]["count"] > 0  # one colocated instance: the long prefills stall the short streams
    assert "tpot_ms" in summary["short"] and "e2e_ms" in summary["long"] and "rps" in summary["goodput"]


def test_the_kv_pressure_spec_preempts_and_a_cache_twice_as_large_does_not(tmp_path: Path) -> None:
    import yaml

    spec = yaml.safe_load((LABS / "kv-pressure.yaml").read_text())
    result = invoke("run", str(LABS / "kv-pressure.yaml"), "--json")
    assert result.exit_code == 0, result.output
    tight = json.loads(result.output)
    spec["engine"]["kv_cache_tokens"] *= 2
    (tmp_path / "roomy.yaml").write_text(yaml.safe_dump(spec))
    roomy = json.loads(invoke("run", str(tmp_path / "roomy.yaml"), "--json").output)
    assert tight["preemptions"] > 0 and roomy["preemptions"] == 0
    assert tight["requests"]["completed"] == roomy["requests"]["completed"] == spec["workload"]["poisson"][
        "num_requests"]  # preempted requests finish too
    assert tight["short"]["tpot_ms"]["p99"] > roomy["short"]["tpot_ms"]["p99"]  # recomputed prompts stall the rest
    assert "preemptions" in invoke("run", str(LABS / "kv-pressure.yaml")).output


def test_search_scores_every_split_and_names_the_best() -> None:
    spec = LABS / "llama70b-h200-efa.yaml"
    result = invoke("search", str(spec), "--gpus", "8", "--json")
    assert result.exit_code == 0, result.output
    found = json.loads(result.output)
    shapes = [row["pools"] for row in found["splits"]]
    assert shapes == [{"colocated": 4}, {"prefill": 1, "decode": 3}, {"prefill": 2, "decode": 2},
                      {"prefill": 3, "decode": 1}]
    assert found["best"] in found["splits"]
    assert found["best"]["attainment"] == max(row["attainment"] for row in found["splits"])
    # The table ends by naming the best split in words.
    table = invoke("search", str(spec), "--gpus", "8")
    assert table.exit_code == 0, table.output
    named = ", ".join(f"{pool} {n}" for pool, n in found["best"]["pools"].items())
    assert f"best: {named} ({found['best']['attainment']:.1%}" in table.output, table.output


def test_bad_spec_fails_naming_the_field(tmp_path: Path) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text("pools: {prefill: 1}\nlink: {bandwith_gbps: 10}\nworkload: {poisson: {rate_rps: 1, "
                    "num_requests: 5}}\n")
    result = invoke("run", str(spec))
    assert result.exit_code == 2
    assert "pools" in result.output and "link.bandwith_gbps" in result.output


def test_a_real_lab_deployment_maps_onto_a_sim_spec() -> None:
    from pdlab.config import load_lab
    from pdlab.config.sim import SimSpec
    from pdlab.sim.scenario import simulate

    workload = {"requests": [{"at_s": 0, "prompt_tokens": 80, "output_tokens": 20, "cls": "short"},
                             {"at_s": 0.5, "prompt_tokens": 4000, "output_tokens": 5, "cls": "long"}]}
    for lab, pools in (("local-1p1d", {"prefill": 1, "decode": 1, "colocated": 0}),
                       ("local-colocated", {"prefill": 0, "decode": 0, "colocated": 2})):
        deployment = load_lab(repo_root() / "labs" / f"{lab}.yaml").main_deployment()
        spec = SimSpec.for_deployment(deployment, workload, profile="pdlab-small-vllm-cpu",
                                      link={"name": "local-loopback"})
        assert spec.pools.model_dump() == pools and spec.model == "pdlab-small" and spec.dtype_bytes == 4
        summary, _ = simulate(spec)
        assert summary["requests"]["completed"] == 2
