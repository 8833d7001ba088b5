"""pdlab.netlab: link presets, and (as root, with iproute2) real namespaces, shaped links, measured transfers,
teardown that leaves nothing, and recovery after a run is killed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pdlab.config import ConfigError, DeploymentSpec, LinkSpec, ModelRef, NodeSpec, validate
from pdlab.netlab import NetLab, cleanup_stale, kv_bytes_per_token, leftovers, link_only_tls, shaped_rate
from pdlab.netlab.iproute import ip, namespace_pids, unavailable_reason
from pdlab.netlab.mover import transfer
from pdlab.netlab.presets import VETH_CAP_MBPS, reference_kv_bytes_per_token
from tests.conftest import as_in_a_terminal

SRC = str(Path(__file__).resolve().parents[2] / "src")
NODES = [NodeSpec(name="prefill"), NodeSpec(name="decode")]
#: A measured transfer must get this share of the shaped rate: TCP start-up and headers cost a few percent
#: (100 Mbit/s measured 95.9), and tbf's burst lets at most a little more through.
TOLERANCE = (0.70, 1.05)

needs_root = pytest.mark.skipif(unavailable_reason() is not None, reason=f"netlab unavailable: {unavailable_reason()}")


def nothing_left(run_id: str | None = None) -> bool:
    return not any(leftovers(run_id).values())


def pdlab_cli(*args: str, env: dict | None = None, prefix: list[str] = ()) -> subprocess.CompletedProcess:
    code = "import sys; from pdlab.cli import main; sys.argv[0] = 'pdlab'; main()"
    return subprocess.run([*prefix, sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": SRC, **(env or {})})


# -- presets and config (no root needed) ---------------------------------------------------------------------

def test_kv_bytes_per_token_of_catalog_model():
    # pdlab-small: 8 layers x (K, V) x 4 KV heads x 64 dims x 4 bytes (float32)
    assert kv_bytes_per_token(ModelRef(name="pdlab-small", dtype="float32")) == 8 * 2 * 4 * 64 * 4
    assert kv_bytes_per_token(ModelRef(name="pdlab-small", dtype="bfloat16")) == 8 * 2 * 4 * 64 * 2


def test_kv_bytes_per_token_from_local_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8, "hidden_size": 8192,
         "intermediate_size": 28672, "vocab_size": 128256}))  # Llama-3.1-70B's
    assert kv_bytes_per_token(ModelRef(name=str(tmp_path), dtype="bfloat16")) == reference_kv_bytes_per_token()
    with pytest.raises(ValueError, match="link.mbps"):
        kv_bytes_per_token(ModelRef(name=str(tmp_path / "absent")))


def test_presets_keep_their_ratios_until_the_veth_cap():
    small = ModelRef(name="pdlab-small", dtype="float32")
    rates = {p: shaped_rate(LinkSpec(preset=p), small) for p in ("1gbe", "10gbe", "100gbe", "efa-p5")}
    scale = kv_bytes_per_token(small) / reference_kv_bytes_per_token()
    assert rates["1gbe"].mbps == pytest.approx(1000 * scale)
    assert rates["10gbe"].mbps == pytest.approx(10 * rates["1gbe"].mbps)
    assert rates["100gbe"].mbps == pytest.approx(10 * rates["10gbe"].mbps)
    assert rates["efa-p5"].capped and rates["efa-p5"].mbps == VETH_CAP_MBPS
    assert not rates["100gbe"].capped
    # transfer time per token of context matches the real link for the reference model
    real_s = reference_kv_bytes_per_token() * 8 / 10e9
    assert kv_bytes_per_token(small) * 8 / (rates["10gbe"].mbps * 1e6) == pytest.approx(real_s)
    assert shaped_rate(LinkSpec(mbps=42), small).mbps == 42


def test_link_only_tls_drops_shared_memory():
    assert link_only_tls("tcp,self,sm") == "tcp,self"
    assert link_only_tls("sm,cma") == "tcp"


def test_link_spec_errors_name_the_field():
    spec = {"instances": [{"name": "p", "role": "prefill", "node": "a"}, {"name": "d", "role": "decode", "node": "b"}],
            "nodes": [{"name": "a"}, {"name": "b"}], "link": {"mbps": -5, "preset": "40gbe", "latency_ms": 1}}
    with pytest.raises(ConfigError) as caught:
        validate(DeploymentSpec, spec)
    fields = dict(caught.value.problems)
    assert {"link.mbps", "link.preset", "link.latency_ms"} <= set(fields)


def test_netlab_rejects_bad_names():
    with pytest.raises(ValueError, match="run_id"):
        NetLab(NODES, LinkSpec(), run_id="Bad-Id")
    with pytest.raises(ValueError, match="unique"):
        NetLab([NodeSpec(name="a"), NodeSpec(name="a")], LinkSpec())


# -- without root or without iproute2 --------------------------------------------------------------------------

AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


@pytest.fixture(scope="module")
def nobody_can_run_pdlab() -> None:
    """Dropping root needs root and setpriv, and user nobody must be able to read the checkout and the venv."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop it")
    probe = subprocess.run([*AS_NOBODY, sys.executable, "-c", "import pdlab.netlab"], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "PYTHONPATH": SRC, "HOME": "/tmp"})
    if probe.returncode != 0:
        pytest.skip(f"user nobody cannot import pdlab from this checkout: {probe.stderr.strip()[-200:]}")


