"""Planning a deployment: ports, cores, and the vLLM command line, before anything starts."""

from __future__ import annotations

import json

import pytest

from pdlab.config import DeploymentSpec, ModelRef, parse_lab, validate
from pdlab.config.base import ConfigError
from pdlab.deploy import Deployment
from pdlab.deploy.guard import ipc_dir
from pdlab.deploy.plan import (
    PlanError,
    assign_ports,
    check_cores,
    explain,
    plan_deployment,
    port_in_use,
    shell_line,
)
from pdlab.netlab import NetLabUnavailable, leftovers, unavailable_reason
from pdlab.settings import BASE_INSTANCE_PORT, BASE_NIXL_SIDE_CHANNEL_PORT


def spec(**extra) -> DeploymentSpec:
    data = {"instances": [{"name": "prefill-0", "role": "prefill", "cores": [0]},
                          {"name": "decode-0", "role": "decode", "cores": [1], "port": BASE_INSTANCE_PORT}]}
    data.update(extra)
    return validate(DeploymentSpec, data)


def test_ports_skip_explicit_ones():
    prefill, decode = assign_ports(spec())
    assert decode.port == BASE_INSTANCE_PORT
    assert prefill.port == BASE_INSTANCE_PORT + 1
    assert {prefill.nixl_side_channel_port, decode.nixl_side_channel_port} == {
        BASE_NIXL_SIDE_CHANNEL_PORT, BASE_NIXL_SIDE_CHANNEL_PORT + 1}


def test_cores_must_exist():
    instances = assign_ports(spec())
    check_cores(instances, [0, 1])
    with pytest.raises(PlanError, match=r"instances\.1\.cores.*\[1\]"):
        check_cores(instances, [0])


def test_vllm_command_and_environment():
    plans = plan_deployment(spec(), "/models/x", base_env={}, cores=[0, 1])
    prefill = plans[0]
    argv = prefill.argv
    assert argv[:3] == [argv[0], "-c", "0"] and argv[0].endswith("taskset")
    assert "vllm.entrypoints.openai.api_server" in argv
    assert argv[argv.index("--port") + 1] == str(prefill.spec.port)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "--no-enable-prefix-caching" in argv and "--enforce-eager" in argv
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "NixlConnector" and kv["kv_role"] == "kv_both"
    # pdlab's NixlConnector (vLLM's, without NIXL's busy-polling progress thread) unless the spec asks for vLLM's own
    assert kv["kv_connector_module_path"] == "pdlab.deploy.nixl_connector"
    threaded = validate(DeploymentSpec, {**spec().model_dump(), "connector": {"kind": "nixl", "progress_thread": True}})
    threaded_argv = plan_deployment(threaded, "/models/x", base_env={}, cores=[0, 1])[0].argv
    assert "kv_connector_module_path" not in json.loads(threaded_argv[threaded_argv.index("--kv-transfer-config") + 1])
    env = prefill.env
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(prefill.spec.nixl_side_channel_port)
    assert env["UCX_TLS"] == "tcp,self,sm"
    # a sleeping lock: NIXL's progress thread, where on, runs at idle priority (deprioritize_spinning_threads)
    assert env["UCX_USE_MT_MUTEX"] == "y"
    assert "VLLM_RPC_BASE_PATH" not in env  # a plan without a run directory: vLLM's default
    sockets = ipc_dir("/runs/deployments/x-20261205")
    assert sockets == ipc_dir("/runs/deployments/x-20261205") != ipc_dir("/runs/deployments/x-20261206")
    assert len(str(sockets / ("engine_" + "0" * 36 + "_service_offload_lmcache_rpc_port_100"))) < 107
    planned = plan_deployment(spec(), "/models/x", base_env={}, cores=[0, 1], sockets=sockets)[0]
    assert planned.env["VLLM_RPC_BASE_PATH"] == planned.own_env["VLLM_RPC_BASE_PATH"] == str(sockets)
    spinlock = validate(DeploymentSpec, {**spec().model_dump(), "connector": {"kind": "nixl", "ucx_mutex": False}})
    assert plan_deployment(spinlock, "/models/x", base_env={}, cores=[0, 1])[0].env["UCX_USE_MT_MUTEX"] == "n"


