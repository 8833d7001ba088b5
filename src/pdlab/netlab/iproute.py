"""Thin wrappers over iproute2's `ip` and `tc` (run as subprocesses: the commands a learner can type themselves),
the root/tool preflight, and the inventory of pdlab's network objects (to find leftovers)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

#: Every network namespace pdlab makes is named `pdlab-<run>[-<node>]`.
NETNS_PREFIX = "pdlab-"
#: Every interface pdlab makes in the root namespace is named `pdl-<run>` (interface names are at most 15 chars).
LINK_PREFIX = "pdl-"


class NetLabUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, or iproute2 missing); the message says what to do."""


class IprouteError(RuntimeError):
    """An `ip`/`tc` command failed; the message has the command and its stderr."""


def unavailable_reason() -> str | None:
    """Why pdlab.netlab cannot run here, or None when it can."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return (f"pdlab netlab needs iproute2's {' and '.join(missing)} (not found on PATH): "
                "install it (Debian/Ubuntu: `apt-get install iproute2`)")
    if os.geteuid() != 0:
        return ("pdlab netlab needs root to make network namespaces and shape links (it runs `ip netns add` and "
                "`tc qdisc add`): run it with sudo, or use a loopback lab")
    return None


def preflight() -> None:
    """Raise NetLabUnavailable when namespaces cannot be made here."""
    if reason := unavailable_reason():
        raise NetLabUnavailable(reason)


def run(*args: str, check: bool = True) -> str:
    """Run one command; on failure raise IprouteError naming it (or return "" when check is False)."""
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        if check:
            raise IprouteError(f"`{' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
        return ""
    return done.stdout


def ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    return run("ip", *(("-n", netns) if netns else ()), *args, check=check)


def tc(*args: str, netns: str | None = None, check: bool = True) -> str:
    return run("tc", *(("-n", netns) if netns else ()), *args, check=check)


def namespaces(prefix: str = NETNS_PREFIX) -> list[str]:
    """Network namespaces whose name starts with `prefix`."""
    out = ip("-j", "netns", "list", check=False)
    names = [entry["name"] for entry in json.loads(out)] if out.strip() else []
    return sorted(name for name in names if name.startswith(prefix))


def links(prefix: str = LINK_PREFIX, netns: str | None = None) -> list[str]:
    """Interfaces (in the root namespace, or `netns`) whose name starts with `prefix`."""
    out = ip("-j", "link", "show", netns=netns, check=False)
    names = [entry["ifname"] for entry in json.loads(out)] if out.strip() else []
    return sorted(name for name in names if name.startswith(prefix))


def qdiscs(devices: list[str], netns: str | None = None) -> list[str]:
    """Non-default qdiscs (`kind@device`) on the given devices."""
    found = []
    for device in devices:
        out = tc("-j", "qdisc", "show", "dev", device, netns=netns, check=False)
        for entry in json.loads(out) if out.strip() else []:
            if entry.get("kind") not in ("noqueue", "pfifo_fast", "fq_codel", "mq", "noop"):
                found.append(f"{entry['kind']}@{device}")
    return found


def namespace_pids(netns: str) -> list[int]:
    """Processes running in a network namespace."""
    return [int(pid) for pid in run("ip", "netns", "pids", netns, check=False).split()]
