"""Move a known number of bytes over TCP between two nodes and time it: the receiver runs in one namespace,
the sender in another, both as real processes (`python -m pdlab.netlab.mover recv|send ...`).

The receiver prints one JSON line with its port when listening, then one with the bytes received and the
seconds from accepting the connection to the sender's end of stream."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

CHUNK = 1 << 20
#: Seconds either side waits on the network before giving up.
SOCKET_TIMEOUT_S = 120.0


def receive(host: str) -> None:
    with socket.create_server((host, 0)) as server:
        server.settimeout(SOCKET_TIMEOUT_S)
        print(json.dumps({"port": server.getsockname()[1]}), flush=True)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(SOCKET_TIMEOUT_S)
            started = time.perf_counter()
            received = 0
            while data := conn.recv(CHUNK):
                received += len(data)
            seconds = time.perf_counter() - started
    print(json.dumps({"bytes": received, "seconds": seconds}), flush=True)


def send(host: str, port: int, nbytes: int, bind: str | None = None) -> None:
    payload = bytes(CHUNK)
    source = (bind, 0) if bind else None
    with socket.create_connection((host, port), timeout=SOCKET_TIMEOUT_S, source_address=source) as conn:
        left = nbytes
        while left > 0:
            conn.sendall(payload[: min(left, CHUNK)])
            left -= min(left, CHUNK)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # wait for the receiver to close: everything arrived


@dataclass(frozen=True)
class Transfer:
    bytes: int
    seconds: float

    @property
    def mbps(self) -> float:
        return self.bytes * 8 / self.seconds / 1e6


def transfer(sender_prefix: list[str], receiver_prefix: list[str], receiver_host: str, sender_host: str,
             nbytes: int) -> Transfer:
    """Send `nbytes` from a process started with `sender_prefix` (e.g. `ip netns exec NS`) to one started with
    `receiver_prefix`, listening on `receiver_host`; both processes are ended before returning."""
    module = [sys.executable, "-m", "pdlab.netlab.mover"]
    receiver = subprocess.Popen([*receiver_prefix, *module, "recv", "--host", receiver_host],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout is not None
        port = json.loads(receiver.stdout.readline())["port"]
        subprocess.run([*sender_prefix, *module, "send", "--host", receiver_host, "--port", str(port),
                        "--bytes", str(nbytes), "--bind", sender_host], check=True, timeout=SOCKET_TIMEOUT_S)
        result = json.loads(receiver.stdout.readline())
        receiver.wait(timeout=SOCKET_TIMEOUT_S)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    if result["bytes"] != nbytes:
        raise RuntimeError(f"receiver got {result['bytes']} bytes, {nbytes} were sent")
    return Transfer(result["bytes"], result["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    recv = sub.add_parser("recv")
    recv.add_argument("--host", required=True)
    snd = sub.add_parser("send")
    snd.add_argument("--host", required=True)
    snd.add_argument("--port", type=int, required=True)
    snd.add_argument("--bytes", type=int, required=True)
    snd.add_argument("--bind", default=None, help="source address (the sending node's)")
    args = parser.parse_args()
    try:
        if args.command == "recv":
            receive(args.host)
        else:
            send(args.host, args.port, args.bytes, args.bind)
    except KeyboardInterrupt:
        sys.exit(130)  # Ctrl-C reaches the whole process group; the parent reports it


if __name__ == "__main__":
    main()
