"""Real processes on loopback for the router tests: stand-in OpenAI servers and pdlab routers."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from pdlab.config.router import RouterSpec
from pdlab.router.process import router_command

HOST = "127.0.0.1"
MODEL = "pdlab-tiny"


def url(port: int) -> str:
    return f"http://{HOST}:{port}"


@contextlib.contextmanager
def running(argv: list[str], health: str, log: Path, env: dict[str, str] | None = None,
            timeout_s: float = 30.0) -> Iterator[subprocess.Popen]:
    """Start `argv`, wait until `health` answers 200, and always stop it afterwards."""
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{argv[:4]} exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(health, timeout=1.0).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{health} not healthy after {timeout_s} s:\n{log.read_text()[-2000:]}")
                time.sleep(0.1)
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def standin(port: int, log_dir: Path, *flags: str) -> contextlib.AbstractContextManager[subprocess.Popen]:
    argv = [sys.executable, "-m", "pdlab.standin", "--port", str(port), "--model", MODEL, "--name", f"s{port}",
            *flags]
    return running(argv, url(port) + "/health", log_dir / f"standin-{port}.log")


def router(port: int, log_dir: Path, tokenizer_dir: str, prefill: list[int], decode: list[int],
           env: dict[str, str] | None = None, **spec: object) -> contextlib.AbstractContextManager[subprocess.Popen]:
    argv = router_command(RouterSpec(port=port, **spec), [url(p) for p in prefill], [url(p) for p in decode], MODEL,
                          tokenizer_dir, None, 16)
    return running(argv, url(port) + "/health", log_dir / f"router-{port}.log", env=env)


def metric(base_url: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus metric (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=5.0).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0
