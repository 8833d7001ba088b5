"""`pdlab router ...`: `serve`, whose options are the fields of `RouterSpec` and `RouterUpstreams`
(pdlab.config.options: names, types, defaults and help come from the specs; nothing is declared twice)."""

from __future__ import annotations

import contextlib
import cProfile
import inspect
import logging
import os
import signal
import sys
from typing import Any

import typer
from rich.console import Console

from pdlab.config.base import ConfigError
from pdlab.config.options import spec_from_options, spec_options
from pdlab.config.router import RouterSpec, RouterUpstreams
from pdlab.settings import ADMIN_TOKEN_ENV, HTTP_KEEP_ALIVE_S, ROUTER_PROFILE_ENV

app = typer.Typer(help="Run the P/D router in front of a deployment.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
console = Console(stderr=True)

LOG_LEVEL = inspect.Parameter(
    "log_level", inspect.Parameter.KEYWORD_ONLY, annotation=str,
    default=typer.Option("info", "--log-level", help="debug, info (one JSON line per request), warning, error."))


@app.callback()
def _group() -> None:
    """Run the P/D router in front of a deployment."""


def serve(**options: Any) -> None:
    """Serve the OpenAI-compatible router (long prompts: prefill -> decode; short ones: decode directly). The admin
    API's bearer token comes from $PDLAB_ADMIN_TOKEN (never the command line: other local users can read it)."""
    import uvicorn

    from pdlab.router.app import build_app
    from pdlab.router.kv import KVProtocolError

    try:
        spec = spec_from_options(RouterSpec, options)
        upstreams = spec_from_options(RouterUpstreams, options)
        router = build_app(spec, upstreams)
    except (ConfigError, KVProtocolError, FileNotFoundError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=2) from None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))  # the messages are JSON objects already
    router_log = logging.getLogger("pdlab.router")
    router_log.addHandler(handler)
    router_log.setLevel(options["log_level"].upper())
    router_log.propagate = False
    if router.admin_token is None:
        router_log.warning(f'{{"event": "admin_disabled", "why": "${ADMIN_TOKEN_ENV} is not set"}}')
    with profiled(os.environ.get(ROUTER_PROFILE_ENV)):
        uvicorn.run(router, host=spec.host, port=spec.port, log_level="warning", access_log=False, loop="uvloop",
                    http="httptools", proxy_headers=False, server_header=False,
                    timeout_graceful_shutdown=5,  # a launcher stopping us must not wait on open streams
                    timeout_keep_alive=HTTP_KEEP_ALIVE_S)


@contextlib.contextmanager
def profiled(path: str | None):
    """With a path, run the block under cProfile and write its stats there when the router stops. uvicorn answers
    SIGTERM with a graceful shutdown and then raises the signal again under the handler it found: the one set here
    turns that into SystemExit, so the stats are written before the process ends."""
    if not path:
        yield
        return
    profiler = cProfile.Profile()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        profiler.dump_stats(path)


app.command("serve")(spec_options(serve, RouterUpstreams, RouterSpec, extra=[LOG_LEVEL]))
