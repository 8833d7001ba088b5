"""Nodes on one machine: a network namespace per node, joined by a switch namespace whose ports are shaped.

    root namespace (router, load generator)          switch namespace `pdlab-<run>`
      pdl-<run>  10.77.X.254/24  <--veth-->  root ─┐
                                                  br0 ── p0 <==shaped veth==> pdlab0 10.77.X.1  `pdlab-<run>-prefill`
                                                      └─ p1 <==shaped veth==> pdlab0 10.77.X.2  `pdlab-<run>-decode`

Each node has one address on one interface (`pdlab0`), used for everything: its HTTP server, NIXL's side channel
and UCX's TCP transport. Node-to-node traffic (the KV cache) is bridged inside the switch namespace and never
enters the root namespace. Each node's interface is shaped with tbf in both directions (on `pdlab0` for what the
node sends, on its switch port for what it receives), like a NIC of that bandwidth; a prefill -> decode transfer
crosses two shaped hops of the same rate, so the link rate is what it gets. Nodes have no default route: they can
reach only each other and the root namespace's address on the test subnet.

Names carry the run id, so a later run finds what a crashed one left (`cleanup_stale`); a run holds an flock on
its lock file for its whole life, which the kernel releases when the process dies, so only dead runs are removed.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import re
import secrets
import signal
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path
from typing import IO

from pdlab.config import DeploymentSpec, LinkSpec, ModelRef, NodeSpec
from pdlab.netlab import iproute
from pdlab.netlab.presets import ShapedRate, burst_bytes, shaped_rate

#: The private range node subnets come from: 10.77.X.0/24, X chosen free per run. Used only inside pdlab's
#: namespaces and on the one root-namespace interface that reaches them.
SUBNET_POOL = ipaddress.ip_network("10.77.0.0/16")
#: The node-side interface name, the same in every node namespace (for UCX_NET_DEVICES).
NODE_IFNAME = "pdlab0"
#: Where run lock files live (tmpfs: gone after a reboot, like the namespaces themselves).
LOCK_DIR = Path("/run/pdlab-netlab")
#: tbf queue: packets waiting longer than this are dropped, so TCP sees the link's rate.
TBF_LATENCY = "50ms"
#: Transports that would move data through shared memory instead of across the link.
SHARED_MEMORY_TLS = {"sm", "shm", "mm", "posix", "sysv", "cma", "knem", "xpmem"}

RUN_ID_PATTERN = re.compile(r"^[a-z0-9]{1,10}$")


def run_netns(run_id: str) -> str:
    """The switch namespace's name; node namespaces add `-<node>`."""
    return f"{iproute.NETNS_PREFIX}{run_id}"


def run_link(run_id: str) -> str:
    """The root-namespace interface's name (15 characters at most)."""
    return f"{iproute.LINK_PREFIX}{run_id}"


def link_only_tls(ucx_tls: str) -> str:
    """UCX_TLS without shared-memory transports: namespaces share memory, and UCX would otherwise move the KV
    cache through it, bypassing the shaped link."""
    kept = [tls for tls in ucx_tls.split(",") if tls.strip() and tls.strip() not in SHARED_MEMORY_TLS]
    return ",".join(kept) or "tcp"


