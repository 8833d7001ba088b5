"""End to end, real processes, as root: a 1P1D vLLM deployment whose instances run in their own network namespaces
moves its KV cache across the shaped link, and gives the same greedy tokens as one instance doing both phases."""

from __future__ import annotations

import ipaddress
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdlab.config import DeploymentSpec, validate
from pdlab.netlab import leftovers, unavailable_reason
from pdlab.netlab.iproute import ip
from pdlab.netlab.topology import NODE_IFNAME, SUBNET_POOL
from pdlab.pdrequest import pd_completion
from pdlab.settings import data_dir

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(unavailable_reason() is not None, reason=f"netlab unavailable: {unavailable_reason()}"),
]


def words(count: int) -> str:
    pool = (data_dir() / "corpus" / "serving-notes.txt").read_text().split()
    return " ".join(pool[i % len(pool)] for i in range(count))


def metric_sum(base_url: str, name: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name)


def sent_bytes(netns: str) -> int:
    return json.loads(ip("-s", "-j", "link", "show", NODE_IFNAME, netns=netns))[0]["stats64"]["tx"]["bytes"]


def test_pd_greedy_output_matches_across_namespaces(tmp_path):
    from pdlab.deploy import Deployment

    spec = validate(DeploymentSpec, {
        "name": "pytest-netlab",
        "model": {"name": "pdlab-tiny"},
        "connector": {"kind": "nixl", "nixl_backends": ["UCX"]},
        "nodes": [{"name": "prefill"}, {"name": "decode"}],
        "link": {"mbps": 200},
        "instances": [
            {"name": "prefill-0", "role": "prefill", "node": "prefill", "cores": [0]},
            {"name": "decode-0", "role": "decode", "node": "decode", "cores": [1]},
        ],
    })
    with Deployment(spec, run_dir=tmp_path / "run") as dep:
        prefill_url, decode_url = dep.urls("prefill")[0], dep.urls("decode")[0]
        for url in (prefill_url, decode_url):
            assert ipaddress.ip_address(httpx.URL(url).host) in SUBNET_POOL, f"{url} is not on a netlab node"
        prefill_ns = next(n for n in leftovers()["namespaces"] if n.endswith("-prefill"))

        prompt = words(600)  # several KV blocks
        body = {"model": dep.served_model, "prompt": prompt, "max_tokens": 24, "temperature": 0.0,
                "ignore_eos": True}
        reference = httpx.post(prefill_url + "/v1/completions", json=body, timeout=120).raise_for_status().json()

        moved_before = metric_sum(decode_url, "vllm:nixl_bytes_transferred_sum")
        sent_before = sent_bytes(prefill_ns)
        result = pd_completion(prefill_url, decode_url, dep.served_model, prompt, max_tokens=24, stream=False)
        moved = metric_sum(decode_url, "vllm:nixl_bytes_transferred_sum") - moved_before
        sent = sent_bytes(prefill_ns) - sent_before

        assert result.text == reference["choices"][0]["text"]
        assert result.kv_transfer_params and result.kv_transfer_params.get("remote_block_ids")
        assert result.kv_transfer_params.get("remote_host") == httpx.URL(prefill_url).host
        assert moved > 0, "the decode instance reports no NIXL bytes transferred"
        assert sent >= moved, f"the prefill node sent {sent} bytes on its link, less than the {moved} KV bytes moved"
    assert not any(leftovers().values()), leftovers()


def test_nixl_transfer_crosses_the_shaped_link():
    """A NIXL/UCX READ between the nodes (the KV cache's transport, without vLLM) goes over the node interfaces,
    not shared memory, and the link's shaping bounds it."""
    import tempfile
    from pathlib import Path

    from pdlab.config import LinkSpec, NodeSpec
    from pdlab.netlab import NetLab
    from pdlab.netlab.kvmover import transfer

    mbps, nbytes = 20, 2_500_000
    with NetLab([NodeSpec(name="prefill"), NodeSpec(name="decode")], LinkSpec(mbps=mbps)) as lab, \
            tempfile.TemporaryDirectory() as directory:
        before = sent_bytes(lab.netns("prefill"))
        env = {"sender": lab.env("prefill", "tcp,self,sm"), "receiver": lab.env("decode", "tcp,self,sm")}
        moved = transfer(lab.exec_prefix("prefill"), lab.exec_prefix("decode"), env, Path(directory), nbytes)
        assert sent_bytes(lab.netns("prefill")) - before >= nbytes
    # NIXL measured 83-86% of 20-50 Mbit/s links on a busy 2-core machine; it must never beat the link
    assert 0.5 * mbps <= moved.mbps <= 1.05 * mbps, f"NIXL moved {moved.mbps:.1f} Mbit/s over a {mbps} Mbit/s link"
    assert not any(leftovers(lab.run_id).values())
