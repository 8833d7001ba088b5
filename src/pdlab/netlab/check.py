"""`pdlab netlab check`: make two nodes, move a known amount of data across the shaped link, tear down, and
report the shaped and measured rates and anything left behind."""

from __future__ import annotations

from pdlab.config import LinkSpec, NodeSpec
from pdlab.netlab.mover import transfer
from pdlab.netlab.topology import NetLab, leftovers

#: The two nodes of the check, named like the deployment's roles.
SENDER, RECEIVER = "prefill", "decode"


def check(link: LinkSpec, nbytes: int, run_id: str | None = None) -> dict:
    """Send `nbytes` from the prefill node to the decode node (the KV cache's direction) and measure it."""
    with NetLab([NodeSpec(name=SENDER), NodeSpec(name=RECEIVER)], link, run_id=run_id) as lab:
        moved = transfer(lab.exec_prefix(SENDER), lab.exec_prefix(RECEIVER), lab.address(RECEIVER),
                         lab.address(SENDER), nbytes)
        described = lab.describe()
    return {
        "shaped_mbps": lab.rate.mbps,
        "measured_mbps": moved.mbps,
        "bytes": moved.bytes,
        "seconds": moved.seconds,
        "link": described["shaped"],
        "run_id": lab.run_id,
        "subnet": described["subnet"],
        "leftovers": leftovers(lab.run_id),
    }
