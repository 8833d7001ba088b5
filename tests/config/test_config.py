"""Config validation: every bad field gets a message that names it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdlab.config import ConfigError, DeploymentSpec, LabSpec, LMCacheReceiverPorts, load_lab, validate
from pdlab.config.deployment import LMCacheSpec

LABS = Path(__file__).resolve().parents[2] / "labs"


def one_p_one_d(**overrides):
    spec = {
        "instances": [
            {"name": "prefill-0", "role": "prefill", "cores": [0]},
            {"name": "decode-0", "role": "decode", "cores": [1]},
        ]
    }
    spec.update(overrides)
    return spec


def problems_of(cls, data) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        validate(cls, data)
    return dict(caught.value.problems)


def test_valid_deployment_defaults():
    spec = validate(DeploymentSpec, one_p_one_d())
    assert spec.disaggregated
    assert spec.connector.kind == "nixl"
    assert all(inst.kv_cache_gib >= 1 for inst in spec.instances)
    assert all(inst.host == "127.0.0.1" for inst in spec.instances)


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"role": "both"}, "instances.0.role"),
        ({"port": 70000}, "instances.0.port"),
        ({"kv_cache_gib": 0}, "instances.0.kv_cache_gib"),
        ({"cores": [0, 0]}, "instances.0.cores"),
        ({"name": "Prefill 0"}, "instances.0.name"),
        ({"engine": {"max_num_batched_tokens": -5}}, "instances.0.engine.max_num_batched_tokens"),
        ({"colour": "blue"}, "instances.0.colour"),
    ],
)
def test_bad_instance_field_is_named(patch, field):
    data = one_p_one_d()
    data["instances"][0].update(patch)
    assert field in problems_of(DeploymentSpec, data)


def test_bad_connector_and_model_fields_are_named():
    assert "connector.kind" in problems_of(DeploymentSpec, one_p_one_d(connector={"kind": "rdma"}))
    assert "model.dtype" in problems_of(DeploymentSpec, one_p_one_d(model={"dtype": "int3"}))
    assert "router.threshold" in problems_of(DeploymentSpec, one_p_one_d(router={"threshold": -1}))
    assert "router.decode_strategy" in problems_of(
        DeploymentSpec, one_p_one_d(router={"decode_strategy": "random"})
    )


def test_deployment_level_rules():
    lonely = {"instances": [{"name": "prefill-0", "role": "prefill"}]}
    assert "at least one `prefill` and one `decode`" in str(problems_of(DeploymentSpec, lonely))
    twins = one_p_one_d()
    twins["instances"][1]["name"] = "prefill-0"
    assert "unique" in str(problems_of(DeploymentSpec, twins))
    same_port = one_p_one_d()
    same_port["instances"][0]["port"] = same_port["instances"][1]["port"] = 8123
    assert "8123" in str(problems_of(DeploymentSpec, same_port))
    assert "connector.kind" in str(problems_of(DeploymentSpec, one_p_one_d(connector={"kind": "none"})))


def test_router_kv_protocol_follows_the_connector_and_mismatches_are_named():
    assert validate(DeploymentSpec, one_p_one_d(router={})).kv_protocol == "nixl"
    lmcache = {"kind": "lmcache", "buffer_device": "cuda"}
    assert validate(DeploymentSpec, one_p_one_d(connector=lmcache, router={})).kv_protocol == "lmcache"
    explicit = validate(DeploymentSpec, one_p_one_d(connector=lmcache, router={"kv_protocol": "lmcache"}))
    assert explicit.router is not None and explicit.router.kv_protocol == "lmcache"
    for connector, protocol in ((lmcache, "nixl"), ({"kind": "nixl"}, "lmcache")):
        message = str(problems_of(DeploymentSpec, one_p_one_d(connector=connector, router={"kv_protocol": protocol})))
        assert "router.kv_protocol" in message and protocol in message
    assert "router.kv_protocol" in problems_of(DeploymentSpec, one_p_one_d(router={"kv_protocol": "mooncake"}))


def test_lmcache_receiver_ports_are_checked_and_shared_with_the_cluster_config():
    assert LMCacheSpec(peer_init_port=7300, peer_alloc_port=7400).receiver_ports(2) == LMCacheReceiverPorts(
        init_ports=[7300, 7301], alloc_ports=[7400, 7401])
    assert "alloc_ports" in str(problems_of(LMCacheReceiverPorts, {"init_ports": [7300], "alloc_ports": [1, 2]}))
    assert "repeated: [7300]" in str(problems_of(LMCacheReceiverPorts, {"init_ports": [7300],
                                                                        "alloc_ports": [7300]}))
    assert "init_ports" in problems_of(LMCacheReceiverPorts, {"init_ports": [], "alloc_ports": []})
    assert "init_ports.0" in problems_of(LMCacheReceiverPorts, {"init_ports": [70000], "alloc_ports": [7400]})


def test_lab_needs_a_deployment():
    assert "deployment" in str(problems_of(LabSpec, {"name": "empty"}))


def test_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ndeployment:\n  instances:\n    - {name: a, role: decoder}\n")
    with pytest.raises(ConfigError) as caught:
        load_lab(bad)
    message = str(caught.value)
    assert str(bad) in message and "deployment.instances.0.role" in message
    with pytest.raises(ConfigError, match="no such file"):
        load_lab(tmp_path / "missing.yaml")


@pytest.mark.parametrize("path", sorted(LABS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_labs_validate(path):
    load_lab(path)


def test_experiment_names_must_exist():
    base = {"name": "x", "workload": {"kind": "probe", "duration_s": 5},
            "scenarios": {"a": one_p_one_d(router={"threshold": 10}), "b": one_p_one_d()}}
    validate(LabSpec, {**base, "experiment": {"sweep": {"scenario": ["a"], "values": [0, 5]}}})
    assert "experiment" in str(problems_of(LabSpec, {**base, "experiment": {"baseline_scenario": "zzz"}}))
    needs_router = problems_of(LabSpec, {**base, "experiment": {"sweep": {"scenario": ["a", "b"], "values": [1]}}})
    assert "needs a `router`" in str(needs_router)
    bad_value = problems_of(LabSpec, {**base, "experiment": {"sweep": {"scenario": "a", "setting": "decode_strategy",
                                                                       "values": ["random"]}}})
    assert "experiment.sweep" in str(bad_value) and "values.0" in str(bad_value)
    bad_event = problems_of(LabSpec, {**base, "experiment": {"events": [{"at_s": 1, "instance": "nope"}]}})
    assert "experiment.events.0.instance" in str(bad_event)
