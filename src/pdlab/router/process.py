"""The router as its own process: the argv a launcher starts (and later stops)."""

from __future__ import annotations

import sys

from pdlab.config.router import LMCacheReceiverPorts, RouterSpec


def router_command(spec: RouterSpec, prefill_urls: list[str], decode_urls: list[str], served_model: str,
                   tokenizer_dir: str, max_model_len: int | None, block_size: int,
                   lmcache_receiver: LMCacheReceiverPorts | None = None) -> list[str]:
    """`python -m pdlab.router serve ...` for this spec and these upstreams. The admin token travels in the argv
    only when the spec sets one; otherwise the router reads $PDLAB_ADMIN_TOKEN from the environment it inherits
    (preferable: argv is visible to other local users). `lmcache_receiver`: the decode replicas' LMCache receiver
    ports, needed by kv_protocol `lmcache`."""
    argv = [sys.executable, "-m", "pdlab.router", "serve",
            "--model", served_model, "--tokenizer", tokenizer_dir, "--block-size", str(block_size),
            "--host", spec.host, "--port", str(spec.port),
            "--threshold", str(spec.threshold),
            "--prefill-strategy", spec.prefill_strategy, "--decode-strategy", spec.decode_strategy,
            "--fallback", spec.fallback,
            "--max-in-flight", str(spec.max_in_flight), "--upstream-timeout", str(spec.upstream_timeout_s),
            "--session-header", spec.session_header]
    for url in prefill_urls:
        argv += ["--prefill", url]
    for url in decode_urls:
        argv += ["--decode", url]
    argv += kv_protocol_flags(spec, lmcache_receiver)
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if spec.admin_token:
        argv += ["--admin-token", spec.admin_token]
    return argv


def kv_protocol_flags(spec: RouterSpec, receiver: LMCacheReceiverPorts | None) -> list[str]:
    """The router flags of the P/D protocol: `--kv-protocol` when the spec fixes one, and for `lmcache` the decode
    replicas' receiver ports (the same lists their LMCache config has)."""
    if spec.kv_protocol is None:
        return []
    flags = ["--kv-protocol", spec.kv_protocol]
    if spec.kv_protocol == "lmcache" and receiver is not None:
        flags += ["--lmcache-init-ports", ",".join(map(str, receiver.init_ports)),
                  "--lmcache-alloc-ports", ",".join(map(str, receiver.alloc_ports))]
    return flags
