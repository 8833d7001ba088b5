"""The simulator's arrivals: a sim spec's workload (`pdlab.config.sim.SimWorkload`: an explicit list of requests,
or a seeded Poisson arrival process with two request classes) as the requests the engine admits, in arrival order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdlab.config.sim import SimWorkload


@dataclass(frozen=True)
class Arrival:
    """A request ready for the engine (plain dataclass: the engine handles thousands per second)."""

    at_s: float
    prompt_tokens: int
    output_tokens: int
    cls: str
    session: str | None = None
    prefix_hashes: tuple[int, ...] = ()


def arrivals(workload: SimWorkload) -> list[Arrival]:
    """The workload's requests in arrival order."""
    if workload.poisson is None:
        items = [Arrival(r.at_s, r.prompt_tokens, r.output_tokens, r.cls, r.session, tuple(r.prefix_hashes))
                 for r in workload.requests]
        return sorted(items, key=lambda a: a.at_s)
    p = workload.poisson
    rng = np.random.default_rng(p.seed)
    n = p.num_requests
    times = np.cumsum(rng.exponential(1.0 / p.rate_rps, size=n))
    is_long = rng.random(n) < p.long_fraction
    jitter = rng.uniform(1 - p.spread, 1 + p.spread, size=(2, n))
    prompts = np.where(is_long, p.long_prompt_tokens, p.short_prompt_tokens) * jitter[0]
    outputs = np.where(is_long, p.long_output_tokens, p.short_output_tokens) * jitter[1]
    return [Arrival(float(t), max(1, int(pt)), max(1, int(ot)), "long" if lg else "short")
            for t, pt, ot, lg in zip(times, prompts, outputs, is_long, strict=True)]
