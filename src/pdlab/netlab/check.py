"""`pdlab netlab check`: make two nodes, move a known amount of data across the shaped link, tear down, and
report the shaped and measured rates and anything left behind."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal

from pdlab.config import LinkSpec, NodeSpec
from pdlab.netlab import kvmover, mover
from pdlab.netlab.topology import NetLab, leftovers

#: The two nodes of the check, named like the deployment's roles.
SENDER, RECEIVER = "prefill", "decode"

Mover = Literal["tcp", "nixl"]
"""`tcp`: plain Python sockets (what the link itself carries). `nixl`: a NIXL/UCX READ, as vLLM's NixlConnector
moves a KV cache (what the KV path gets; needs the `local` extra)."""


def check(link: LinkSpec, nbytes: int, run_id: str | None = None, how: Mover = "tcp",
          ucx_tls: str = "tcp,self") -> dict:
    """Move `nbytes` from the prefill node to the decode node (the KV cache's direction) and measure it."""
    with NetLab([NodeSpec(name=SENDER), NodeSpec(name=RECEIVER)], link, run_id=run_id) as lab:
        if how == "nixl":
            env = {"sender": lab.env(SENDER, ucx_tls), "receiver": lab.env(RECEIVER, ucx_tls)}
            with tempfile.TemporaryDirectory(prefix="pdlab-netlab-") as directory:
                moved = kvmover.transfer(lab.exec_prefix(SENDER), lab.exec_prefix(RECEIVER), env, Path(directory),
                                         nbytes)
        else:
            moved = mover.transfer(lab.exec_prefix(SENDER), lab.exec_prefix(RECEIVER), lab.address(RECEIVER),
                                   lab.address(SENDER), nbytes)
        described = lab.describe()
    return {
        "shaped_mbps": lab.rate.mbps,
        "measured_mbps": moved.mbps,
        "bytes": moved.bytes,
        "seconds": moved.seconds,
        "mover": how,
        "link": described["shaped"],
        "run_id": lab.run_id,
        "subnet": described["subnet"],
        "leftovers": leftovers(lab.run_id),
    }
