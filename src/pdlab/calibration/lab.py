"""A lab spec in the simulator (`pdlab sim lab LAB.yaml`): every point `pdlab run` would measure (each scenario,
each sweep value, the baseline), simulated on the schedule the load generator would send, in seconds instead of
the lab's minutes. A preview before a run, and the same numbers `pdlab sim validate` later sets against it.

    points = simulate_lab(load_lab("labs/hol-blocking.yaml"), model_dir=resolve("pdlab-small"))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from pdlab.calibration.validate import CPU_ENGINE_DEFAULTS, NOT_SIMULATED, seed_mean
from pdlab.config.lab import LabSpec
from pdlab.config.sim import SimRequestSpec, SimSpec, SimWorkload
from pdlab.config.workload import MixedWorkload
from pdlab.experiment.lab import LabError, quick_workload
from pdlab.router.strategies import block_hashes
from pdlab.settings import (
    VALIDATION_SEEDS,
    VLLM_CPU_BLOCK_SIZE,
)
from pdlab.sim.costs import ServingOverheads, load_profile
from pdlab.sim.scenario import build, prepare, resolve_profile, summarize_requests
from pdlab.sim.workload import arrivals

#: The profile a local lab is simulated with where this machine has none of its own (`pdlab sim probe`): the one
#: fitted through the simulator on its calibration machine.
DEFAULT_LAB_PROFILE = "pdlab-small-fitted"


def lab_profile(profile: str | None = None) -> tuple[str, str]:
    """The profile a local lab is simulated with, and a line saying which and what its figures are worth:
    `profile` where given, else this machine's own (the newest `pdlab sim probe` fitted here), else the shipped
    DEFAULT_LAB_PROFILE."""
    from datetime import datetime

    from pdlab.sim.scenario import machine_profile
    from pdlab.sim.worth import local_worth

    if profile is None and (mine := machine_profile()) is not None:
        probed = datetime.strptime(mine.parent.name[:15], "%Y%m%d-%H%M%S").strftime("%Y-%m-%d %H:%M")
        chosen, which = str(mine), f"this machine's profile (`pdlab sim probe`, {probed}: {mine})"
    else:
        chosen = profile or DEFAULT_LAB_PROFILE
        which = f"profile {chosen}" + ("" if profile else " (this machine has none of its own: `pdlab sim probe` "
                                                         "fits one in about three minutes)")
    return chosen, f"simulated with {which}; {local_worth(resolve_profile(Path(chosen))).text}"


@dataclass(frozen=True)
class SimulatedPoint:
    """A point of the lab (`LabSpec.points`) as a sim spec."""

    name: str
    spec: SimSpec


def lab_requests(lab: LabSpec, *, model_dir: str, quick: bool = False, duration_s: float | None = None,
                 profile: str = DEFAULT_LAB_PROFILE) -> list[SimRequestSpec]:
    """The requests `pdlab run` would send (the same schedule: `pdlab.load.schedule`, prompts sized with the model's
    tokenizer), as the simulator's workload. A `prefill_load` workload is sized as `pdlab run` sizes it, with the
    lone long prefill priced by `profile` instead of measured."""
    from pdlab.load.prompts import PromptBuilder, as_sent
    from pdlab.load.schedule import build_schedule

    workload = quick_workload(lab, duration_s) if quick or duration_s else lab.workload
    if workload is None:
        raise LabError(f"lab {lab.name!r} has no `workload` to simulate")
    if isinstance(workload, MixedWorkload) and workload.needs_sizing:
        workload = workload.sized(workload.mean_prefill_s(
            {tokens: lone_prefill_s(profile, tokens) for tokens in workload.long_lengths()}))
    builder = PromptBuilder(model_dir)
    schedule = build_schedule(workload, builder)
    caching = any(inst.engine.enable_prefix_caching for spec in lab.scenarios.values() for inst in spec.instances)
    block_size = _block_size(lab) if caching else 0
    requests = []
    for item in schedule:
        hashes: tuple[int, ...] = ()
        if caching:  # the prompt's blocks as the router hashes them (and vLLM's prefix cache keys them)
            hashes = block_hashes(as_sent(builder.counter, item.prompt, workload.api).token_ids, block_size)
        requests.append(SimRequestSpec(at_s=item.offset_s, prompt_tokens=item.prompt_tokens,
                                       output_tokens=item.max_tokens, cls=item.cls, prefix_hashes=list(hashes)))
    return requests


def lone_prefill_s(profile: str, tokens: int) -> float:
    """What the profile says one lone prefill of `tokens` takes to its first token, as `pdlab run` times it to size
    the load (one request on an idle instance: the request's way in, the admission window and every chunk's step,
    the chunk's premium included; `pdlab.calibration.calibrate.probe_ttft`)."""
    from pdlab.calibration.calibrate import probe_ttft

    cost, data = load_profile(resolve_profile(Path(profile)))
    return probe_ttft(cost, ServingOverheads.from_json(data.get("overheads")), tokens)


def _block_size(lab: LabSpec) -> int:
    sizes = {inst.engine.block_size or VLLM_CPU_BLOCK_SIZE
             for spec in lab.scenarios.values() for inst in spec.instances}
    if len(sizes) != 1:
        raise LabError(f"lab {lab.name!r} mixes KV block sizes {sorted(sizes)}: its prompts hash one way")
    return sizes.pop()


def unsimulated(lab: LabSpec, only: Sequence[str] = ()) -> dict[str, str]:
    """The lab's scenarios (of `only`, where given) the simulator leaves out, and why."""
    return {name: NOT_SIMULATED[spec.connector.kind] for name, spec in lab.scenarios.items()
            if spec.connector.kind in NOT_SIMULATED and (not only or name in only)}


def lab_points(lab: LabSpec, requests: Sequence[SimRequestSpec], *, profile: str = DEFAULT_LAB_PROFILE,
               only: Sequence[str] = ()) -> list[SimulatedPoint]:
    """What `pdlab run` measures (`LabSpec.points`), in its order, each as a sim spec on the local loopback link;
    scenarios the simulator does not model (`unsimulated`) are left out."""
    _needs_scenarios(lab)
    try:
        points = lab.points(only)
    except ValueError as error:
        raise LabError(str(error)) from None
    left_out = unsimulated(lab, only)
    points = [point for point in points if point.scenario not in left_out]
    if not points:
        raise LabError(f"nothing to simulate in lab {lab.name!r}: "
                       + "; ".join(f"{name}: {why}" for name, why in left_out.items()))
    everything = SimWorkload(requests=list(requests))
    # As `pdlab run` measures the baseline: the same schedule without the long requests.
    shorts = SimWorkload(requests=[r for r in requests if r.cls != "long"])
    specs = {name: SimSpec.for_deployment(lab.scenarios[name], everything, name=name, profile=profile,
                                          link={"name": "local-loopback"}, engine_defaults=CPU_ENGINE_DEFAULTS)
             for name in dict.fromkeys(point.scenario for point in points)}
    simulated = []
    for point in points:
        spec = specs[point.scenario]
        update = {"name": point.name, "router": spec.router.model_copy(update=point.router)}
        if point.baseline:
            update["workload"] = shorts
        simulated.append(SimulatedPoint(point.name, spec.model_copy(update=update)))
    return simulated


def simulate_lab(lab: LabSpec, *, model_dir: str, profile: str | None = None, quick: bool = False,
                 duration_s: float | None = None, only: Sequence[str] = (), seeds: int = VALIDATION_SEEDS,
                 progress: Callable[[str], None] = lambda _: None) -> dict[str, dict]:
    """Per point (`lab_points`): the requests sent, the requests preempted and, per class, their count and p50 and
    p99 TTFT and ITL, each averaged over `seeds` simulations (as `pdlab sim validate` does: step jitter and a busy
    sender's wake-ups are random). `profile`: `lab_profile`'s choice where not given."""
    _needs_scenarios(lab)
    profile = profile or lab_profile()[0]
    requests = lab_requests(lab, model_dir=model_dir, quick=quick, duration_s=duration_s, profile=profile)
    out = {}
    for point in lab_points(lab, requests, profile=profile, only=only):
        progress(f"simulating {point.name}")
        prepared = prepare(point.spec)
        summaries = []
        for seed in range(seeds):
            sim = build(prepared, seed)
            summaries.append(summarize_requests(point.spec, sim.run(arrivals(point.spec.workload))))
        classes = {cls: {"count": summaries[0][cls]["count"], **metrics}
                   for cls, metrics in seed_mean(summaries).items()}
        out[point.name] = {"requests": len(point.spec.workload.requests), "seeds": seeds,
                           "preemptions": sum(s["preemptions"] for s in summaries) / seeds, **classes}
    return out


def _needs_scenarios(lab: LabSpec) -> None:
    if not lab.scenarios and lab.cluster is not None:
        raise LabError(f"lab {lab.name!r} is a cluster lab: simulate it from a sim spec that names it "
                       "(`cluster_lab:`) and gives a workload, such as labs/sim/hyperpod-llama70b-2p2d.yaml")
    if not lab.scenarios:
        raise LabError(f"lab {lab.name!r} has no `scenarios` to simulate (a lab with one `deployment` is brought "
                       "up with `pdlab up`; `pdlab sim run` takes a sim spec such as labs/sim/local-hol.yaml)")


def points_frame(points: dict[str, dict]) -> pd.DataFrame:
    """`simulate_lab`'s result as a table: one row per point and class, requests and p50/p99 TTFT and ITL (ms)."""
    rows = [{"point": name, "class": cls, "requests": metrics["count"],
             **{f"{metric.removesuffix('_ms').upper()} {pct} ms": metrics[metric].get(pct)
                for metric in ("ttft_ms", "itl_ms") for pct in ("p50", "p99")}}
            for name, point in points.items() for cls, metrics in point.items() if isinstance(metrics, dict)]
    return pd.DataFrame(rows).set_index(["point", "class"])
