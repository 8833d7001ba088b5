"""LMCache's settings, computed once (pdlab.lmcache.settings): the local lab's LMCache configs are the cluster's but
for addresses, transport and buffer device; LMCache's own loader takes them; the local plan gives every instance the
ports, environment and files LMCache needs; and the router hears LMCache's push reports as LMCache sends them."""

from __future__ import annotations

import asyncio
import copy
import time
from pathlib import Path

import pytest
import yaml
import zmq

from pdlab.cluster.plan import plan as cluster_plan
from pdlab.config import ConfigError, DeploymentSpec, LabSpec, load_lab, validate
from pdlab.config.router import RouterUpstreams
from pdlab.deploy.plan import PlanError, check_ports_free, plan_deployment
from pdlab.lmcache import settings
from pdlab.lmcache.push import PushListener, PushTimeout, PushWatch, decode_notification, encode_notification
from pdlab.router.kv import KVTransferFailed, make_kv_protocol
from tests.cluster.test_cluster_validate import lmcache_load
from tests.conftest import REPO

LOCAL = REPO / "labs" / "local-1p1d-lmcache.yaml"
CLUSTER = REPO / "labs" / "hyperpod-llama8b-1p1d.yaml"
#: What may differ between the two tiers' LMCache configs: addresses (where a receiver listens, where a sender
#: reports, LMCache's own HTTP server), the transport (UCX / EFA) and the buffer device (CPU / GPU).
TIER_KEYS = {"pd_peer_host", "pd_proxy_host", "pd_proxy_port", "pd_skip_proxy_notification", "nixl_backends",
             "pd_buffer_device", "internal_api_server_enabled", "internal_api_server_host",
             "internal_api_server_port_start"}


def local_plans(spec: DeploymentSpec | None = None) -> dict:
    spec = spec or load_lab(LOCAL).main_deployment()
    return {p.name: p for p in plan_deployment(spec, "/models/m", base_env={}, cores=[0, 1])}


def twin_cluster_lab() -> LabSpec:
    """The cluster lab with the local lab's LMCache settings and context length: the same lab, on GPUs."""
    local = load_lab(LOCAL).main_deployment()
    data = yaml.safe_load(CLUSTER.read_text())
    data["deployment"]["connector"]["lmcache"] = local.connector.lmcache.model_dump()
    data["deployment"]["model"]["max_model_len"] = 8192
    return validate(LabSpec, data)


def test_local_and_cluster_lmcache_configs_differ_only_in_addresses_transport_and_device():
    local = local_plans(load_lab(LOCAL).main_deployment().model_copy(
        update={"model": load_lab(LOCAL).main_deployment().model.model_copy(update={"max_model_len": 8192})}))
    cluster = cluster_plan(twin_cluster_lab())
    for role, name in (("prefill", "prefill-0"), ("decode", "decode-0")):
        ours, theirs = local[name].lmcache, getattr(cluster, role).lmcache
        differ = {key for key in ours.keys() | theirs.keys() if ours.get(key) != theirs.get(key)}
        assert differ <= TIER_KEYS, f"{role}: {sorted(differ - TIER_KEYS)} differ between the tiers"
        assert {ours["pd_buffer_device"], theirs["pd_buffer_device"]} == {"cpu", "cuda"}
        assert ours["pre_caching_hash_algorithm"] == theirs["pre_caching_hash_algorithm"] == "sha256_cbor"
        # vLLM's side: the same connector and role; locally through pdlab's module, with the hash seed to check.
        local_kv = next(a for a in local[name].argv if a.startswith('{"kv_connector"'))
        kv, cluster_kv = yaml.safe_load(local_kv), getattr(cluster, role).kv_transfer_config
        assert kv.pop("kv_connector_module_path") == settings.CPU_CONNECTOR_MODULE
        assert kv["kv_connector_extra_config"].pop(settings.HASH_SEED_KEY) == settings.HASH_SEED
        assert {**kv, "kv_buffer_device": "cuda"} == cluster_kv
        # Every process of either tier hashes prompts with the same seed.
        assert local[name].env["PYTHONHASHSEED"] == getattr(cluster, role).env["PYTHONHASHSEED"] == settings.HASH_SEED


