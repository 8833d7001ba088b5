"""The simulator's workload input: an explicit list of requests, or a seeded Poisson arrival process with two
request classes (short chat turns and long documents).

This is the simulator's own minimal form. A lab's `WorkloadSpec` (pdlab.config.workload) maps onto it: each
request the load generator would send becomes one `SimRequestSpec` (arrival time, prompt and output tokens, class).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pydantic import Field, model_validator

from pdlab.config.base import Spec


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


class SimWorkload(Spec):
    """What the simulated clients send: `requests`, or `poisson` (exactly one)."""

    requests: list[SimRequestSpec] = []
    poisson: PoissonBimodal | None = None

    @model_validator(mode="after")
    def _one_source(self) -> SimWorkload:
        if bool(self.requests) == (self.poisson is not None):
            raise ValueError("give either `requests` or `poisson`, not both or neither")
        return self


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
