"""What runs where: the model, the vLLM instances and the KV connector between them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from pdlab.config.base import Spec
from pdlab.config.router import KVProtocol, LMCacheReceiverPorts, RouterSpec
from pdlab.settings import DEFAULT_HOST, DEFAULT_KV_CACHE_GIB, DEFAULT_MODEL, VLLM_CPU_BLOCK_SIZE, VLLM_RESERVED_BLOCKS

Role = Literal["prefill", "decode", "colocated"]


class ModelRef(Spec):
    """The model every instance serves."""

    name: str = DEFAULT_MODEL
    """A name from pdlab's model catalog (made locally on first use), a Hugging Face id, or a local directory."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Weights and activations dtype. float32 is ~3x faster than bfloat16 on AVX2 CPUs (no native bf16 matmul)."""
    max_model_len: int | None = Field(default=None, gt=0)
    """Context length to serve; None takes the model's own."""


class EngineOptions(Spec):
    """vLLM engine knobs a lab may turn. None leaves vLLM's default."""

    max_num_batched_tokens: int | None = Field(default=None, gt=0)
    """Token budget per scheduler step; with chunked prefill, a smaller budget bounds how long a prefill stalls
    running decodes (the classic mitigation of head-of-line blocking)."""
    enable_chunked_prefill: bool | None = None
    """Split long prefills across steps so decodes keep running."""
    enable_prefix_caching: bool = False
    """Reuse KV blocks of prompts seen before. Off by default so measurements do not depend on history."""
    max_num_seqs: int | None = Field(default=None, gt=0)
    """Most sequences batched together."""
    block_size: int | None = Field(default=None, gt=0)
    """Tokens per KV block (vLLM's CPU default is 128 for this model class)."""
    kv_cache_blocks: int | None = Field(default=None, gt=0)
    """KV cache size in blocks, in place of what `kv_cache_gib` holds (vLLM's `--num-gpu-blocks-override`): a
    cache small enough to run out, to watch vLLM preempt. Must hold the model's context (`max_model_len`)."""

    @property
    def kv_cache_block_tokens(self) -> int | None:
        """The tokens `kv_cache_blocks` hold for requests (blocks of `block_size`, else vLLM's CPU default), None
        where unset. vLLM keeps one block of its pool back (its null block, `BlockPool`), so requests get one block
        fewer than the override names: 64 blocks of 128 serve 8,064 tokens, and a max_model_len of 8,192 fails."""
        blocks = self.kv_cache_blocks
        return None if blocks is None else (blocks - VLLM_RESERVED_BLOCKS) * (self.block_size or VLLM_CPU_BLOCK_SIZE)
    enforce_eager: bool = True
    """Skip torch.compile: it costs 40+ s of warm-up per new shape on 2 cores."""
    extra_args: list[str] = []
    """Further `vllm serve` flags, passed through unchanged."""


class InstanceSpec(Spec):
    """One vLLM server process."""

    name: str = Field(pattern=r"^[a-z][a-z0-9-]*$")
    """Unique name, used for logs and messages (lowercase letters, digits, dashes)."""
    role: Role
    """`prefill` produces KV caches, `decode` consumes them (and serves short prompts directly), `colocated`
    does both phases on one server with no KV transfer."""
    host: str = DEFAULT_HOST
    """Address to bind; loopback unless the lab deliberately exposes the server."""
    port: int | None = Field(default=None, ge=1, le=65535)
    """HTTP port; None lets pdlab pick the next free slot from its base port."""
    cores: list[int] = Field(default_factory=list)
    """CPU cores this instance's process and OpenMP threads are pinned to; empty means unpinned."""
    kv_cache_gib: int = Field(default=DEFAULT_KV_CACHE_GIB, ge=1, le=1024)
    """KV cache size in whole GiB (VLLM_CPU_KVCACHE_SPACE). Always explicit: vLLM's CPU default takes half
    the RAM."""
    nixl_side_channel_port: int | None = Field(default=None, ge=1, le=65535)
    """Port for NIXL's handshake between instances; None lets pdlab pick one."""
    node: str | None = None
    """Name of the network node (namespace) to run in, when the deployment defines `nodes`."""
    engine: EngineOptions = Field(default_factory=EngineOptions)
    """vLLM engine options for this instance."""

    @field_validator("cores")
    @classmethod
    def _cores_distinct(cls, cores: list[int]) -> list[int]:
        if any(core < 0 for core in cores):
            raise ValueError("core numbers must be >= 0")
        if len(set(cores)) != len(cores):
            raise ValueError(f"cores listed twice: {cores}")
        return cores