def test_lmcache_loads_the_local_configs(tmp_path: Path):
    files = {}
    for name, plan in local_plans().items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(plan.lmcache))
        files[path] = plan.lmcache
    loaded = lmcache_load(list(files))
    for path, written in files.items():
        report = loaded[str(path)]
        assert report["ok"] and report["warnings"] == [], report
        assert report["user_set"] == sorted(written) and report["values"] == written


def test_offload_config_keeps_a_cpu_tier():
    spec = validate(DeploymentSpec, {"connector": {"kind": "lmcache", "lmcache": {"local_cpu_gib": 2}},
                                     "instances": [{"name": "solo", "role": "colocated", "cores": [0]}]})
    [plan] = plan_deployment(spec, "/models/m", base_env={}, cores=[0, 1])
    assert plan.lmcache["local_cpu"] is True and plan.lmcache["max_local_cpu_size"] == 2
    assert "enable_pd" not in plan.lmcache
    assert '"kv_role":"kv_both"' in " ".join(plan.argv)


def test_one_decode_instance_per_machine_and_its_ports_are_the_routers():
    """LMCache's receiver listens for allocation requests on every address of its machine, so a second decode
    instance on the machine would take the first's pushes: the local plan refuses it. The one decode instance's
    receiver ports are the ones the router names in every prefill request."""
    data = yaml.safe_load(LOCAL.read_text())["deployment"]
    spec = validate(DeploymentSpec, data)
    plans = local_plans(spec)
    ports = spec.connector.lmcache.receiver_ports(1)
    assert plans["decode-0"].lmcache["pd_peer_init_port"] == ports.init_ports
    assert plans["decode-0"].lmcache["pd_peer_alloc_port"] == ports.alloc_ports
    assert plans["prefill-0"].lmcache["pd_proxy_port"] == spec.connector.lmcache.notify_port
    taken = [p for plan in plans.values() for _, p in plan.lmcache_ports]
    assert len(taken) == len(set(taken)) == 2 * 2 + 2  # each: LMCache's HTTP ports; decode: init, alloc
    data["instances"].append({"name": "decode-1", "role": "decode", "cores": [1], "kv_cache_gib": 1})
    with pytest.raises(PlanError, match="one decode instance per machine"):
        local_plans(validate(DeploymentSpec, data))
    # A node is a machine of its own (tests/lmcache/test_lmcache_replicas.py runs this): one decode per node is fine,
    # two on one node are not.
    data["nodes"] = [{"name": "p"}, {"name": "a"}, {"name": "b"}]
    data["link"] = {"mbps": 1000}
    for inst, node in zip(data["instances"], ("p", "a", "b"), strict=True):
        inst["node"] = node
    assert len(local_plans(validate(DeploymentSpec, data))) == 3
    data["instances"][2]["node"] = "a"
    with pytest.raises(PlanError, match="node 'a' has 2"):
        local_plans(validate(DeploymentSpec, data))


def test_lmcache_ports_are_checked_free():
    data = yaml.safe_load(LOCAL.read_text())["deployment"]
    for i, inst in enumerate(data["instances"]):  # ports of this test's own, free whatever else runs here
        inst.update({"port": 18593 + i, "nixl_side_channel_port": 18595 + i})
    data["connector"]["lmcache"].update({"peer_init_port": 18597, "peer_alloc_port": 18697, "api_port": 18600})
    plans = list(local_plans(validate(DeploymentSpec, data)).values())
    taken = plans[1].lmcache["pd_peer_alloc_port"][0]
    with zmq.Context() as context, context.socket(zmq.PULL) as sock:
        sock.bind(f"tcp://127.0.0.1:{taken}")
        with pytest.raises(PlanError, match=f"decode-0: LMCache receiver port {taken}"):
            check_ports_free(plans)


@pytest.mark.parametrize(("change", "field"), [
    (lambda d: d.pop("router"), "router"),
    (lambda d: d["instances"].append({"name": "solo", "role": "colocated"}), "instances"),
])
def test_local_lmcache_pd_mistakes_name_the_field(change, field):
    data = copy.deepcopy(yaml.safe_load(LOCAL.read_text())["deployment"])
    change(data)
    with pytest.raises(ConfigError) as caught:
        validate(DeploymentSpec, data)
    assert any(where.endswith(field) or why.startswith(f"Value error, {field}:")
               for where, why in caught.value.problems), caught.value.problems


# --- LMCache's push reports --------------------------------------------------------------------------------------

