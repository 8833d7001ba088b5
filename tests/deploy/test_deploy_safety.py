"""Safe defaults of a real deployment (the session's 1P1D of pdlab-tiny): UCX listens on loopback only; the admin
token is in no log, command line or deployment.json; killing one instance's API-server process leaves no engine
running, and `pdlab restart` brings the instance back while the router keeps serving."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import time

import httpx
import psutil

from pdlab.config import DeploymentSpec
from pdlab.deploy import Deployment
from pdlab.settings import PATH_HEADER, REASON_HEADER
from tests.conftest import ROUTER_THRESHOLD, run_pdlab


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def test_ucx_and_every_instance_port_listen_on_loopback_only(live_1p1d: Deployment):
    """vLLM's workers open UCX listeners (its TCP transport) beside the HTTP and NIXL side-channel ports: with
    UCX_NET_DEVICES=lo, none of them listens on another interface."""
    listening = []
    for inst in live_1p1d.instances:
        for proc in tree(inst.pid):
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    listening.append((inst.name, proc.pid, conn.laddr.ip, conn.laddr.port))
    assert len(listening) > 2 * len(live_1p1d.instances)  # HTTP, side channel and UCX's own, per instance
    exposed = [entry for entry in listening if not ipaddress.ip_address(entry[2]).is_loopback]
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_the_admin_token_is_in_no_log_argv_or_deployment_json(live_1p1d: Deployment):
    token = live_1p1d.admin_token
    assert token
    run_dir = live_1p1d.run_dir
    for path in [run_dir / "deployment.json", *run_dir.glob("*.log")]:
        assert token not in path.read_text(errors="replace"), path
    assert token not in " ".join(psutil.Process(live_1p1d.router.pid).cmdline())


def test_a_spec_token_never_reaches_deployment_json(tmp_path):
    spec = DeploymentSpec.model_validate({
        "name": "secret", "model": {"name": "pdlab-tiny"}, "router": {"admin_token": "s3cret-token"},
        "instances": [{"name": "prefill-0", "role": "prefill"}, {"name": "decode-0", "role": "decode"}]})
    record = Deployment(spec, run_dir=tmp_path)._record([])
    assert "s3cret" not in json.dumps(record) and "admin_token" not in record["spec"]["router"]


def test_killing_an_api_server_leaves_no_engine_and_restart_brings_it_back(live_1p1d: Deployment):
    base = live_1p1d.router_url
    long_prompt = {"model": live_1p1d.served_model, "prompt": "word " * (ROUTER_THRESHOLD + 50), "max_tokens": 4}
    decode = live_1p1d.instance("decode-0")
    engine = tree(decode.pid)[1:]
    assert engine, "vLLM's API server has an engine process"
    os.kill(decode.pid, signal.SIGKILL)  # the API server only, as a user killing "the vLLM pid" does
    _, alive = psutil.wait_procs(engine, timeout=10)
    assert not alive, f"left running after their API server was killed: {[p.cmdline()[:3] for p in alive]}"
    # Meanwhile the router serves from the prefill instance, as if colocated: nothing is lost.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and httpx.get(base + "/health", timeout=5).json()["status"] == "ok":
        time.sleep(0.2)
    served = httpx.post(base + "/v1/completions", json=long_prompt, timeout=60)
    assert served.status_code == 200, served.text
    assert served.headers[PATH_HEADER] == "prefill" and served.headers[REASON_HEADER] == "decode_empty"

    restart = run_pdlab("restart", live_1p1d.spec.name, "decode-0", timeout=600)
    assert restart.returncode == 0, restart.stdout + restart.stderr
    back = Deployment.attach(live_1p1d.spec.name).instance("decode-0")
    assert back.pid != decode.pid and back.process.alive()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and httpx.get(base + "/health", timeout=5).json()["status"] != "ok":
        time.sleep(0.2)
    again = httpx.post(base + "/v1/completions", json=long_prompt, timeout=60)
    assert again.status_code == 200 and again.headers[PATH_HEADER] == "disaggregated", again.headers