class LMCacheSpec(Spec):
    """LMCache's settings (connector kind `lmcache`), the same on the laptop and on a cluster: pdlab.lmcache.settings
    turns them into each instance's LMCache config on every tier."""

    chunk_size: int = Field(default=256, ge=1)
    """Tokens per LMCache chunk: the unit LMCache stores, pushes and finds by hash."""
    sender_buffer_bytes: int = Field(default=1 << 30, ge=1 << 20)
    """`pd_buffer_size` on prefill instances: the staging buffer for outgoing KV, bytes. It must hold the KV of
    the longest prompt (LMCache refuses to start otherwise)."""
    receiver_buffer_bytes: int = Field(default=2 << 30, ge=1 << 20)
    """`pd_buffer_size` on decode instances: the buffer pushed KV lands in until decode loads it, bytes (holds
    the KV of every prompt pushed and not yet decoded, so larger than the sender's)."""
    peer_init_port: int = Field(default=7300, ge=1024, le=65535)
    """Port a decode instance listens on for senders' connection set-up (`pd_peer_init_port`); one per GPU rank,
    counting up from here. Every decode replica uses the same ports on its own address."""
    peer_alloc_port: int = Field(default=7400, ge=1024, le=65535)
    """Port a decode instance listens on for buffer allocation requests (`pd_peer_alloc_port`), one per rank."""
    local_cpu_gib: float = Field(default=1.0, gt=0, le=1024)
    """LMCache's CPU tier on `colocated` instances (offload), GiB: KV of earlier prompts kept there and loaded
    back when a prompt starts with the same tokens."""
    notify_port: int = Field(default=7500, ge=1024, le=65535)
    """Local tier: the router's port for LMCache's push notifications (each prefill instance reports there when
    a prompt's KV has landed on its decode instance; the router sends the decode request only then)."""
    push_timeout_s: float = Field(default=30.0, gt=0)
    """Local tier: seconds the router waits for that notification before failing the request with an error
    (a push that never lands, e.g. because the prefill instance died, must not hang the request)."""
    api_port: int | None = Field(default=7100, ge=1024, le=65000)
    """Local tier: first port of LMCache's own HTTP server in each instance, where pdlab reads LMCache's figures
    (chunks stored, pushed, loaded): instance i uses this + 2i and the next port. None: no server, no figures."""

    def receiver_ports(self, ranks: int) -> LMCacheReceiverPorts:
        """The per-rank ports of a decode instance with `ranks` GPU ranks: what its LMCache config lists and what
        the router names in each prefill request's disagg_spec (one computation, so the two cannot differ). Every
        decode replica uses the same ports on its own address (locally there is one decode instance: LMCache's
        receiver takes its allocation port on every address of its machine)."""
        return LMCacheReceiverPorts(init_ports=[self.peer_init_port + rank for rank in range(ranks)],
                                    alloc_ports=[self.peer_alloc_port + rank for rank in range(ranks)])

    @model_validator(mode="after")
    def _ports_apart(self) -> LMCacheSpec:
        # Each base port counts up one per GPU rank; 100 apart leaves room for any 8-GPU replica.
        if abs(self.peer_init_port - self.peer_alloc_port) < 100:
            raise ValueError(f"peer_alloc_port: must be at least 100 from peer_init_port ({self.peer_init_port}), "
                             "since both count up one per GPU rank")
        return self