def test_push_report_is_read_as_lmcache_writes_it():
    """The notification LMCache's sender sends (its own ProxyNotif type, encoded as it encodes it) decodes to its
    request id; anything else to None."""
    import msgspec
    from lmcache.v1.storage_backend.pd_backend_async import ProxyNotif

    assert decode_notification(msgspec.msgpack.encode(ProxyNotif(req_id="r-1"))) == "r-1"
    assert decode_notification(encode_notification("r-2")) == "r-2"
    assert decode_notification(b"\x00garbage") is None
    assert decode_notification(msgspec.msgpack.encode({"type": "CancelNotif", "req_id": "r-3"})) is None


def test_push_watch_waits_for_its_report_and_gives_up_in_time():
    async def scenario() -> tuple[float, float]:
        watch = PushWatch("127.0.0.1", 18591)
        await watch.start()
        context = zmq.Context()
        sender = context.socket(zmq.PUSH)
        sender.connect("tcp://127.0.0.1:18591")
        try:
            landed = watch.expect("mine")
            never = watch.expect("lost")
            sender.send(encode_notification("someone-else"))
            asyncio.get_running_loop().call_later(0.2, sender.send, encode_notification("mine"))
            waited = await watch.wait("mine", landed, timeout_s=5)
            start = time.monotonic()
            with pytest.raises(PushTimeout):
                await watch.wait("lost", never, timeout_s=0.3)
            return waited, time.monotonic() - start
        finally:
            sender.close(linger=0)
            context.term()
            await watch.close()

    waited, gave_up_after = asyncio.run(scenario())
    assert 0.1 < waited < 2
    assert 0.25 < gave_up_after < 2


def test_lmcache_protocol_waits_for_the_push_report():
    """The router's `lmcache` protocol (pdlab.router.kv): each prefill request names a push id of its own (the
    client's request id and a suffix), and the transfer has landed only once that push is reported; a push never
    reported fails the request in the time set, with KVTransferFailed naming the setting."""
    upstreams = RouterUpstreams(decode=["http://127.0.0.1:8101"], prefill=["http://127.0.0.1:8100"], model="m",
                                tokenizer="/m", lmcache_init_ports=[7300], lmcache_alloc_ports=[7400],
                                lmcache_notify_port=18590, lmcache_push_timeout_s=0.3)

    async def scenario() -> tuple[dict, float | None]:
        protocol = make_kv_protocol("lmcache", upstreams)
        await protocol.start()
        context = zmq.Context()
        sender = context.socket(zmq.PUSH)
        sender.connect("tcp://127.0.0.1:18590")
        try:
            pushed = protocol.open_transfer("req-1", "http://127.0.0.1:8101")
            again = protocol.open_transfer("req-1", "http://127.0.0.1:8101")  # a client repeating its id
            spec = pushed.prefill_params["disagg_spec"]
            assert spec["req_id"].startswith("req-1.") and spec["req_id"] != again.prefill_params[
                "disagg_spec"]["req_id"]
            assert (spec["receiver_host"], spec["receiver_init_port"], spec["receiver_alloc_port"]) == (
                "127.0.0.1", [7300], [7400])
            asyncio.get_running_loop().call_later(0.1, sender.send, encode_notification(spec["req_id"]))
            waited = await pushed.landed()
            with pytest.raises(KVTransferFailed, match="lmcache_push_timeout_s"):
                await again.landed()
            pushed.close()
            again.close()
            return spec, waited
        finally:
            sender.close(linger=0)
            context.term()
            await protocol.close()

    _, waited = asyncio.run(scenario())
    assert waited is not None and 0.05 < waited < 2
    # Without a port to hear reports on (a cluster's router replicas), nothing is waited for.
    quiet = make_kv_protocol("lmcache", upstreams.model_copy(update={"lmcache_notify_port": None}))
    assert asyncio.run(quiet.open_transfer("r", "http://127.0.0.1:8101").landed()) is None


def test_push_listener_for_the_warm_up():
    with PushListener("127.0.0.1", 18592) as listener, zmq.Context() as context, \
            context.socket(zmq.PUSH) as sender:
        sender.connect("tcp://127.0.0.1:18592")
        sender.send(encode_notification("other"))
        sender.send(encode_notification("warm-up"))
        assert listener.wait_for("warm-up", 5)
        assert not listener.wait_for("never", 0.2)


