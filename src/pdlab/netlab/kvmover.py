"""Move a known number of bytes the way vLLM's NixlConnector moves a KV cache: a NIXL agent with the UCX backend on
each node, the decode side READing registered memory of the prefill side. Agent metadata is exchanged through
files in a shared directory (the data itself crosses the network).

    python -m pdlab.netlab.kvmover serve --dir D --bytes N   # prefill node: registers N bytes, waits for `done`
    python -m pdlab.netlab.kvmover fetch --dir D             # decode node: reads them, prints JSON, writes `done`
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pdlab.netlab.mover import SOCKET_TIMEOUT_S, Transfer

#: A recognisable byte pattern, checked on arrival.
PATTERN = np.arange(251, dtype=np.uint8)


def _agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _wait_for(path: Path, timeout_s: float = SOCKET_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f} s")
        time.sleep(0.01)


def serve(directory: Path, nbytes: int) -> None:
    agent = _agent("prefill")
    buffer = np.resize(PATTERN, nbytes)
    agent.register_memory([(buffer.ctypes.data, nbytes, 0, "")], "DRAM")
    descs = agent.get_xfer_descs([(buffer.ctypes.data, nbytes, 0)], "DRAM")
    (directory / "prefill.meta.tmp").write_bytes(agent.get_agent_metadata())
    (directory / "prefill.descs").write_bytes(agent.get_serialized_descs(descs))
    os.replace(directory / "prefill.meta.tmp", directory / "prefill.meta")  # appears complete
    _wait_for(directory / "done")


def fetch(directory: Path) -> None:
    _wait_for(directory / "prefill.meta")
    agent = _agent("decode")
    remote = agent.add_remote_agent((directory / "prefill.meta").read_bytes())
    remote_descs = agent.deserialize_descs((directory / "prefill.descs").read_bytes())
    nbytes = int((directory / "bytes").read_text())
    buffer = np.zeros(nbytes, dtype=np.uint8)
    agent.register_memory([(buffer.ctypes.data, nbytes, 0, "")], "DRAM")
    local_descs = agent.get_xfer_descs([(buffer.ctypes.data, nbytes, 0)], "DRAM")
    handle = agent.initialize_xfer("READ", local_descs, remote_descs, remote)
    started = time.perf_counter()
    state = agent.transfer(handle)
    deadline = time.monotonic() + SOCKET_TIMEOUT_S
    while state == "PROC" and time.monotonic() < deadline:
        state = agent.check_xfer_state(handle)
    seconds = time.perf_counter() - started
    if state != "DONE":
        raise RuntimeError(f"NIXL transfer ended in state {state}")
    intact = bool(np.array_equal(buffer, np.resize(PATTERN, nbytes)))
    (directory / "done").touch()
    print(json.dumps({"bytes": nbytes, "seconds": seconds, "intact": intact}), flush=True)


def transfer(sender_prefix: list[str], receiver_prefix: list[str], env: dict[str, dict[str, str]],
             directory: Path, nbytes: int) -> Transfer:
    """Move `nbytes` from a NIXL agent started with `sender_prefix` to one started with `receiver_prefix`
    (`env["sender"]`/`env["receiver"]` add to each one's environment, e.g. UCX_NET_DEVICES)."""
    module = [sys.executable, "-m", "pdlab.netlab.kvmover"]
    (directory / "bytes").write_text(str(nbytes))
    server = subprocess.Popen([*sender_prefix, *module, "serve", "--dir", str(directory), "--bytes", str(nbytes)],
                              env={**os.environ, **env["sender"]}, stdout=subprocess.DEVNULL)  # NIXL logs there
    try:
        done = subprocess.run([*receiver_prefix, *module, "fetch", "--dir", str(directory)], capture_output=True,
                              text=True, timeout=SOCKET_TIMEOUT_S, env={**os.environ, **env["receiver"]})
        if done.returncode != 0:
            raise RuntimeError(f"NIXL fetch failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        server.wait(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    if not result["intact"] or result["bytes"] != nbytes:
        raise RuntimeError(f"NIXL moved {result['bytes']} bytes, intact={result['intact']}; expected {nbytes}")
    return Transfer(result["bytes"], result["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    srv = sub.add_parser("serve")
    srv.add_argument("--dir", type=Path, required=True)
    srv.add_argument("--bytes", type=int, required=True)
    fch = sub.add_parser("fetch")
    fch.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args()
    try:
        if args.command == "serve":
            serve(args.dir, args.bytes)
        else:
            fetch(args.dir)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