class ConnectorSpec(Spec):
    """How KV caches move from prefill to decode instances."""

    kind: Literal["nixl", "lmcache", "none"] = "nixl"
    """`nixl`: vLLM's NixlConnector (decode pulls the KV). `lmcache`: LMCacheConnectorV1 (prefill pushes the KV over
    NIXL; on `colocated` instances, LMCache's CPU tier instead). `none`: no transfer (colocated deployments)."""
    nixl_backends: list[Literal["UCX", "LIBFABRIC"]] = ["UCX"]
    """NIXL transport backends: UCX locally (TCP/shared memory), LIBFABRIC for AWS EFA."""
    ucx_tls: str = "tcp,self,sm"
    """UCX transports (UCX_TLS) for the local tier."""
    progress_thread: bool = False
    """NIXL's progress thread, which vLLM turns on and NIXL runs without pause: an idle instance keeps a core busy.
    Off (pdlab's connector, pdlab.deploy.nixl_connector): transfers progress as vLLM's engine checks them each step,
    so a read from a busy prefill instance waits for its next step (data/results/transfer/20261205-142936.json).
    On: vLLM's own NixlConnector, with pdlab moving the thread to the idle scheduling class, where it serves reads
    in the busy core's gaps (labs/ucx-lock.yaml)."""
    ucx_mutex: bool = True
    """UCX's multi-threaded worker lock as a mutex (UCX_USE_MT_MUTEX=y) rather than UCX's default spinlock. Keep it
    on: with NIXL's progress thread (`progress_thread: true`) at idle priority, the spinlock freezes the decode
    instance around KV reads (docs/simulator.md). `false` is there to see that happen (labs/ucx-lock.yaml)."""
    buffer_device: Literal["cpu", "cuda"] = "cpu"
    """Where the connector stages KV blocks."""
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"
    """What a decode instance does when pulling a KV cache fails (e.g. the prefill instance died mid-transfer):
    `fail` ends the request with an error (a broken transfer is never hidden), `recompute` prefills it locally."""
    lmcache: LMCacheSpec = Field(default_factory=LMCacheSpec)
    """LMCache's settings, for kind `lmcache`."""


class NodeSpec(Spec):
    """A network node: its own namespace and address (see pdlab.netlab)."""

    name: str = Field(pattern=r"^[a-z][a-z0-9-]*$")
    """Node name, referenced by instances' `node`."""


LinkPreset = Literal["efa-p5", "100gbe", "10gbe", "1gbe"]
"""Real links pdlab.netlab scales down to the local model's KV sizes (see docs/netlab.md)."""


class LinkSpec(Spec):
    """The shaped link between a deployment's nodes (pdlab.netlab). Bandwidth only: latency is not modelled."""

    preset: LinkPreset = "10gbe"
    """A real link, scaled down by the ratio of the served model's KV bytes per token to a 70B model's, so KV
    transfer time per token of context matches the real link's."""
    mbps: float | None = Field(default=None, gt=0, le=100_000)
    """Shape to exactly this many Mbit/s instead of the preset's scaled rate."""
    burst_kib: int | None = Field(default=None, ge=16, le=65536)
    """Token-bucket burst in KiB; None picks max(64 KiB, 2 ms at the shaped rate)."""
    fallback_to_loopback: bool = False
    """Without root or without `ip`/`tc`, run the deployment on loopback instead of failing (no shaped link)."""


