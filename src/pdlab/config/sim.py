"""A simulation spec (`pdlab sim run SPEC.yaml`): the same router settings as a real lab, plus the hardware,
model, link and pool sizes the local machine cannot provide."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from pdlab.config.base import Spec
from pdlab.config.deployment import DeploymentSpec, InstanceSpec
from pdlab.config.router import RouterSettings


# The workload: the simulator's own minimal form. A lab's `WorkloadSpec` (pdlab.config.workload) maps onto it: each
# request the load generator would send becomes one `SimRequestSpec` (arrival time, prompt and output tokens, class).
class SimRequestSpec(Spec):
    """One request, as the load generator would send it."""

    at_s: float = Field(ge=0)
    """Arrival time, seconds from the start of the run."""
    prompt_tokens: int = Field(gt=0)
    output_tokens: int = Field(gt=0)
    cls: str = "short"
    """Request class for the summary (`short` or `long` in the local labs)."""
    session: str | None = None
    """Session key, for the `session` routing strategy."""
    prefix_hashes: list[int] = []
    """Hashes of the prompt's full KV blocks (see pdlab.router.strategies.block_hashes), for prefix-aware routing."""


class PoissonBimodal(Spec):
    """Poisson arrivals; each request is `long` with probability `long_fraction`, else `short`."""

    rate_rps: float = Field(gt=0)
    """Mean arrival rate, requests per second."""
    num_requests: int = Field(gt=0)
    long_fraction: float = Field(default=0.2, ge=0, le=1)
    short_prompt_tokens: int = Field(default=256, gt=0)
    long_prompt_tokens: int = Field(default=4096, gt=0)
    short_output_tokens: int = Field(default=150, gt=0)
    long_output_tokens: int = Field(default=150, gt=0)
    spread: float = Field(default=0.25, ge=0, lt=1)
    """Token counts are drawn uniformly within +-spread of the class's figure."""
    seed: int = 0


class SimTrace(Spec):
    """A Mooncake-format trace (JSON lines: `timestamp` ms, `input_length`, `output_length`, `hash_ids`) replayed in
    the simulator at cluster scale, lengths as recorded: requests whose leading `hash_ids` are equal share those
    KV blocks, which prefix caching reuses and prefix-aware routing looks for."""

    path: str
    """The trace file (relative paths are found from the checkout too, as for lab specs)."""
    time_scale: float = Field(default=1.0, gt=0)
    """Multiply timestamps by this: 0.5 replays twice as fast (twice the request rate)."""
    num_requests: int | None = Field(default=None, gt=0)
    """Replay only the first this many requests."""
    block_tokens: int = Field(default=512, gt=0)
    """Tokens per `hash_ids` entry (Mooncake: 512)."""
    long_threshold_tokens: int = Field(default=8192, gt=0)
    """Prompts of at least this many tokens are class `long`, the others `short`."""


class SimWorkload(Spec):
    """What the simulated clients send: `requests`, `poisson` or `trace` (exactly one)."""

    requests: list[SimRequestSpec] = []
    poisson: PoissonBimodal | None = None
    trace: SimTrace | None = None

    @model_validator(mode="after")
    def _one_source(self) -> SimWorkload:
        if sum((bool(self.requests), self.poisson is not None, self.trace is not None)) != 1:
            raise ValueError("give exactly one of `requests`, `poisson` and `trace`")
        return self


