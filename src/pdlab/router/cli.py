"""`pdlab router ...`."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import typer
from rich.console import Console

from pdlab.config.base import ConfigError, validate
from pdlab.config.router import LMCacheReceiverPorts, RouterSpec
from pdlab.settings import DEFAULT_HOST, DEFAULT_ROUTER_PORT, DEFAULT_ROUTING_THRESHOLD, HTTP_KEEP_ALIVE_S

app = typer.Typer(help="Run the P/D router in front of a deployment.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
console = Console(stderr=True)


@app.callback()
def _group() -> None:
    """Run the P/D router in front of a deployment."""


@app.command()
def serve(
    decode: list[str] = typer.Option(..., "--decode", help="Decode (or colocated) instance base URL; repeat."),
    model: str = typer.Option(..., "--model", help="Served model name clients must put in requests."),
    tokenizer: Path = typer.Option(..., "--tokenizer", help="Model directory with tokenizer.json."),
    prefill: list[str] = typer.Option([], "--prefill", help="Prefill instance base URL; repeat."),
    max_model_len: int | None = typer.Option(None, help="Context length (default: the model's config.json)."),
    block_size: int = typer.Option(16, min=1, help="Tokens per KV block, for prefix/KV-aware block hashes."),
    threshold: int = typer.Option(DEFAULT_ROUTING_THRESHOLD, help="Prompt tokens from which to disaggregate."),
    prefill_strategy: str = typer.Option("roundrobin", help="Replica choice among prefill instances."),
    decode_strategy: str = typer.Option("roundrobin", help="Replica choice among decode instances."),
    fallback: str = typer.Option("fallback", help="When prefill fails: 'fallback' (direct decode) or 'fail'."),
    kv_protocol: str = typer.Option("nixl", help="P/D request protocol: 'nixl' (vLLM NixlConnector: decode pulls) "
                                    "or 'lmcache' (LMCacheConnectorV1: prefill pushes to the decode replica)."),
    lmcache_init_ports: str | None = typer.Option(
        None, help="lmcache: the decode replicas' pd_peer_init_port list, comma-separated, rank 0 first."),
    lmcache_alloc_ports: str | None = typer.Option(
        None, help="lmcache: the decode replicas' pd_peer_alloc_port list, comma-separated, rank 0 first."),
    host: str = typer.Option(DEFAULT_HOST, help="Address to bind."),
    port: int = typer.Option(DEFAULT_ROUTER_PORT, help="Port to bind."),
    admin_token: str | None = typer.Option(None, help="Admin bearer token (default: $PDLAB_ADMIN_TOKEN)."),
    max_in_flight: int = typer.Option(256, help="In-flight requests before 503 + Retry-After."),
    upstream_timeout: float = typer.Option(600.0, help="Seconds to wait on an upstream instance."),
    session_header: str = typer.Option("x-session-id", help="Header with the session key (session strategy)."),
    log_level: str = typer.Option("info", help="debug, info (one JSON line per request), warning, error."),
) -> None:
    """Serve the OpenAI-compatible router (long prompts: prefill -> decode; short ones: decode directly)."""
    import uvicorn

    from pdlab.router.app import Upstreams, build_app

    try:
        spec = validate(RouterSpec, {
            "threshold": threshold, "prefill_strategy": prefill_strategy, "decode_strategy": decode_strategy,
            "fallback": fallback, "kv_protocol": kv_protocol, "host": host, "port": port, "admin_token": admin_token,
            "max_in_flight": max_in_flight, "upstream_timeout_s": upstream_timeout, "session_header": session_header,
        }, source="router options")
        receiver = _receiver_ports(spec, lmcache_init_ports, lmcache_alloc_ports)
    except ConfigError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=2) from None
    if not (tokenizer / "tokenizer.json").exists():
        console.print(f"[red]error:[/red] --tokenizer: {tokenizer / 'tokenizer.json'} does not exist")
        raise typer.Exit(code=2)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))  # the messages are JSON objects already
    router_log = logging.getLogger("pdlab.router")
    router_log.addHandler(handler)
    router_log.setLevel(log_level.upper())
    router_log.propagate = False
    upstreams = Upstreams(prefill_urls=prefill, decode_urls=decode, served_model=model,
                          tokenizer_dir=str(tokenizer), max_model_len=max_model_len, block_size=block_size,
                          lmcache_receiver=receiver)
    uvicorn.run(build_app(spec, upstreams), host=spec.host, port=spec.port, log_level="warning",
                access_log=False, loop="uvloop", http="httptools", proxy_headers=False, server_header=False,
                timeout_graceful_shutdown=5,  # a launcher stopping us must not wait on open streams
                timeout_keep_alive=HTTP_KEEP_ALIVE_S)


def _receiver_ports(spec: RouterSpec, init_ports: str | None, alloc_ports: str | None
                    ) -> LMCacheReceiverPorts | None:
    """The decode replicas' LMCache receiver ports from the two comma-separated options; ConfigError naming the
    option when they are missing for `lmcache`, given for `nixl`, or not port lists."""
    source = "router options"
    if spec.kv_protocol != "lmcache":
        if init_ports or alloc_ports:
            raise ConfigError(source, [("--lmcache-init-ports", "only for --kv-protocol lmcache")])
        return None
    missing = [name for name, value in (("--lmcache-init-ports", init_ports), ("--lmcache-alloc-ports", alloc_ports))
               if not value]
    if missing:
        raise ConfigError(source, [(name, "required with --kv-protocol lmcache: the decode replicas' LMCache "
                                          "receiver ports, one per GPU rank") for name in missing])
    lists = {}
    for field, name, text in (("init_ports", "--lmcache-init-ports", init_ports),
                              ("alloc_ports", "--lmcache-alloc-ports", alloc_ports)):
        try:
            lists[field] = [int(part) for part in (text or "").split(",")]
        except ValueError:
            raise ConfigError(source, [(name, f"{text!r} is not a comma-separated list of ports")]) from None
    return validate(LMCacheReceiverPorts, lists, source=source)
