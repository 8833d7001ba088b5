"""Start pdlab's stand-in OpenAI server as a real process on loopback, for the measurement tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

SRC = Path(__file__).resolve().parents[1] / "src"


@contextmanager
def standin(port: int, *flags: str) -> Iterator[str]:
    """Run `python -m pdlab.standin --port PORT FLAGS...` until the block ends; yields its base URL."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    process = subprocess.Popen([sys.executable, "-m", "pdlab.standin", "--port", str(port), *flags], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"stand-in on port {port} did not start: {process.stderr.read().decode()[-500:]}")
            time.sleep(0.05)
        yield url
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        process.stderr.close()