@contextmanager
def _flock(path: Path, blocking: bool) -> Iterator[IO[str] | None]:
    """Hold an exclusive flock on `path` (yield the open file), or yield None when not blocking and it is held."""
    LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
    handle = path.open("a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield None
            return
        yield handle
    finally:
        handle.close()


def _creation_lock() -> AbstractContextManager[IO[str] | None]:
    """Serialises subnet choice and stale-run removal between concurrent runs."""
    return _flock(LOCK_DIR / "create.lock", blocking=True)


def _run_lock_path(run_id: str) -> Path:
    return LOCK_DIR / f"{run_id}.lock"


def _runs_present() -> set[str]:
    """Run ids that have a namespace or a root-namespace interface."""
    runs = {name[len(iproute.NETNS_PREFIX):].split("-")[0] for name in iproute.namespaces()}
    runs |= {name[len(iproute.LINK_PREFIX):] for name in iproute.links()}
    return {run for run in runs if RUN_ID_PATTERN.match(run)}


def leftovers(run_id: str | None = None) -> dict[str, list[str]]:
    """pdlab's namespaces, root-namespace interfaces and their non-default qdiscs still present (of one run, or
    of all runs)."""
    ns_prefix = run_netns(run_id) if run_id else iproute.NETNS_PREFIX
    link_prefix = run_link(run_id) if run_id else iproute.LINK_PREFIX
    names = [n for n in iproute.namespaces(ns_prefix) if run_id is None or n == ns_prefix or
             n.startswith(ns_prefix + "-")]
    root_links = iproute.links(link_prefix)
    qdiscs = iproute.qdiscs(root_links)
    for netns in names:
        qdiscs += [f"{q}:{netns}" for q in iproute.qdiscs(iproute.links("", netns=netns), netns=netns)]
    return {"namespaces": names, "links": root_links, "qdiscs": qdiscs}


def _stop_processes(netns: str, grace_s: float = 5.0) -> None:
    """End processes still inside a namespace: the namespace (and its interfaces) lives while they run."""
    pids = iproute.namespace_pids(netns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = iproute.namespace_pids(netns)
        if not pids:
            return


def _remove_run(run_id: str, wait_s: float = 5.0) -> None:
    """Remove everything of one run; idempotent (missing parts are fine)."""
    iproute.ip("link", "del", run_link(run_id), check=False)
    names = [n for n in iproute.namespaces(run_netns(run_id))
             if n == run_netns(run_id) or n.startswith(run_netns(run_id) + "-")]
    for netns in names:
        _stop_processes(netns)
        iproute.ip("netns", "del", netns, check=False)
    # The kernel frees a deleted namespace's veths asynchronously; wait so "nothing left" is true on return.
    deadline = time.monotonic() + wait_s
    while iproute.links(run_link(run_id)) and time.monotonic() < deadline:
        time.sleep(0.05)
    _run_lock_path(run_id).unlink(missing_ok=True)


def cleanup_stale() -> list[str]:
    """Remove what runs that are no longer alive left behind (a crash, a SIGKILL); returns their run ids.
    Live runs (their lock held) are left alone."""
    removed = []
    with _creation_lock():
        for run_id in sorted(_runs_present()):
            with _flock(_run_lock_path(run_id), blocking=False) as held:
                if held is None:
                    continue
                _remove_run(run_id)
                removed.append(run_id)
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    """The first 10.77.X.0/24 overlapping no route and no address of the root namespace."""
    taken = []
    for entry in json.loads(iproute.ip("-j", "-4", "route", "show", "table", "all") or "[]"):
        dst = entry.get("dst", "")
        if dst and dst != "default":
            taken.append(ipaddress.ip_network(dst, strict=False))
    for entry in json.loads(iproute.ip("-j", "-4", "addr", "show") or "[]"):
        for addr in entry.get("addr_info", []):
            taken.append(ipaddress.ip_network(f"{addr['local']}/{addr['prefixlen']}", strict=False))
    for candidate in SUBNET_POOL.subnets(new_prefix=24):
        if not any(candidate.overlaps(net) for net in taken):
            return candidate
    raise iproute.NetLabUnavailable(f"no free /24 left in {SUBNET_POOL} for a pdlab netlab")


class NetLab:
    """Nodes in their own network namespaces, joined by links shaped to `link`'s rate. A context manager: makes
    everything on entry (removing dead runs' leftovers first) and removes everything on exit, error or Ctrl-C.

        with NetLab([NodeSpec(name="prefill"), NodeSpec(name="decode")], LinkSpec(preset="10gbe")) as lab:
            cmd = lab.exec_prefix("prefill") + ["python", "-m", "vllm.entrypoints.openai.api_server", ...]
            env = {**os.environ, **lab.env("prefill", ucx_tls="tcp,self,sm")}
    """

    def __init__(self, nodes: list[NodeSpec], link: LinkSpec, run_id: str | None = None,
                 model: ModelRef | None = None):
        names = [node.name for node in nodes]
        if not names:
            raise ValueError("nodes: a netlab needs at least one node")
        if len(set(names)) != len(names):
            raise ValueError(f"nodes: names must be unique, got {names}")
        if len(names) > 250:
            raise ValueError("nodes: at most 250 nodes fit one /24")
        self.run_id = run_id or secrets.token_hex(4)
        if not RUN_ID_PATTERN.match(self.run_id):
            raise ValueError(f"run_id {self.run_id!r}: use 1-10 lowercase letters or digits")
        self.nodes = names
        self.link = link
        self.rate: ShapedRate = shaped_rate(link, model)
        self.burst_bytes = burst_bytes(link, self.rate.mbps)
        self.subnet: ipaddress.IPv4Network | None = None
        self._lock_cm: AbstractContextManager[IO[str] | None] | None = None

    # -- what the deploy launcher uses ------------------------------------------------------------------------
    def netns(self, node: str | NodeSpec) -> str:
        return f"{run_netns(self.run_id)}-{self._name(node)}"

    def address(self, node: str | NodeSpec) -> str:
        """The node's one address: bind its HTTP server and NIXL side channel here; the router reaches it."""
        if self.subnet is None:
            raise RuntimeError("NetLab is not up: use it as a context manager")
        return str(self.subnet.network_address + 1 + self.nodes.index(self._name(node)))

    @property
    def root_address(self) -> str:
        """The root namespace's address on the node subnet (where the router's traffic comes from)."""
        if self.subnet is None:
            raise RuntimeError("NetLab is not up: use it as a context manager")
        return str(self.subnet.network_address + 254)

    def exec_prefix(self, node: str | NodeSpec) -> list[str]:
        """Prepend to a command to run it inside the node's namespace."""
        return ["ip", "netns", "exec", self.netns(node)]

    def env(self, node: str | NodeSpec, ucx_tls: str | None = None) -> dict[str, str]:
        """Environment for a vLLM instance on this node: NIXL's side channel on the node address, UCX on the
        node's interface, and (given the connector's UCX_TLS) shared-memory transports removed."""
        env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": self.address(node), "UCX_NET_DEVICES": NODE_IFNAME}
        if ucx_tls is not None:
            env["UCX_TLS"] = link_only_tls(ucx_tls)
        return env

    def describe(self) -> dict:
        """What was made, for run records and reports."""
        return {
            "run_id": self.run_id,
            "subnet": str(self.subnet) if self.subnet else None,
            "root_address": self.root_address if self.subnet else None,
            "nodes": {name: {"netns": self.netns(name), "interface": NODE_IFNAME,
                             "address": self.address(name) if self.subnet else None} for name in self.nodes},
            "shaped": {**self.rate.as_dict(), "burst_bytes": self.burst_bytes, "tbf_latency": TBF_LATENCY},
        }

    # -- lifecycle --------------------------------------------------------------------------------------------
    def __enter__(self) -> NetLab:
        iproute.preflight()
        cleanup_stale()
        lock_cm = _flock(_run_lock_path(self.run_id), blocking=False)
        if lock_cm.__enter__() is None:
            lock_cm.__exit__(None, None, None)
            raise RuntimeError(f"netlab run {self.run_id!r} is in use by a live process")
        self._lock_cm = lock_cm
        try:
            with _creation_lock():
                self.subnet = _free_subnet()
                self._create()
        except iproute.IprouteError as error:
            self.teardown()
            if "Operation not permitted" in str(error):  # root without CAP_SYS_ADMIN/CAP_NET_ADMIN (a container)
                raise iproute.NetLabUnavailable(f"pdlab netlab cannot make namespaces here: {error}") from None
            raise
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.teardown()

    def teardown(self) -> None:
        """Remove every namespace, interface and qdisc of this run, and end processes left in its namespaces.
        Safe to call twice."""
        _remove_run(self.run_id)
        if self._lock_cm is not None:
            self._lock_cm.__exit__(None, None, None)
            self._lock_cm = None

    def _create(self) -> None:
        assert self.subnet is not None
        switch = run_netns(self.run_id)
        prefix = self.subnet.prefixlen
        iproute.ip("netns", "add", switch)
        iproute.ip("link", "set", "lo", "up", netns=switch)
        iproute.ip("link", "add", "br0", "type", "bridge", netns=switch)
        iproute.ip("link", "set", "br0", "up", netns=switch)
        # The root namespace's way in: one veth end here, the other a port of the switch (unshaped).
        root_if = run_link(self.run_id)
        iproute.ip("link", "add", root_if, "type", "veth", "peer", "name", "root", "netns", switch)
        iproute.ip("link", "set", "root", "master", "br0", "up", netns=switch)
        iproute.ip("addr", "add", f"{self.root_address}/{prefix}", "dev", root_if)
        iproute.ip("link", "set", root_if, "up")
        for index, name in enumerate(self.nodes):
            netns, port = self.netns(name), f"p{index}"
            iproute.ip("netns", "add", netns)
            iproute.ip("link", "set", "lo", "up", netns=netns)
            iproute.ip("link", "add", port, "type", "veth", "peer", "name", NODE_IFNAME, "netns", netns,
                       netns=switch)
            iproute.ip("link", "set", port, "master", "br0", "up", netns=switch)
            iproute.ip("addr", "add", f"{self.address(name)}/{prefix}", "dev", NODE_IFNAME, netns=netns)
            iproute.ip("link", "set", NODE_IFNAME, "up", netns=netns)
            self._shape(NODE_IFNAME, netns)  # what the node sends
            self._shape(port, switch)  # what the node receives

    def set_rate(self, mbps: float) -> ShapedRate:
        """Re-shape the running link to `mbps` (both directions of every node, as at creation), without
        restarting what runs on the nodes: `tc qdisc change` on the same tbf qdiscs. Returns the new rate."""
        if self.subnet is None:
            raise RuntimeError("NetLab is not up: use it as a context manager")
        link = self.link.model_copy(update={"mbps": mbps})
        self.rate, self.burst_bytes = shaped_rate(link), burst_bytes(link, mbps)
        self.link = link
        for index, name in enumerate(self.nodes):
            self._shape(NODE_IFNAME, self.netns(name), "change")
            self._shape(f"p{index}", run_netns(self.run_id), "change")
        return self.rate

    def preview(self) -> NetLab:
        """This netlab with the subnet `__enter__` would take now (the first free one), making nothing: its
        addresses, namespaces and environment for a dry run. Not a running netlab: never enter it afterwards."""
        iproute.preflight()
        self.subnet = _free_subnet()
        return self

    def _shape(self, device: str, netns: str, verb: str = "add") -> None:
        kbit = max(1, round(self.rate.mbps * 1000))
        iproute.tc("qdisc", verb, "dev", device, "root", "tbf", "rate", f"{kbit}kbit",
                   "burst", str(self.burst_bytes), "latency", TBF_LATENCY, netns=netns)

    def _name(self, node: str | NodeSpec) -> str:
        name = node if isinstance(node, str) else node.name
        if name not in self.nodes:
            raise KeyError(f"no node {name!r} in this netlab; nodes: {self.nodes}")
        return name


def for_deployment(spec: DeploymentSpec, run_id: str | None = None) -> NetLab | None:
    """The NetLab a deployment asks for (enter it before starting instances), or None when it has no `nodes`,
    or when netlab cannot run here and `link.fallback_to_loopback` allows the loopback deployment instead (the
    caller should say so, with `unavailable_reason()`). Raises NetLabUnavailable otherwise."""
    if not spec.nodes:
        return None
    if reason := iproute.unavailable_reason():
        if spec.link.fallback_to_loopback:
            return None
        raise iproute.NetLabUnavailable(f"{reason} (or set link.fallback_to_loopback: true to run on loopback)")
    return NetLab(spec.nodes, spec.link, run_id=run_id, model=spec.model)
