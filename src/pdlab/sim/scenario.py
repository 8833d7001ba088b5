"""From a SimSpec to a finished simulation: pick the cost model, size the KV caches, build the pools, run."""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdlab.config.base import ConfigError
from pdlab.config.sim import SimEngine, SimSpec
from pdlab.model.catalog import Catalog, Hardware, Link, catalog_dir, load_catalog
from pdlab.model.shape import ModelShape
from pdlab.settings import data_dir, runs_dir
from pdlab.sim.costs import (
    ForwardPassCost,
    RooflineCost,
    ServingOverheads,
    StepCost,
    TensorParallelExchange,
    TransferCost,
    load_profile,
)
from pdlab.sim.engine import Instance, SimRequest, Simulation
from pdlab.sim.engine import Link as LinkQueue
from pdlab.sim.summary import summarize
from pdlab.sim.workload import Arrival, arrivals


@dataclass
class Prepared:
    """Everything a spec resolves to before the engine runs (reused across runs of the same spec)."""

    spec: SimSpec
    model: ModelShape
    cost: StepCost
    link: Link
    kv_capacity: int
    cost_source: str
    overheads: ServingOverheads
    prefill_cost: StepCost | None = None
    """The prefill pool's where `spec.prefill_engine` makes it differ; None: `cost` (so a copy with another `cost`,
    as a fit tries them, prices every pool with it)."""
    prefill_kv_capacity: int | None = None
    """Likewise, None: `kv_capacity`."""


def resolve_link(spec: SimSpec, catalog: Catalog) -> Link:
    choice = spec.link
    base = catalog.get("links", choice.name) if choice.name else None
    updates = {k: v for k, v in (("bandwidth_gbps", choice.bandwidth_gbps), ("latency_us", choice.latency_us))
               if v is not None}
    if base is None:
        return Link(source="given in the sim spec", **updates)
    return base.model_copy(update=updates) if updates else base


def profile_dirs() -> tuple[Path, ...]:
    """Where shipped profiles are found by name: the local tier's in the catalog, the measured GPUs' beside their
    raw results (`pdlab.benchmarks.gpu_phases`)."""
    return catalog_dir() / "profiles", data_dir() / "results" / "gpu"


#: The name that stands for this machine's own profile (`pdlab sim probe`), wherever a profile is named.
MACHINE_PROFILE = "machine"


def probe_dir() -> Path:
    """Where `pdlab sim probe` writes (a directory per probe: probe.json, profile.json)."""
    return runs_dir() / "sim-probe"


def same_machine(environment: dict | None) -> bool:
    """Whether a recorded environment (`pdlab.environment.capture`) is a CPU of this machine's kind and size: the
    same family, model and instruction set, as many cores."""
    from pdlab.environment import cpu_identity

    if not environment or not environment.get("cpu"):
        return False
    here, there = cpu_identity(), environment["cpu"]
    facts = ("family", "model", "isa", "implementer", "part")
    return (all(here.get(f) == there.get(f) for f in facts) and bool(here)
            and environment.get("cpu_count") == os.cpu_count())


def machine_profile() -> Path | None:
    """This machine's profile: the newest `pdlab sim probe` fitted on a CPU of this machine's kind and size
    (`probe_dir()`), or None where none was."""
    for path in sorted(probe_dir().glob("*/profile.json"), reverse=True):
        with contextlib.suppress(OSError, ValueError):
            if same_machine(json.loads(path.read_text()).get("environment")):
                return path
    return None


def resolve_profile(path: Path) -> Path:
    """A profile path as given, else a shipped name (`pdlab-small-vllm-cpu`, `Llama-3.1-70B-NVIDIA-H200-tp2`), or
    `machine`: this machine's (`machine_profile`)."""
    if path.exists():
        return path
    if str(path) == MACHINE_PROFILE:
        if (found := machine_profile()) is None:
            raise ConfigError("profile", [(MACHINE_PROFILE, "this machine has no profile yet: `pdlab sim probe` "
                                                            "measures it and fits one (about three minutes)")])
        return found
    for folder in profile_dirs():
        shipped = folder / f"{path.name}.json"
        if len(path.parts) == 1 and shipped.exists():  # a bare name (model names hold dots: no suffix test)
            return shipped
    known = sorted(p.stem for folder in profile_dirs() for p in folder.glob("*.json")
                   if not p.stem.startswith("efficiency-"))
    raise ConfigError("profile", [(str(path), f"no such file, nor a shipped profile; shipped: {known}")])


