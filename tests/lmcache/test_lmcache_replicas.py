"""LMCache's P/D with two decode replicas, real processes, as root: each decode instance on a node of its own (a
network namespace: LMCache's receiver takes its ports on every address of its machine, so two on one machine would
take each other's pushes), the prefill instance on a third, the router in the root namespace speaking LMCache's
protocol. Each long prompt's KV lands on the replica the router named and nowhere else, by LMCache's own log lines;
the pushes are reported to the router across the nodes' link (their 127.0.0.1 is their own); a prompt below one
LMCache chunk goes the same way and completes. Left out of `make test` for time: `pytest -m extended`."""

from __future__ import annotations

import httpx
import pytest

from pdlab.config import DeploymentSpec, validate
from pdlab.lmcache import figures
from pdlab.load.prompts import PromptBuilder
from pdlab.netlab import leftovers, unavailable_reason
from pdlab.settings import DECODE_REPLICA_HEADER, PATH_HEADER, REQUEST_ID_HEADER
from tests.conftest import TEST_MODEL

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.extended,  # three vLLM instances on nodes: about 80 s, which make test has no room for
    pytest.mark.skipif(unavailable_reason() is not None, reason=f"netlab unavailable: {unavailable_reason()}"),
]

PROMPT_TOKENS = 600  # two whole 256-token chunks and a part
SHORT_TOKENS = 200  # below one chunk, above the router's threshold


def spec() -> DeploymentSpec:
    return validate(DeploymentSpec, {
        "name": "pytest-lmcache-replicas",
        "model": {"name": TEST_MODEL},
        "connector": {"kind": "lmcache", "nixl_backends": ["UCX"], "ucx_tls": "tcp,self", "buffer_device": "cpu",
                      "lmcache": {"sender_buffer_bytes": 64 << 20, "receiver_buffer_bytes": 128 << 20,
                                  "peer_init_port": 18700, "peer_alloc_port": 18800, "notify_port": 18900,
                                  "api_port": None, "push_timeout_s": 10}},
        "nodes": [{"name": "prefill"}, {"name": "decode-a"}, {"name": "decode-b"}],
        "link": {"mbps": 1000},
        "router": {"threshold": 128, "port": 8259, "decode_strategy": "roundrobin"},
        "instances": [
            {"name": "prefill-0", "role": "prefill", "node": "prefill", "cores": [0], "port": 8250},
            {"name": "decode-0", "role": "decode", "node": "decode-a", "cores": [1], "port": 8251},
            {"name": "decode-1", "role": "decode", "node": "decode-b", "cores": [1], "port": 8252},
        ],
    })


def test_each_long_prompts_kv_lands_on_the_replica_the_router_named_and_nowhere_else(tmp_path):
    from pdlab.deploy import Deployment

    with Deployment(spec(), run_dir=tmp_path / "run") as dep:
        logs = {inst.url: inst.log_path for inst in dep.instances if inst.spec.role == "decode"}
        sender = dep.instance("prefill-0").log_path
        since = {path: figures.log_end(path) for path in [sender, *logs.values()]}  # after the warm-up's pushes
        builder = PromptBuilder(dep.model_dir)
        named = {}
        for i in range(4):
            rid = f"replica-{i}"
            body = {"model": dep.served_model, "prompt": builder.prompt(PROMPT_TOKENS, rid), "max_tokens": 4,
                    "temperature": 0.0, "ignore_eos": True}
            response = httpx.post(dep.router_url + "/v1/completions", json=body, headers={REQUEST_ID_HEADER: rid},
                                  timeout=120)
            assert response.status_code == 200, response.text
            assert response.headers[PATH_HEADER] == "disaggregated"
            named[rid] = response.headers[DECODE_REPLICA_HEADER]
        assert set(named.values()) == set(logs), f"round-robin should use both replicas: {named}"
        # A prompt shorter than one of LMCache's 256-token chunks goes the same way and completes.
        short = {"model": dep.served_model, "prompt": builder.prompt(SHORT_TOKENS, "replica-short"), "max_tokens": 4,
                 "temperature": 0.0, "ignore_eos": True}
        response = httpx.post(dep.router_url + "/v1/completions", json=short,
                              headers={REQUEST_ID_HEADER: "replica-short"}, timeout=120)
        assert response.status_code == 200 and response.headers[PATH_HEADER] == "disaggregated", response.text
        assert response.json()["usage"]["completion_tokens"] == 4

        pushed = figures.logged_tokens(sender, since[sender])
        loaded = {url: figures.logged_tokens(path, since[path]) for url, path in logs.items()}
        for rid, replica in named.items():
            assert pushed[rid]["stored"] == PROMPT_TOKENS, (rid, pushed.get(rid))
            assert loaded[replica][rid]["retrieved"] == PROMPT_TOKENS, (rid, replica, loaded[replica].get(rid))
            for other in set(logs) - {replica}:
                assert rid not in loaded[other], f"{rid}'s KV showed up on {other}, not only on {replica}"
    assert not any(leftovers().values()), leftovers()
