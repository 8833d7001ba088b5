"""The router in front of a deployment: the threshold and the replica-choice strategies."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from pdlab.config.base import Spec
from pdlab.settings import DEFAULT_HOST, DEFAULT_ROUTER_PORT, DEFAULT_ROUTING_THRESHOLD

Strategy = Literal["roundrobin", "session", "prefixaware", "kvaware", "leastloaded"]
"""How the router picks a replica within a pool (HyperPod's intelligent-routing strategies, plus least-loaded)."""

FallbackPolicy = Literal["fallback", "fail"]

KVProtocol = Literal["nixl", "lmcache"]
"""How the router's two legs tell the instances where the KV cache goes (see docs/router.md):
`nixl`: vLLM's NixlConnector protocol, decode pulls (prefill answers with `kv_transfer_params`, decode gets them);
`lmcache`: LMCacheConnectorV1's P/D protocol, prefill pushes (the prefill request names the decode replica's
LMCache receiver in `kv_transfer_params.disagg_spec`; decode gets the plain request)."""

Port = Annotated[int, Field(ge=1, le=65535)]


class RouterSettings(Spec):
    """The knobs that may change while the router runs (`PUT /admin/config`)."""

    threshold: int = Field(default=DEFAULT_ROUTING_THRESHOLD, ge=0)
    """Prompts with at least this many tokens are prefilled on a prefill instance and decoded on a decode
    instance; shorter ones go straight to a decode instance. 0 disaggregates everything."""
    prefill_strategy: Strategy = "roundrobin"
    """Replica choice among prefill instances."""
    decode_strategy: Strategy = "roundrobin"
    """Replica choice among decode instances."""
    fallback: FallbackPolicy = "fallback"
    """When the prefill pool is down or errors: `fallback` serves the request directly on a decode instance,
    `fail` returns an error."""


class RouterSpec(RouterSettings):
    """The pdlab router process."""

    kv_protocol: KVProtocol | None = None
    """P/D request protocol, fixed for the router's life (it must match the instances' KV connector): `nixl` or
    `lmcache`. None follows the deployment's connector (`lmcache` for connector kind `lmcache`, else `nixl`); a
    router started by hand defaults to `nixl`."""

    host: str = DEFAULT_HOST
    """Address to bind; loopback unless the lab deliberately exposes the router."""
    port: int = Field(default=DEFAULT_ROUTER_PORT, ge=1, le=65535)
    """HTTP port."""
    admin_token: str | None = None
    """Bearer token for `/admin/*`; None reads it from $PDLAB_ADMIN_TOKEN (the admin API is refused without one)."""
    max_in_flight: int = Field(default=256, gt=0)
    """Requests in flight at the router before new ones get 503 with Retry-After."""
    upstream_timeout_s: float = Field(default=600.0, gt=0)
    """Seconds to wait on an upstream instance before failing the request."""
    session_header: str = "x-session-id"
    """Header carrying the session key for the `session` strategy (the request's `user` field also works)."""


class LMCacheReceiverPorts(Spec):
    """Where a decode replica's LMCache receiver listens: its LMCache config's `pd_peer_init_port` and
    `pd_peer_alloc_port` lists, one port per GPU rank. Every decode replica uses the same lists (replicas differ by
    host); prefill rank i sends to element i of each, so the lists are as long as the tensor-parallel size."""

    init_ports: list[Port] = Field(min_length=1)
    """Connection set-up ports (`pd_peer_init_port`), rank 0 first."""
    alloc_ports: list[Port] = Field(min_length=1)
    """Buffer allocation ports (`pd_peer_alloc_port`), rank 0 first."""

    @model_validator(mode="after")
    def _one_pair_per_rank(self) -> LMCacheReceiverPorts:
        if len(self.alloc_ports) != len(self.init_ports):
            raise ValueError(f"alloc_ports: one port per GPU rank like init_ports ({len(self.init_ports)} ranks), "
                             f"has {len(self.alloc_ports)}")
        ports = self.init_ports + self.alloc_ports
        if repeated := sorted({p for p in ports if ports.count(p) > 1}):
            raise ValueError(f"alloc_ports: every rank's init and alloc port must differ, repeated: {repeated}")
        return self