class DeploymentSpec(Spec):
    """A whole serving deployment: model, instances, connector and (optionally) the router in front."""

    name: str = "local"
    """Name used for run directories and the detached-deployment record."""
    model: ModelRef = Field(default_factory=ModelRef)
    """The model all instances serve."""
    connector: ConnectorSpec = Field(default_factory=ConnectorSpec)
    """KV transfer between prefill and decode instances."""
    instances: list[InstanceSpec] = Field(min_length=1)
    """The vLLM servers."""
    router: RouterSpec | None = None
    """The pdlab router in front of the instances; None serves instances directly."""
    nodes: list[NodeSpec] = []
    """Optional network nodes for a two-node deployment on one machine (pdlab.netlab)."""
    link: LinkSpec = Field(default_factory=LinkSpec)
    """The shaped link joining the nodes; used only when `nodes` is set."""

    @model_validator(mode="after")
    def _consistent(self) -> DeploymentSpec:
        names = [inst.name for inst in self.instances]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"instances: names must be unique, repeated: {dupes}")
        ports = [inst.port for inst in self.instances if inst.port is not None]
        if dupes := sorted({p for p in ports if ports.count(p) > 1}):
            raise ValueError(f"instances: ports must be unique, repeated: {dupes}")
        roles = {inst.role for inst in self.instances}
        if ("prefill" in roles) != ("decode" in roles):
            raise ValueError("instances: a P/D deployment needs at least one `prefill` and one `decode` instance")
        if "prefill" in roles and self.connector.kind == "none":
            raise ValueError("connector.kind: prefill/decode instances need a KV connector, not `none`")
        if self.router is not None and self.router.kv_protocol not in (None, self.kv_protocol):
            # A mismatch would not fail loudly: each connector ignores the other protocol's fields, so no KV would
            # move and decode would silently prefill every prompt itself.
            raise ValueError(f"router.kv_protocol: `{self.router.kv_protocol}` does not fit connector.kind "
                             f"`{self.connector.kind}`, which needs `{self.kv_protocol}` (or leave it unset)")
        if self.router is not None and self.router.threshold_basis == "uncached":
            uncached = [inst.name for inst in self.instances if inst.role in ("decode", "colocated")
                        and not inst.engine.enable_prefix_caching]
            if uncached:
                raise ValueError(f"router.threshold_basis: `uncached` counts on the decode instances' prefix cache, "
                                 f"which is off on {uncached}: set their engine.enable_prefix_caching: true")
        if (self.router is not None and self.kv_protocol == "lmcache" and self.router.serve_from_prefill):
            raise ValueError("router.serve_from_prefill: never with connector.kind `lmcache` (an LMCache sender's "
                             "engine dies on a request without a disagg_spec)")
        if self.connector.kind == "lmcache" and self.disaggregated:
            self._check_lmcache_pd()
        node_names = {node.name for node in self.nodes}
        for i, inst in enumerate(self.instances):
            if inst.node is not None and inst.node not in node_names:
                raise ValueError(f"instances.{i}.node: unknown node {inst.node!r}; nodes: {sorted(node_names)}")
            # vLLM refuses to start when its cache cannot hold one whole context: say so before it starts.
            tokens = inst.engine.kv_cache_block_tokens
            if tokens is not None and (self.model.max_model_len is None or self.model.max_model_len > tokens):
                raise ValueError(f"instances.{i}.engine.kv_cache_blocks: {inst.engine.kv_cache_blocks} blocks hold "
                                 f"{tokens:,} tokens for requests (one block is vLLM's own); set model.max_model_len "
                                 f"to at most that (now {self.model.max_model_len}), as vLLM will not start with a "
                                 "cache shorter than one context")
        return self

    def _check_lmcache_pd(self) -> None:
        if self.router is None:
            raise ValueError("router: LMCache's P/D needs the pdlab router: it names each prompt's decode instance "
                             "in the prefill request (disagg_spec) and sends the decode request once the KV has landed")
        if self.by_role("colocated"):
            raise ValueError("instances: `colocated` instances have no place beside LMCache's prefill and decode "
                             "instances (the router would name them as receivers of pushes they cannot take)")

    @property
    def disaggregated(self) -> bool:
        return any(inst.role == "prefill" for inst in self.instances)

    @property
    def kv_protocol(self) -> KVProtocol:
        """The router's P/D protocol for this deployment's connector (LMCache pushes, NIXL pulls). Colocated
        instances with LMCache (its CPU tier) have no P/D legs: the router's default, which they never use."""
        return "lmcache" if self.connector.kind == "lmcache" and self.disaggregated else "nixl"

    def by_role(self, role: Role) -> list[InstanceSpec]:
        return [inst for inst in self.instances if inst.role == role]
