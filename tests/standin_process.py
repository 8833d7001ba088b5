"""Start pdlab's stand-in OpenAI server as a real process on loopback, for the measurement tests."""

from __future__ import annotations

import socket
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pdlab.deploy.process import serving

SRC = Path(__file__).resolve().parents[1] / "src"


@contextmanager
def standin(port: int, *flags: str) -> Iterator[str]:
    """Run `python -m pdlab.benchmarks.standin --port PORT FLAGS...` until the block ends; yields its base URL."""
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "pdlab.benchmarks.standin", "--port", str(port), *flags]
    with tempfile.TemporaryDirectory(prefix="pdlab-standin-") as logs, \
            serving(f"standin-{port}", argv, url + "/health", Path(logs) / "standin.log", timeout_s=20):
        yield url


def free_port() -> int:
    """A loopback port nothing listens on (the OS's pick, released at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