# --- LMCache's own account of a load's pushes and loads ---------------------------------------------------------

#: Log lines as LMCache 0.5.6 writes them (copied from a run of labs/hol-blocking.yaml's LMCache scenario); the
#: real format is checked against a live deployment in tests/lmcache/test_lmcache_pd.py.
STORED_LINE = ("\x1b[32;20m[2026-12-05 23:14:20,272] LMCache INFO:\x1b[0m [req_id=cmpl-{rid}-0-880b65be] Stored {n} "
               "out of total {n} tokens. size: 0.0078 GB, cost {ms} ms, throughput: 2.2983 GB/s; offload_time: "
               "2.9381 ms, put_time: 0.4208 ms \x1b[3m(cache_engine.py:588:lmcache.v1.cache_engine)\x1b[0m\n")
RETRIEVED_LINE = ("\x1b[32;20m[2026-12-05 23:14:20,659] LMCache INFO:\x1b[0m [req_id=cmpl-{rid}-0-b4d2d97d] Retrieved "
                  "{n} out of {n} required tokens (from {n} total tokens). size: 0.0078 gb, cost {ms} ms, throughput: "
                  "2.6724 GB/s; \x1b[3m(cache_engine.py:985:lmcache.v1.cache_)\x1b[0m\n")


def test_a_loads_pushes_and_loads_are_counted_per_request_from_lmcaches_log(tmp_path):
    """Only the lines written during the load count (an earlier request with the same id does not); a request
    loaded in part counts as recomputed; one with no line at all neither pushed nor loaded."""
    from pdlab.lmcache.figures import log_end, pd_account

    sender, receiver = tmp_path / "prefill-0.log", tmp_path / "decode-0.log"
    sender.write_text(STORED_LINE.format(rid="r00001", n=512, ms=99.0))  # the warm-up's, before the load
    receiver.write_text(RETRIEVED_LINE.format(rid="r00001", n=512, ms=99.0))
    since = {sender: log_end(sender)}, {receiver: log_end(receiver)}
    with sender.open("a") as log:
        for rid, n, ms in (("r00001", 512, 3.0), ("r00002", 2048, 57.0), ("r00003", 512, 5.0)):
            log.write(STORED_LINE.format(rid=rid, n=n, ms=ms))
    with receiver.open("a") as log:
        for rid, n, ms in (("r00001", 512, 2.0), ("r00002", 2048, 31.0), ("r00003", 256, 1.0)):
            log.write(RETRIEVED_LINE.format(rid=rid, n=n, ms=ms))
    prompts = {"r00001": 512, "r00002": 2048, "r00003": 512, "r00004": 600}
    account = pd_account(prompts, *since)
    assert account == {"disaggregated": 4, "pushed": 3, "pushed_tokens": 3072, "push_ms": {"median": 5.0, "max": 57.0},
                       "loaded": 3, "loaded_tokens": 2816, "load_ms": {"median": 2.0, "max": 31.0},
                       "loaded_in_full": 2, "recomputed": 2}
    # read from the start, the warm-up's lines would count too
    assert pd_account({"r00001": 512}, {sender: 0}, {receiver: 0})["pushed_tokens"] == 1024


def test_each_lines_size_is_read_in_bytes_from_lmcaches_gib(tmp_path):
    """LMCache writes a store's and a load's size in GiB ("GB" on a store, "gb" on a load) to four decimals: whole
    256-token chunks, the last one partly filled (2,000 tokens of pdlab-tiny's 4 KiB are 8 chunks' worth)."""
    from pdlab.lmcache.figures import LOGGED_SIZE_STEP, logged_tokens

    log = tmp_path / "decode-0.log"
    log.write_text(STORED_LINE.format(rid="a", n=2000, ms=4.0) + RETRIEVED_LINE.format(rid="a", n=2000, ms=6.0))
    counts = logged_tokens(log)["a"]
    assert counts["stored_bytes"] == counts["retrieved_bytes"] == 0.0078 * 2**30
    assert abs(counts["stored_bytes"] - 8 * 256 * 4096) < LOGGED_SIZE_STEP
    assert [counts[key] for key in ("stored", "stored_ms", "retrieved", "retrieved_ms")] == [2000, 4.0, 2000, 6.0]