class LinkChoice(Spec):
    """The KV-transfer link: a catalog entry, optionally with bandwidth or latency overridden."""

    name: str | None = "efa-p5"
    """A link from data/catalog/links.yaml; None means give `bandwidth_gbps` and `latency_us` directly."""
    bandwidth_gbps: float | None = Field(default=None, gt=0)
    """Overrides the catalog bandwidth (Gbit/s, as the catalog gives it: per GPU for a `per_gpu` link, whose
    tensor-parallel ranks send their shards of the KV side by side, so an instance moves `engine.tensor_parallel`
    times this; per NIC for one its GPUs share)."""
    latency_us: float | None = Field(default=None, ge=0)
    """Overrides the catalog latency."""
    concurrency: int = Field(default=1, ge=1)
    """Transfers one prefill instance sends at once; the bandwidth is split into this many equal lanes."""
    layerwise_overlap: bool = False
    """Send each layer's KV while later layers are still computing (hides most of the transfer behind prefill)."""

    def named(self, name: str | None) -> LinkChoice:
        """This choice on the link `name`: another link drops the bandwidth and latency given for this one."""
        if name == self.name:
            return self
        return self.model_copy(update={"name": name, "bandwidth_gbps": None, "latency_us": None})

    @model_validator(mode="after")
    def _named_or_given(self) -> LinkChoice:
        if self.name is None and (self.bandwidth_gbps is None or self.latency_us is None):
            raise ValueError("a link without `name` needs both `bandwidth_gbps` and `latency_us`")
        return self


class Pools(Spec):
    """How many instances of each role. Either `colocated`, or `prefill` and `decode`."""

    prefill: int = Field(default=0, ge=0)
    decode: int = Field(default=0, ge=0)
    colocated: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _shape(self) -> Pools:
        if self.colocated and (self.prefill or self.decode):
            raise ValueError("give either `colocated`, or `prefill` and `decode`; not both kinds")
        if not self.colocated and not (self.prefill and self.decode):
            raise ValueError("a P/D deployment needs at least one `prefill` and one `decode` instance")
        return self