def check_tensor_parallel(tp: int, hardware: Hardware, model: ModelShape, spec: SimSpec,
                          field: str = "engine") -> None:
    """What vLLM itself requires of a tensor-parallel size, and what the roofline models (one node's link)."""
    problems = []
    if tp > hardware.gpus_per_node:
        problems.append(f"{tp} GPUs span more than one {spec.hardware} node ({hardware.gpus_per_node} GPUs on "
                        f"{hardware.tensor_parallel_link}); tensor parallelism across nodes is not modelled: use "
                        "more instances instead")
    if model.num_heads % tp:
        problems.append(f"{spec.model}'s {model.num_heads} attention heads do not split over {tp} GPUs")
    elif model.num_kv_heads % tp and tp % model.num_kv_heads:
        problems.append(f"{spec.model}'s {model.num_kv_heads} KV heads neither split over {tp} GPUs nor "
                        "replicate evenly on them")
    if problems:
        raise ConfigError("sim spec", [(f"{field}.tensor_parallel", "; ".join(problems))])


def prepare(spec: SimSpec, catalog: Catalog | None = None) -> Prepared:
    catalog = catalog or load_catalog()
    model: ModelShape = catalog.get("models", spec.model)
    kv_per_token = model.kv_bytes_per_token(spec.dtype_bytes)
    overheads = ServingOverheads()
    profile: dict = {}
    fitted: StepCost | None = None
    if spec.profile is not None:
        fitted, profile = load_profile(resolve_profile(spec.profile))
        overheads = ServingOverheads.from_json(profile.get("overheads"))
    gpu_profile = fitted is not None and profile.get("gpu") not in (None, "cpu")
    if gpu_profile and profile.get("model") not in (None, spec.model):
        raise ConfigError("sim spec", [("profile", f"{spec.profile} timed {profile['model']}, but the spec simulates "
                                                   f"{spec.model}: choose a profile of {spec.model}")])

    def priced(engine: SimEngine, field: str) -> tuple[StepCost, int, str]:
        """One pool's step cost, KV capacity (tokens per instance) and where the cost comes from."""
        tp = engine.tensor_parallel
        if fitted is not None:
            # A profile prices steps on the machine it timed; a GPU profile's instance still has `hardware`'s
            # memory and links. A GPU profile times the forward pass alone: the serving engine's own work per step
            # is `hardware.step_overhead_ms`, as in the roofline, and one of a tensor-parallel shard
            # (`gpu_phases --tensor-parallel N`) lacks what the shards exchange, which one GPU cannot time:
            # the roofline's exchange adds it.
            shard = int(profile.get("tensor_parallel", 1))
            if shard != tp:
                raise ConfigError("sim spec", [(f"{field}.tensor_parallel", f"{tp}, but profile {spec.profile} "
                                                f"timed {'a shard of ' if shard > 1 else ''}{shard} GPU(s)")])
            cost: StepCost = fitted
            source = f"fitted profile {spec.profile} ({profile.get('source', '')})"
            if not gpu_profile:
                return cost, engine.kv_cache_tokens or int(engine.kv_cache_gib * 2**30 // kv_per_token), source
        hardware = catalog.get("hardware", spec.hardware)
        check_tensor_parallel(tp, hardware, model, spec, field)
        interconnect = catalog.get("links", hardware.tensor_parallel_link)
        if fitted is None:
            cost = RooflineCost(hardware, model, spec.dtype_bytes, tp, interconnect)
            source = f"roofline: {spec.hardware} x{tp}"
        else:
            exchange = TensorParallelExchange(model, tp, interconnect, spec.dtype_bytes) if tp > 1 else None
            cost = ForwardPassCost(fitted, hardware.step_overhead_ms / 1e3, exchange)
            source = f"{source} + {hardware.step_overhead_ms:g} ms serving per step, {spec.hardware} x{tp}"
        source += (f" over {hardware.tensor_parallel_link}" if tp > 1 else "") + f", {spec.model}"
        free = hardware.memory_gib * 2**30 * tp * engine.gpu_memory_utilization - model.params * spec.dtype_bytes
        if engine.kv_cache_tokens is None and free <= 0:
            raise ValueError(f"{spec.model} does not fit on {tp} x {spec.hardware}: raise {field}.tensor_parallel")
        # With more GPUs than KV heads each GPU holds a copy of its head's KV (vLLM replicates them).
        replicas = max(1, tp // model.num_kv_heads)
        return cost, engine.kv_cache_tokens or int(free // (kv_per_token * replicas)), source

    cost, capacity, source = priced(spec.engine, "engine")
    prefill_cost, prefill_capacity = None, None
    if spec.prefill_engine is not None and spec.pools.prefill and spec.prefill_engine != spec.engine:
        prefill_cost, prefill_capacity, prefill_source = priced(spec.prefill_engine, "prefill_engine")
        if prefill_source != source:
            source = f"{source}; prefill pool: {prefill_source}"
    link = resolve_link(spec, catalog)
    fitted_link = profile.get("link") if spec.profile is not None else None
    if fitted_link and fitted_link.get("name") == spec.link.name and spec.link.bandwidth_gbps is None:
        # A profile fitted on local runs knows what its loopback carried under load (far less than when idle).
        link = link.model_copy(update={"bandwidth_gbps": fitted_link["bandwidth_gbps"],
                                       "source": f"fitted profile {spec.profile}: {fitted_link.get('source', '')}"})
    # Each rank sends its own heads' KV over its own share of the node's links (NIXL and LMCache move the shards
    # side by side), so an instance of tp GPUs moves tp times a GPU's bandwidth (between pools of different sizes,
    # the smaller one's); not over a NIC they all share.
    ranks = min(spec.engine_for("prefill").tensor_parallel, spec.engine.tensor_parallel)
    if ranks > 1 and link.per_gpu:
        link = link.model_copy(update={"bandwidth_gbps": link.bandwidth_gbps * ranks,
                                       "source": f"{ranks} GPUs' shares: {link.source}"})
    return Prepared(spec, model, cost, link, capacity, source, overheads, prefill_cost, prefill_capacity)


def build(prepared: Prepared, seed: int = 0) -> Simulation:
    """The simulation of `prepared`; `seed` draws its step jitter and a busy sender's wake-ups."""
    spec = prepared.spec

    def instance(name: str, role: str) -> Instance:
        engine = spec.engine_for(role)
        own = role == "prefill" and prepared.prefill_cost is not None
        inst = Instance(name=name, role=role, cost=prepared.prefill_cost if own else prepared.cost,
                        budget=engine.max_num_batched_tokens, max_seqs=engine.max_num_seqs,
                        kv_capacity=prepared.prefill_kv_capacity if own else prepared.kv_capacity,
                        prefix_cache=OrderedDict() if engine.enable_prefix_caching else None,
                        block_size=engine.block_size)
        if role == "prefill":
            inst.link = LinkQueue(TransferCost(prepared.link, prepared.model.kv_bytes_per_token(spec.dtype_bytes),
                                               prepared.model.num_layers, spec.link.concurrency,
                                               spec.link.layerwise_overlap))
        return inst

    pools = spec.pools
    return Simulation(
        router=spec.router,
        colocated=[instance(f"colocated-{i}", "colocated") for i in range(pools.colocated)],
        prefill=[instance(f"prefill-{i}", "prefill") for i in range(pools.prefill)],
        decode=[instance(f"decode-{i}", "decode") for i in range(pools.decode)],
        overheads=prepared.overheads,
        seed=seed,
    )


def summarize_requests(spec: SimSpec, requests: Sequence[SimRequest]) -> dict:
    """Finished requests' summary (same shape as a measured run's) with `spec`'s stall threshold and SLOs."""
    return summarize(requests, stall_ms=spec.stall_ms, ttft_slo_ms=spec.slo.ttft_ms, tpot_slo_ms=spec.slo.tpot_ms)


def simulate(spec: SimSpec, *, catalog: Catalog | None = None, prepared: Prepared | None = None,
             requests: list[Arrival] | None = None) -> tuple[dict, Simulation]:
    """Run `spec`; returns the summary (same shape as a measured run's) and the finished simulation."""
    prepared = prepared or prepare(spec, catalog)
    sim = build(prepared)
    finished = sim.run(requests if requests is not None else arrivals(spec.workload, spec.engine.block_size))
    summary = summarize_requests(spec, finished)
    summary["scenario"] = spec.name
    summary["cost_model"] = prepared.cost_source
    summary["link"] = {"bandwidth_gbps": prepared.link.bandwidth_gbps, "latency_us": prepared.link.latency_us,
                       "source": prepared.link.source}
    summary["kv_cache_tokens_per_instance"] = prepared.kv_capacity
    summary["unfinished"] = sum(1 for r in finished if math.isnan(r.finish) and r.failed is None)
    return summary, sim