def test_colocated_has_no_connector_and_engine_knobs_pass_through():
    colocated = validate(DeploymentSpec, {
        "connector": {"kind": "none"},
        "instances": [{"name": "colocated-0", "role": "colocated",
                       "engine": {"max_num_batched_tokens": 256, "enable_chunked_prefill": True,
                                  "extra_args": ["--seed", "3"]}}]})
    (plan,) = plan_deployment(colocated, "/models/x", base_env={}, cores=[0, 1])
    assert "--kv-transfer-config" not in plan.argv
    assert plan.argv[plan.argv.index("--max-num-batched-tokens") + 1] == "256"
    assert "--enable-chunked-prefill" in plan.argv and plan.argv[-2:] == ["--seed", "3"]
    assert plan.argv[0] != "taskset" and plan.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_a_cache_in_blocks_overrides_vllms_and_must_hold_one_context():
    def spec(max_model_len: int | None) -> dict:
        return {"model": {"name": "pdlab-small", "max_model_len": max_model_len}, "connector": {"kind": "none"},
                "instances": [{"name": "colocated-0", "role": "colocated", "engine": {"kv_cache_blocks": 24}}]}

    (plan,) = plan_deployment(validate(DeploymentSpec, spec(2048)), "/models/x", base_env={}, cores=[0, 1])
    assert plan.argv[plan.argv.index("--num-gpu-blocks-override") + 1] == "24"
    # 24 blocks of 128 tokens are 3,072, but vLLM keeps one back: requests get 2,944 (a vLLM started with a
    # max_model_len of 3,072 on them refuses to start).
    for too_long in (None, 3072, 4096):
        with pytest.raises(ConfigError, match=r"instances\.0\.engine\.kv_cache_blocks.*2,944.*max_model_len"):
            validate(DeploymentSpec, spec(too_long))


def test_port_probe_sees_a_bound_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert port_in_use("127.0.0.1", sock.getsockname()[1])


def test_explain_says_what_every_flag_key_and_variable_does():
    prefill = plan_deployment(spec(), "/models/x", base_env={"UNRELATED": "1"}, cores=[0, 1])[0]
    rows = explain(prefill)
    kinds = {(row["kind"], row["name"]) for row in rows}
    assert ("prefix", "taskset") in kinds and ("flag", "--kv-transfer-config") in kinds
    assert {("kv", "kv_connector"), ("kv", "kv_role"), ("env", "UCX_TLS"),
            ("env", "VLLM_NIXL_SIDE_CHANNEL_PORT"), ("env", "UCX_NET_DEVICES")} <= kinds
    assert all(row["meaning"] for row in rows), [row for row in rows if not row["meaning"]]
    assert "UNRELATED" not in prefill.own_env and prefill.env["UNRELATED"] == "1"  # only what pdlab sets is shown
    line = shell_line(prefill)
    assert line.startswith("env VLLM_CPU_KVCACHE_SPACE=1 ") and "--kv-transfer-config '{" in line


def test_parse_lab_names_the_wrong_field():
    text = "name: x\ndeployment:\n  instances:\n    - {name: a, role: colocated, kv_cache_gb: 1}\n"
    with pytest.raises(ConfigError, match=r"(?s)my spec: .*deployment\.instances\.0\.kv_cache_gb"):
        parse_lab(text, source="my spec")
    with pytest.raises(ConfigError, match=r"\(yaml\)"):
        parse_lab("name: [unclosed", source="my spec")


def two_node_spec(fallback: bool) -> DeploymentSpec:
    return spec(nodes=[{"name": "prefill"}, {"name": "decode"}], connector={"kind": "nixl", "ucx_tls": "tcp,self"},
                link={"mbps": 100, "fallback_to_loopback": fallback},
                instances=[{"name": "prefill-0", "role": "prefill", "node": "prefill", "cores": [0]},
                           {"name": "decode-0", "role": "decode", "node": "decode", "cores": [1]}])


def test_dry_run_without_root_gives_each_node_a_loopback_address(monkeypatch):
    for where in ("pdlab.netlab.iproute.unavailable_reason", "pdlab.netlab.unavailable_reason"):
        monkeypatch.setattr(where, lambda: "pdlab netlab needs root")
    planned = Deployment(two_node_spec(fallback=True).model_copy(
        update={"model": ModelRef(name="pdlab-tiny")})).dry_run()
    assert [p.spec.host for p in planned.instances] == ["127.0.0.1", "127.0.0.2"]
    assert planned.netlab is None and "needs root" in planned.notes[0]
    with pytest.raises(NetLabUnavailable, match="fallback_to_loopback"):
        Deployment(two_node_spec(fallback=False)).dry_run()


@pytest.mark.skipif(unavailable_reason() is not None, reason="netlab needs root and iproute2")
def test_dry_run_on_two_nodes_shows_the_namespaces_and_makes_nothing():
    dep = Deployment(two_node_spec(fallback=False).model_copy(update={"model": ModelRef(name="pdlab-tiny")}))
    planned = dep.dry_run()
    prefill, decode = planned.instances
    assert prefill.argv[:3] == ["ip", "netns", "exec"] and prefill.argv[3].endswith("-prefill")
    assert decode.spec.host.startswith("10.77.") and decode.own_env["UCX_NET_DEVICES"] == "pdlab0"
    assert decode.own_env["UCX_TLS"] == "tcp,self" and planned.netlab["shaped"]["mbps"] == 100
    assert prefill.argv[3] not in leftovers()["namespaces"]
    assert planned.router is None