class SimEngine(Spec):
    """Per-instance serving engine settings (vLLM's scheduler knobs)."""

    tensor_parallel: int = Field(default=1, ge=1)
    """GPUs per instance."""
    max_num_batched_tokens: int = Field(default=8192, gt=0)
    """Token budget per step; decodes are scheduled first, prefill chunks fill the rest (chunked prefill)."""
    max_num_seqs: int = Field(default=256, gt=0)
    """Most sequences (prefilling or decoding) in an instance's batch."""
    kv_cache_tokens: int | None = Field(default=None, gt=0)
    """KV cache capacity per instance, tokens; None computes it from memory (GPU) or `kv_cache_gib` (local)."""
    kv_cache_gib: float = Field(default=1.0, gt=0)
    """KV cache per instance when the cost model is a fitted local profile (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    """Fraction of GPU memory for weights plus KV cache (vLLM's flag)."""
    enable_prefix_caching: bool = False
    """Reuse the KV of a prompt's leading blocks already computed on the instance (requests need `prefix_hashes`)."""
    block_size: int = Field(default=16, gt=0)
    """Tokens per KV block: the unit KV space is allocated in, prefix caching reuses and the router hashes
    (vLLM's default: 16 on GPUs, 128 on CPUs)."""


class SLO(Spec):
    """Service-level objectives for goodput."""

    ttft_ms: float = Field(default=2000.0, gt=0)
    tpot_ms: float = Field(default=100.0, gt=0)


def router_settings(deployment: DeploymentSpec) -> RouterSettings:
    """The routing decisions' settings of a deployment's router (pdlab.router's own type)."""
    if deployment.router is None:
        return RouterSettings()
    return RouterSettings(**deployment.router.model_dump(include=set(RouterSettings.model_fields)))


class SimSpec(Spec):
    """One simulated deployment under one workload."""

    name: str = "sim"
    hardware: str = "H200-SXM-141GB"
    """An accelerator from data/catalog/hardware.yaml (ignored when `profile` is given)."""
    model: str = "Llama-3.1-8B"
    """A model from data/catalog/models.yaml or pdlab's local catalog (pdlab-small, pdlab-tiny)."""
    profile: Path | None = None
    """A fitted cost profile: a JSON path (`pdlab sim calibrate`, `python -m pdlab.benchmarks.gpu_phases`) or a shipped
    name: the local tier's in data/catalog/profiles/ (`pdlab-small-vllm-cpu`), a measured GPU's in data/results/gpu/
    (`Llama-3.1-70B-NVIDIA-H200-tp2`); replaces the hardware roofline's step times."""
    dtype_bytes: int = Field(default=2, ge=1, le=8)
    """Bytes per weight and KV element: 2 for bf16, 4 for the local fp32 models."""
    link: LinkChoice = Field(default_factory=LinkChoice)
    pools: Pools = Field(default_factory=lambda: Pools(prefill=1, decode=1))
    engine: SimEngine = Field(default_factory=SimEngine)
    """Every instance's engine (the decode and colocated pools'; the prefill pool's too unless `prefill_engine`)."""
    prefill_engine: SimEngine | None = None
    """The prefill pool's engine where it differs from `engine` (a cluster lab sizes each pool on its own)."""
    cluster_lab: Path | None = None
    """A cluster lab (`cluster:` section) this spec simulates: its accelerator, EFA, model, pools, tensor
    parallelism, engines and router fill every field the spec does not give itself (`pdlab.sim.twin`); relative
    to the spec's file."""
    router: RouterSettings = Field(default_factory=RouterSettings)
    """Threshold, its basis and strategies, exactly as for the real router."""
    workload: SimWorkload
    slo: SLO = Field(default_factory=SLO)
    stall_ms: float = Field(default=250.0, gt=0)
    """An inter-token gap longer than this counts as a stall."""

    def engine_for(self, role: str) -> SimEngine:
        """The engine of `role`'s instances."""
        return self.prefill_engine if role == "prefill" and self.prefill_engine is not None else self.engine

    @classmethod
    def for_deployment(cls, deployment: DeploymentSpec, workload: SimWorkload, *,
                       engine_defaults: dict | None = None, **fields) -> SimSpec:
        """The simulated twin of a real deployment: its pools, token budget, KV cache size and router settings,
        on its model; `fields` add or override the rest (profile, hardware, link, ...). Engine settings the
        deployment leaves to vLLM take `engine_defaults` (vLLM's own defaults where it will run: on pdlab's CPU
        tier a 2,048-token budget, `pdlab.settings`), else the sim spec's."""
        counts = {role: len(deployment.by_role(role)) for role in ("prefill", "decode", "colocated")}
        serving = (deployment.by_role("colocated") + deployment.by_role("decode") + deployment.instances)[0]
        engine = _engine_of(serving, engine_defaults or {})
        prefill = deployment.by_role("prefill")
        if prefill and (prefill_engine := _engine_of(prefill[0], engine_defaults or {})) != engine:
            fields.setdefault("prefill_engine", prefill_engine)
        router = router_settings(deployment)
        data = {"name": deployment.name, "model": deployment.model.name, "pools": counts, "engine": engine,
                "router": router, "workload": workload,
                "dtype_bytes": 4 if deployment.model.dtype == "float32" else 2, **fields}
        return cls.model_validate(data)


def _engine_of(inst: InstanceSpec, defaults: dict) -> dict:
    """A real instance's engine as the simulator's: what it sets, else `defaults` (vLLM's where it runs)."""
    engine = dict(defaults)
    if inst.engine.max_num_batched_tokens:
        engine["max_num_batched_tokens"] = inst.engine.max_num_batched_tokens
    if inst.engine.max_num_seqs:
        engine["max_num_seqs"] = inst.engine.max_num_seqs
    engine["kv_cache_gib"] = inst.kv_cache_gib
    engine["enable_prefix_caching"] = inst.engine.enable_prefix_caching
    if inst.engine.block_size:
        engine["block_size"] = inst.engine.block_size
    if (tokens := inst.engine.kv_cache_block_tokens) is not None:  # vLLM's --num-gpu-blocks-override
        engine["kv_cache_tokens"] = tokens
    return engine
