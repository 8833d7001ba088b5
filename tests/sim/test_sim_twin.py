"""A cluster lab's simulated twin (`cluster_lab:` in a sim spec): what the lab says, under the spec's own fields."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pdlab.cli import app
from pdlab.config.base import ConfigError
from pdlab.config.cluster import INSTANCE_TYPES
from pdlab.model.catalog import load_catalog
from pdlab.settings import repo_root
from pdlab.sim.scenario import build, prepare, simulate
from pdlab.sim.twin import load_sim_spec

LABS = repo_root() / "labs"
TWIN = LABS / "sim" / "hyperpod-llama70b-2p2d.yaml"


def write_spec(tmp_path: Path, lab: Path, **fields) -> Path:
    data = {"cluster_lab": str(lab), "workload": {"poisson": {"rate_rps": 4, "num_requests": 200, "seed": 1}},
            **fields}
    path = tmp_path / "twin.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_shipped_twin_is_the_lab_as_deployed() -> None:
    """labs/hyperpod-llama70b-2p2d.yaml: 2 prefill and 2 decode replicas of 8 H200s on p5en (16 EFA interfaces
    each: the node's), the prefill pool's 16,384-token budget, the decode pool's 128 sequences, prefix caching
    and kvaware routing at 2,048 tokens."""
    spec = load_sim_spec(TWIN)
    assert (spec.hardware, spec.model, spec.dtype_bytes) == ("H200-SXM-141GB", "Llama-3.1-70B", 2)
    assert (spec.pools.prefill, spec.pools.decode, spec.pools.colocated) == (2, 2, 0)
    assert spec.engine.tensor_parallel == spec.prefill_engine.tensor_parallel == 8
    assert spec.prefill_engine.max_num_batched_tokens == 16384 and spec.engine.max_num_seqs == 128
    assert spec.engine.enable_prefix_caching and spec.prefill_engine.enable_prefix_caching
    assert (spec.router.threshold, spec.router.prefill_strategy, spec.router.decode_strategy) == \
        (2048, "kvaware", "kvaware")
    assert (spec.link.name, spec.link.bandwidth_gbps) == ("efa-p5en", 400)  # 3,200 Gbps over the node's 8 GPUs
    prepared = prepare(spec)
    assert prepared.link.bandwidth_gbps == 3200  # an instance's 8 ranks send side by side
    sim = build(prepared)
    assert [i.budget for i in sim.prefill_pool] == [16384, 16384]
    assert [i.max_seqs for i in sim.decode_pool] == [128, 128]
    assert [i.budget for i in sim.decode_pool] == [spec.engine.max_num_batched_tokens] * 2
    summary, _ = simulate(spec)
    assert summary["requests"]["failed"] == 0
    assert summary["paths"]["disaggregated"] == summary["long"]["count"]  # 8,192-token prompts, threshold 2,048


def test_pools_of_their_own_size_get_their_own_engine(tmp_path: Path) -> None:
    """Prefill replicas of 4 GPUs beside decode replicas of 8: each pool is priced at its own tensor parallelism
    and sized on its own memory, and the KV moves over the smaller pool's ranks."""
    lab = yaml.safe_load((LABS / "hyperpod-llama70b-2p2d.yaml").read_text())
    lab["cluster"]["prefill"].update(gpus=4, tensor_parallel_size=4)
    (tmp_path / "lab.yaml").write_text(yaml.safe_dump(lab))
    spec = load_sim_spec(write_spec(tmp_path, tmp_path / "lab.yaml"))
    assert (spec.prefill_engine.tensor_parallel, spec.engine.tensor_parallel) == (4, 8)
    prepared = prepare(spec)
    assert prepared.link.bandwidth_gbps == 3200  # the node's 16 interfaces, over 4 ranks
    assert prepared.prefill_kv_capacity < prepared.kv_capacity
    assert "prefill pool: roofline: H200-SXM-141GB x4" in prepared.cost_source
    sim = build(prepared)
    prefill_step = sim.prefill_pool[0].cost.step_time(8192, 8192 * 4096, 0, 0)
    decode_step = sim.decode_pool[0].cost.step_time(8192, 8192 * 4096, 0, 0)
    assert prefill_step > 1.5 * decode_step


def test_the_8b_lab_on_single_gpu_replicas(tmp_path: Path) -> None:
    spec = load_sim_spec(write_spec(tmp_path, LABS / "hyperpod-llama8b-1p1d.yaml"))
    assert (spec.hardware, spec.model) == ("H100-SXM5-80GB", "Llama-3.1-8B")
    assert spec.engine.tensor_parallel == spec.prefill_engine.tensor_parallel == 1
    assert (spec.link.name, spec.link.bandwidth_gbps) == ("efa-p5", 400)  # 4 x 100 Gbps EFA
    assert spec.router.threshold == 4096 and spec.engine.max_num_seqs == 256
    assert prepare(spec).link.bandwidth_gbps == 400


def test_what_the_spec_gives_wins_over_the_lab(tmp_path: Path) -> None:
    path = write_spec(tmp_path, LABS / "hyperpod-llama70b-2p2d.yaml", link={"name": "tcp-100gbe"},
                      engine={"max_num_seqs": 64}, router={"threshold": 8192})
    spec = load_sim_spec(path)
    assert spec.engine.max_num_seqs == 64 and spec.engine.tensor_parallel == 8  # merged, not replaced
    assert spec.router.threshold == 8192 and spec.router.prefill_strategy == "kvaware"
    assert spec.link.name == "tcp-100gbe" and spec.link.bandwidth_gbps is None  # the EFA figure was the lab's
    assert prepare(spec).link.bandwidth_gbps == 100  # one NIC the 8 ranks share, not 8 x 100
    # Concurrency alone keeps the lab's EFA.
    kept = load_sim_spec(write_spec(tmp_path, LABS / "hyperpod-llama70b-2p2d.yaml", link={"concurrency": 4}))
    assert (kept.link.name, kept.link.bandwidth_gbps, kept.link.concurrency) == ("efa-p5en", 400, 4)


def test_every_instance_type_names_its_gpu_and_efa_in_the_simulators_catalog() -> None:
    catalog = load_catalog()
    for name, facts in INSTANCE_TYPES.items():
        hardware = catalog.hardware[facts.accelerator]
        memory = int(re.search(r"(\d+)GB", facts.gpu).group(1))
        assert hardware.memory_gib == memory, name
        assert facts.efa_link in catalog.links, name
        assert hardware.gpus_per_node == facts.gpus, name


def test_a_lab_that_cannot_be_twinned_says_why(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cluster_lab") as error:
        load_sim_spec(write_spec(tmp_path, tmp_path / "missing.yaml"))
    assert "no such file" in str(error.value)
    with pytest.raises(ConfigError, match="no `cluster:` section"):
        load_sim_spec(write_spec(tmp_path, LABS / "local-1p1d.yaml"))
    lab = yaml.safe_load((LABS / "hyperpod-llama8b-1p1d.yaml").read_text())
    lab["deployment"]["model"]["name"] = "mistralai/Mistral-7B-Instruct-v0.3"
    (tmp_path / "lab.yaml").write_text(yaml.safe_dump(lab))
    with pytest.raises(ConfigError, match="deployment.model.name") as error:
        load_sim_spec(write_spec(tmp_path, tmp_path / "lab.yaml"))
    assert "meta-llama/Llama-3.1-8B-Instruct" in str(error.value)  # the ids it knows


def test_cli_runs_and_searches_the_twin() -> None:
    result = CliRunner().invoke(app, ["sim", "run", str(TWIN), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["requests"]["completed"] == summary["requests"]["sent"]
    assert "x8 over nvlink4" in summary["cost_model"]
    assert summary["link"]["bandwidth_gbps"] == 3200


def test_a_cluster_lab_given_where_a_sim_spec_belongs_points_to_cluster_lab() -> None:
    for command in ("run", "lab"):
        result = CliRunner().invoke(app, ["sim", command, str(LABS / "hyperpod-llama70b-2p2d.yaml")])
        assert result.exit_code != 0
        assert "cluster_lab" in " ".join(result.output.split()), (command, result.output)
