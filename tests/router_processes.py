"""Real processes on loopback for the router tests: stand-in OpenAI servers and pdlab routers."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import httpx

from pdlab.config.router import RouterSpec, RouterUpstreams
from pdlab.deploy.process import ManagedProcess, serving
from pdlab.router.process import router_command

HOST = "127.0.0.1"
MODEL = "pdlab-tiny"


def url(port: int) -> str:
    return f"http://{HOST}:{port}"


def running(argv: list[str], health: str, log: Path, env: dict[str, str] | None = None,
            timeout_s: float = 30.0) -> contextlib.AbstractContextManager[ManagedProcess]:
    """Start `argv`, wait until `health` answers 200, and always stop it afterwards."""
    return serving(log.stem, argv, health, log, env, timeout_s)


def standin(port: int, log_dir: Path, *flags: str) -> contextlib.AbstractContextManager[ManagedProcess]:
    argv = [sys.executable, "-m", "pdlab.benchmarks.standin", "--port", str(port), "--model", MODEL,
            "--name", f"s{port}", *flags]
    return running(argv, url(port) + "/health", log_dir / f"standin-{port}.log")


def router(port: int, log_dir: Path, tokenizer_dir: str, prefill: list[int | str], decode: list[int | str],
           env: dict[str, str] | None = None, upstreams: dict[str, object] | None = None, ready: str = "/health",
           **spec: object) -> contextlib.AbstractContextManager[ManagedProcess]:
    """A pdlab router on `port` in front of stand-ins (ports, or URLs), with `spec`'s RouterSpec fields and
    `upstreams`' RouterUpstreams fields; up once `ready` answers 200 (`/health` answers 503 while no instance can
    serve: `/v1/models` for a router started in front of dead ones)."""
    argv = router_command(RouterSpec(port=port, **spec), RouterUpstreams(
        prefill=[url(p) if isinstance(p, int) else p for p in prefill],
        decode=[url(p) if isinstance(p, int) else p for p in decode], model=MODEL, tokenizer=tokenizer_dir,
        **(upstreams or {})))
    return running(argv, url(port) + ready, log_dir / f"router-{port}.log", env=env)


def metric(base_url: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus metric (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=5.0).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0
