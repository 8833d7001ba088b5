"""End to end, real processes, as root: NIXL's transport moves bytes between two nodes over their shaped link, not
shared memory. vLLM on nodes is run end to end by notebook 03 (tests/course/test_notebooks.py: a 1P1D deployment on
two nodes moves its KV across the link, slower on a slower link, and writes the tokens one instance writes alone)
and, with LMCache and two decode replicas, by tests/lmcache/test_lmcache_replicas.py."""

from __future__ import annotations

import json

import pytest

from pdlab.netlab import leftovers, unavailable_reason
from pdlab.netlab.iproute import ip
from pdlab.netlab.topology import NODE_IFNAME

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(unavailable_reason() is not None, reason=f"netlab unavailable: {unavailable_reason()}"),
]


def sent_bytes(netns: str) -> int:
    return json.loads(ip("-s", "-j", "link", "show", NODE_IFNAME, netns=netns))[0]["stats64"]["tx"]["bytes"]


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
