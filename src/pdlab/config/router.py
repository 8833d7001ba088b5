"""The router in front of a deployment: the threshold and the replica-choice strategies."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pdlab.config.base import Spec
from pdlab.settings import DEFAULT_HOST, DEFAULT_ROUTER_PORT, DEFAULT_ROUTING_THRESHOLD

Strategy = Literal["roundrobin", "session", "prefixaware", "kvaware", "leastloaded"]
"""How the router picks a replica within a pool (HyperPod's intelligent-routing strategies, plus least-loaded)."""

FallbackPolicy = Literal["fallback", "fail"]


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