def test_check_as_unprivileged_user_says_it_needs_root(nobody_can_run_pdlab):
    done = pdlab_cli("netlab", "check", prefix=AS_NOBODY, env={"HOME": "/tmp"})
    assert done.returncode == 2, done.stderr
    assert "needs root" in done.stderr and "sudo" in done.stderr
    assert done.stdout == ""


def test_check_without_iproute2_says_what_to_install(tmp_path):
    done = pdlab_cli("netlab", "check", env={"PATH": str(tmp_path)})
    assert done.returncode == 2
    assert "apt-get install iproute2" in done.stderr


@pytest.mark.parametrize("fallback", [True, False])
def test_deployment_falls_back_to_loopback_only_when_allowed(fallback, nobody_can_run_pdlab):
    code = textwrap.dedent(f"""
        from pdlab.config import DeploymentSpec, validate
        from pdlab.netlab import NetLabUnavailable, for_deployment
        spec = validate(DeploymentSpec, {{
            "instances": [{{"name": "p", "role": "prefill", "node": "a"}},
                          {{"name": "d", "role": "decode", "node": "b"}}],
            "nodes": [{{"name": "a"}}, {{"name": "b"}}], "link": {{"fallback_to_loopback": {fallback}}}}})
        try:
            print("loopback" if for_deployment(spec) is None else "netlab")
        except NetLabUnavailable as error:
            print("refused:", error)
    """)
    done = subprocess.run([*AS_NOBODY, sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": SRC, "HOME": "/tmp"})
    assert done.returncode == 0, done.stderr
    if fallback:
        assert done.stdout.strip() == "loopback"
    else:
        assert done.stdout.startswith("refused: pdlab netlab needs root")
        assert "fallback_to_loopback" in done.stdout


# -- real namespaces (root) ------------------------------------------------------------------------------------

def root_link_bytes(lab: NetLab) -> int:
    stats = json.loads(ip("-s", "-j", "link", "show", f"pdl-{lab.run_id}"))[0]["stats64"]
    return stats["rx"]["bytes"] + stats["tx"]["bytes"]


@needs_root
def test_create_and_teardown_leave_nothing():
    with NetLab(NODES, LinkSpec(mbps=200)) as lab:
        present = leftovers(lab.run_id)
        assert len(present["namespaces"]) == 3  # the switch and two nodes
        assert present["links"] == [f"pdl-{lab.run_id}"]
        assert sum(q.startswith("tbf@") for q in present["qdiscs"]) == 4  # each node, both directions
        assert lab.address("prefill") != lab.address("decode")
        assert lab.address("prefill").startswith("10.77.")
    assert nothing_left(lab.run_id)
    lab.teardown()  # idempotent
    assert nothing_left(lab.run_id)


@needs_root
def test_node_to_node_traffic_stays_off_the_root_namespace():
    with NetLab(NODES, LinkSpec(mbps=1000)) as lab:
        before = root_link_bytes(lab)
        transfer(lab.exec_prefix("prefill"), lab.exec_prefix("decode"), lab.address("decode"),
                 lab.address("prefill"), 5_000_000)
        assert root_link_bytes(lab) - before < 100_000  # neighbour discovery chatter at most, no payload
        # and the root namespace reaches each node (where the router runs)
        moved = transfer([], lab.exec_prefix("decode"), lab.address("decode"), lab.root_address, 1_000_000)
        assert moved.bytes == 1_000_000
        assert root_link_bytes(lab) - before > 1_000_000


@needs_root
@pytest.mark.parametrize(("mbps", "nbytes"), [(20, 2_500_000), (100, 10_000_000)])
def test_measured_transfer_is_within_tolerance_of_the_shaped_rate(mbps, nbytes):
    with NetLab(NODES, LinkSpec(mbps=mbps)) as lab:
        moved = transfer(lab.exec_prefix("prefill"), lab.exec_prefix("decode"), lab.address("decode"),
                         lab.address("prefill"), nbytes)
    low, high = TOLERANCE
    assert low * mbps <= moved.mbps <= high * mbps, f"measured {moved.mbps:.1f} Mbit/s, shaped {mbps}"
    assert nothing_left(lab.run_id)


@needs_root
def test_error_inside_tears_down():
    with pytest.raises(RuntimeError, match="boom"), NetLab(NODES, LinkSpec()) as lab:
        raise RuntimeError("boom")
    assert nothing_left(lab.run_id)


@needs_root
def test_cleanup_leaves_live_runs_alone():
    with NetLab(NODES, LinkSpec()) as lab:
        assert lab.run_id not in cleanup_stale()
        assert leftovers(lab.run_id)["namespaces"]
        with pytest.raises(RuntimeError, match="in use"), NetLab(NODES, LinkSpec(), run_id=lab.run_id):
            pass
        assert len(leftovers(lab.run_id)["namespaces"]) == 3
    assert nothing_left(lab.run_id)


@needs_root
def test_second_run_after_sigkill_starts_clean(tmp_path):
    run_id = "killed" + os.urandom(2).hex()
    code = textwrap.dedent(f"""
        import subprocess, time
        from pdlab.config import LinkSpec, NodeSpec
        from pdlab.netlab import NetLab
        from pdlab.netlab.iproute import namespace_pids
        lab = NetLab([NodeSpec(name="prefill"), NodeSpec(name="decode")], LinkSpec(mbps=100), run_id="{run_id}")
        lab.__enter__()
        # an instance that outlives its launcher
        subprocess.Popen(lab.exec_prefix("decode") + ["sleep", "600"], start_new_session=True)
        while not namespace_pids(lab.netns("decode")):
            time.sleep(0.01)
        print("ready", flush=True)
        time.sleep(600)
    """)
    creator = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": SRC})
    try:
        assert creator.stdout.readline().strip() == "ready"
        orphans = namespace_pids(f"pdlab-{run_id}-decode")
        assert orphans
        creator.send_signal(signal.SIGKILL)
        creator.wait(timeout=10)
        left = leftovers(run_id)
        assert len(left["namespaces"]) == 3 and left["links"] and left["qdiscs"]
        with NetLab(NODES, LinkSpec()) as second:  # entering removes dead runs' leftovers first
            assert nothing_left(run_id)
            assert second.run_id != run_id
        for pid in orphans:
            assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
        assert nothing_left(run_id)
    finally:
        if creator.poll() is None:
            creator.kill()
            creator.wait()
        cleanup_stale()


@needs_root
def test_check_command_prints_json_and_leaves_nothing():
    done = pdlab_cli("netlab", "check", "--mbps", "100", "--bytes", "5000000")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["shaped_mbps"] == 100
    assert result["bytes"] == 5_000_000
    assert TOLERANCE[0] * 100 <= result["measured_mbps"] <= TOLERANCE[1] * 100
    assert result["leftovers"] == {"namespaces": [], "links": [], "qdiscs": []}


@needs_root
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_check_interrupted_mid_transfer_tears_down(sig):
    code = "import sys; from pdlab.cli import main; sys.argv[0] = 'pdlab'; main()"
    run_id = "int" + os.urandom(3).hex()
    check = subprocess.Popen([sys.executable, "-c", code, "netlab", "check", "--mbps", "2", "--bytes", "50000000",
                              "--run-id", run_id],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                             env={**os.environ, "PYTHONPATH": SRC}, preexec_fn=as_in_a_terminal)
    try:
        deadline = time.monotonic() + 30
        while len(leftovers(run_id)["qdiscs"]) < 4 and time.monotonic() < deadline:  # wait until the link is up
            time.sleep(0.1)
        assert leftovers(run_id)["namespaces"], "the check never made its namespaces"
        time.sleep(0.5)  # mid-transfer
        os.killpg(check.pid, sig)  # like Ctrl-C in a terminal: the whole foreground process group
        check.communicate(timeout=30)
        assert check.returncode == 128 + sig
    finally:
        if check.poll() is None:
            os.killpg(check.pid, signal.SIGKILL)
            check.wait()
    assert nothing_left(run_id)


def test_two_nodes_link_lab_validates_and_orders_its_links():
    from pdlab.config import load_lab

    lab = load_lab(Path(__file__).resolve().parents[2] / "labs" / "two-nodes-link.yaml")
    linked = {name: spec for name, spec in lab.scenarios.items() if spec.nodes}
    assert len(linked) == 4
    rates = [shaped_rate(spec.link, spec.model).mbps for spec in linked.values()]
    assert rates == sorted(rates, reverse=True) and len(set(rates)) == 4
    for spec in linked.values():
        assert all(inst.node for inst in spec.instances)
        assert link_only_tls(spec.connector.ucx_tls) == spec.connector.ucx_tls  # nothing bypasses the link


def tbf_rates(lab: NetLab) -> list[str]:
    """The rate of every tbf qdisc of a run (each node's interface and its switch port)."""
    rates = []
    for netns in leftovers(lab.run_id)["namespaces"]:
        for device in json.loads(ip("-j", "link", "show", netns=netns) or "[]"):
            out = subprocess.run(["tc", "-n", netns, "-j", "qdisc", "show", "dev", device["ifname"]],
                                 capture_output=True, text=True).stdout
            rates += [q["options"]["rate"] for q in json.loads(out or "[]") if q.get("kind") == "tbf"]
    return rates


@needs_root
def test_set_rate_reshapes_the_running_link():
    with NetLab(NODES, LinkSpec(mbps=200)) as lab:
        assert len(tbf_rates(lab)) == 4
        rate = lab.set_rate(20)
        assert rate.mbps == 20 and lab.describe()["shaped"]["mbps"] == 20
        assert set(tbf_rates(lab)) == {20_000_000 // 8}, "tc reports rates in bytes per second"
        moved = transfer(lab.exec_prefix("prefill"), lab.exec_prefix("decode"), lab.address("decode"),
                         lab.address("prefill"), 2_500_000)
    low, high = TOLERANCE
    assert low * 20 <= moved.mbps <= high * 20, f"measured {moved.mbps:.1f} Mbit/s after re-shaping to 20"
    assert nothing_left(lab.run_id)


def test_set_rate_needs_a_running_netlab():
    with pytest.raises(RuntimeError, match="not up"):
        NetLab(NODES, LinkSpec(mbps=200)).set_rate(10)


def test_every_preset_is_a_catalog_link_at_a_nodes_bandwidth():
    """One home per link speed: the presets read data/catalog/links.yaml (EFA's per-GPU share times a p5 node's 8)."""
    from typing import get_args

    from pdlab.config import LinkPreset
    from pdlab.netlab import PRESET_LINKS, real_link

    assert set(PRESET_LINKS) == set(get_args(LinkPreset))
    assert {p: real_link(p).gbps for p in PRESET_LINKS} == {"efa-p5": 3200, "100gbe": 100, "10gbe": 10, "1gbe": 1}
    assert "8 x 400 Gbit/s" in real_link("efa-p5").description
