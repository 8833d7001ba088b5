"""LMCache's settings, computed once for every tier: the LMCache config file and vLLM's --kv-transfer-config of an
instance, from the lab's `connector.lmcache` and the instance's role. The local tier (`pdlab up`, pdlab.deploy) and
the cluster renders (HyperPod, Kubernetes, host scripts: pdlab.cluster.plan) call the same two functions; what
differs is passed in and only that: addresses (where a receiver listens, where a sender reports a finished push),
the NIXL transport, and where KV is staged (`cpu` locally, `cuda` on GPUs).

Role by role:
- `prefill`: LMCache P/D *sender*: after its prefill it pushes the prompt's KV to the receiver its request names
  (`kv_transfer_params.disagg_spec`), then tells the router the push is done (`notify`), if one listens.
- `decode`: LMCache P/D *receiver*: listens for senders on `peer_host` and the per-rank ports of `receiver_ports`,
  finds pushed chunks by their token hashes when the decode request arrives, and frees them once loaded.
- `colocated`: LMCache's CPU tier (offload): every prompt's KV stored in `local_cpu_gib` of CPU memory, loaded
  back when a later prompt starts with the same tokens.
"""

from __future__ import annotations

from typing import Any, Literal

from pdlab.config.deployment import LMCacheSpec, Role

#: Every process of an LMCache deployment hashes prompts with this seed: vLLM and LMCache derive the first prefix
#: hash from PYTHONHASHSEED, so a sender and a receiver that differ compute different chunk keys and every lookup
#: misses, silently. pdlab sets it in each instance's environment and the local connector checks it at start-up.
HASH_SEED = "0"
#: The environment LMCache needs in each vLLM process (on every tier).
LMCACHE_ENV: dict[str, str] = {"PYTHONHASHSEED": HASH_SEED}
#: kv_connector_extra_config key carrying HASH_SEED to the local connector, which checks its process has it.
HASH_SEED_KEY = "pdlab.python_hash_seed"
#: Where vLLM finds the local tier's LMCache connector (pdlab/lmcache/connector.py).
CPU_CONNECTOR_MODULE = "pdlab.lmcache.connector"
#: LMCache's chunk keys: a hash of vLLM's (sha256 of CBOR), not Python's `hash` (LMCache's default, which differs
#: between processes unless PYTHONHASHSEED agrees: one more way to miss silently).
HASH_ALGORITHM = "sha256_cbor"

BufferDevice = Literal["cpu", "cuda"]


def lmcache_config(role: Role, spec: LMCacheSpec, *, buffer_device: BufferDevice, backends: list[str],
                   tp: int = 1, peer_host: str = "0.0.0.0", notify: tuple[str, int] | None = None,
                   max_prefill_tokens: int | None = None, api_port: int | None = None) -> dict[str, Any]:
    """One instance's LMCache config, in LMCache 0.5's key names.

    `buffer_device`: where P/D chunks are staged. `backends`: NIXL's transports. `tp`: GPU ranks of a replica
    (one port each). `peer_host`: the address a receiver listens on. `notify`: (host, port) a sender reports each
    finished push to (LMCache's proxy notification; the local router waits for it before decoding), None for no
    report. `max_prefill_tokens`: the longest prompt; LMCache refuses to start when a P/D buffer cannot hold its KV
    (instead of failing that prompt later). `api_port`: first port of LMCache's internal HTTP server (its own
    figures, /metrics), None for none."""
    config: dict[str, Any] = {"chunk_size": spec.chunk_size, "pre_caching_hash_algorithm": HASH_ALGORITHM}
    if role == "colocated":
        config.update({"local_cpu": True, "max_local_cpu_size": spec.local_cpu_gib})
    else:
        config.update({
            # P/D moves KV straight from buffer to buffer; it keeps no CPU tier of its own.
            "local_cpu": False,
            "max_local_cpu_size": 0,
            "enable_pd": True,
            "pd_role": "sender" if role == "prefill" else "receiver",
            "pd_buffer_size": spec.sender_buffer_bytes if role == "prefill" else spec.receiver_buffer_bytes,
            "pd_buffer_device": buffer_device,
            "transfer_channel": "nixl",
            "nixl_backends": list(backends),
            # P/D must ship the prompt's last partial chunk too (LMCache forces this on, with a warning).
            "save_unfull_chunk": True,
        })
        if max_prefill_tokens:
            config["pd_max_prefill_len"] = max_prefill_tokens
        if role == "prefill":
            if notify is None:
                config["pd_skip_proxy_notification"] = True
            else:
                config["pd_proxy_host"], config["pd_proxy_port"] = notify
        else:
            ports = spec.receiver_ports(tp)  # the router names the same lists in this replica's disagg_spec
            config["pd_peer_host"] = peer_host
            config["pd_peer_init_port"] = ports.init_ports
            config["pd_peer_alloc_port"] = ports.alloc_ports
    if api_port is not None:
        config.update({"internal_api_server_enabled": True, "internal_api_server_host": "127.0.0.1",
                       "internal_api_server_port_start": api_port})
    return config


def kv_transfer_config(role: Role, *, buffer_device: BufferDevice, cpu_connector: bool = False) -> dict[str, Any]:
    """vLLM's --kv-transfer-config for LMCacheConnectorV1: prefill produces KV, decode consumes it, a colocated
    instance does both with its CPU tier. `cpu_connector`: vLLM on CPU, which needs pdlab's connector module."""
    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer", "colocated": "kv_both"}[role]
    # P/D must ship the prompt's last partial chunk too, or decode recomputes it.
    extra: dict[str, Any] = {"discard_partial_chunks": False} if role != "colocated" else {}
    config: dict[str, Any] = {"kv_connector": "LMCacheConnectorV1", "kv_role": kv_role,
                              "kv_buffer_device": buffer_device}
    if cpu_connector:
        config["kv_connector_module_path"] = CPU_CONNECTOR_MODULE
        extra[HASH_SEED_KEY] = HASH_SEED
    config["kv_connector_extra_config"] = extra
    return config
