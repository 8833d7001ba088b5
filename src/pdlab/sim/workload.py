"""The simulator's arrivals: a sim spec's workload (`pdlab.config.sim.SimWorkload`: an explicit list of requests,
a seeded Poisson arrival process with two request classes, or a Mooncake-format trace) as the requests the engine
admits, in arrival order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdlab.config.sim import SimTrace, SimWorkload
from pdlab.config.workload import read_trace


@dataclass(frozen=True)
class Arrival:
    """A request ready for the engine (plain dataclass: the engine handles thousands per second)."""

    at_s: float
    prompt_tokens: int
    output_tokens: int
    cls: str
    session: str | None = None
    prefix_hashes: tuple[int, ...] = ()


def arrivals(workload: SimWorkload, block_size: int = 16) -> list[Arrival]:
    """The workload's requests in arrival order; a trace's shared blocks hashed in KV blocks of `block_size`
    tokens (the engine's)."""
    if workload.trace is not None:
        return trace_arrivals(workload.trace, block_size)
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


def trace_arrivals(trace: SimTrace, block_size: int) -> list[Arrival]:
    """A Mooncake-format trace's requests. Each `hash_ids` entry stands for `block_tokens` tokens; its KV blocks of
    `block_size` tokens get chained hashes (block i's covers all before it, as vLLM's prefix cache keys blocks),
    so two prompts share exactly the blocks of their equal leading `hash_ids`."""
    rows = read_trace(trace.path)[:trace.num_requests]
    if not rows:
        return []
    t0 = rows[0]["timestamp"]
    per_id = max(1, trace.block_tokens // block_size)
    out = []
    for row in rows:
        tokens = max(1, int(row["input_length"]))
        hashes: list[int] = []
        chained = 0
        for hash_id in row.get("hash_ids") or []:
            for sub in range(per_id):
                chained = hash((chained, int(hash_id), sub))
                hashes.append(chained)
        out.append(Arrival((row["timestamp"] - t0) / 1000.0 * trace.time_scale, tokens,
                           max(1, int(row["output_length"])),
                           "long" if tokens >= trace.long_threshold_tokens else "short",
                           prefix_hashes=tuple(hashes[:tokens // block_size])))
    return out
