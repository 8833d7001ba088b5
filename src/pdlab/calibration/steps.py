"""Decode steps read back from streamed tokens: does a profile price the steps a run really took, and does the
simulator build the same batches?

A vLLM step ends by handing one token to every sequence it decodes, so on an instance that streams every token
of a run, the tokens that reach the client within a few milliseconds of each other are one step: its batch is how
many arrived, its context the sum of their sequence lengths, its duration the time since the step before. A step
that decodes the same sequences as the step before (nobody joined, left or idled) is counted as a pure decode step
and priced with the profile's cost model at the same batch and context. The same read-back of the simulator's
tokens for the same arrivals says which batches the simulation formed. Where the per-step prices agree but the
batches differ, a miss in `pdlab sim validate` comes from scheduling (arrivals, KV reads, prefill order), not from
the step costs.

Only a run whose tokens all came from one instance can be read this way: a 1P1D run (the decode instance streams
everything) or a single colocated instance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdlab.calibration.validate import MeasuredRequest, RunDirError, replay_of
from pdlab.config.sim import Pools
from pdlab.sim.costs import StepCost
from pdlab.sim.scenario import build, prepare
from pdlab.sim.summary import token_times

#: Tokens closer than this belong to one step. A step hands its tokens out one stream after another: a batch of
#: ten spreads over more than 2 ms on the local CPU (a 2 ms window split such steps), while the shortest decode
#: step takes over 5 ms.
STEP_GAP_S = 0.004
#: A steady step longer than this many times its decode price is taken to hold a prefill chunk as well (vLLM
#: schedules waiting prompts into decode steps; a batch that did not change says nothing about that).
PREFILL_FACTOR = 3.0
#: Batch sizes grouped in the comparison (upper bounds, inclusive).
BATCH_GROUPS = (1, 3, 7, 15, 10**9)


@dataclass(frozen=True)
class Steps:
    """Steps read back from one side (measured or simulated): each step's end (s), batch, summed context, the
    time since the step before (s; NaN for the first) and whether it is `steady`: the same sequences as the step
    before, each with its next token (nobody joined or left, and the instance did not idle in between)."""

    ends: np.ndarray
    batch: np.ndarray
    context: np.ndarray
    duration: np.ndarray
    steady: np.ndarray


def read_steps(streams: Sequence[tuple[int, Sequence[float]]], gap_s: float = STEP_GAP_S) -> Steps:
    """Steps from (prompt tokens, token arrival times) per request, all streamed by one instance. A request's first
    token ends its prefill (or KV read) and is left out; token i > 0 is decoded with prompt + i tokens of context."""
    times, contexts, owners = [], [], []
    for owner, (prompt_tokens, tokens) in enumerate(streams):
        for i, at in enumerate(tokens[1:], 1):
            times.append(at)
            contexts.append(prompt_tokens + i)
            owners.append(owner)
    if not times:
        empty = np.empty(0)
        return Steps(empty, empty.astype(int), empty.astype(int), empty, empty.astype(bool))
    order = np.argsort(times, kind="stable")
    at, ctx, owner = np.asarray(times)[order], np.asarray(contexts)[order], np.asarray(owners)[order]
    starts = np.concatenate(([0], np.flatnonzero(np.diff(at) > gap_s) + 1))
    step_of = np.repeat(np.arange(starts.size), np.diff(np.append(starts, at.size)))
    ends = np.maximum.reduceat(at, starts)
    batch = np.diff(np.append(starts, at.size))
    context = np.add.reduceat(ctx, starts)
    duration = np.concatenate(([np.nan], np.diff(ends)))
    # A token continues its stream when the same request's token before it came in the step just before.
    by_owner = np.lexsort((at, owner))
    follows = np.zeros(at.size, dtype=bool)
    same = owner[by_owner][1:] == owner[by_owner][:-1]
    follows[by_owner[1:]] = same & (step_of[by_owner][1:] == step_of[by_owner][:-1] + 1)
    continued = np.bincount(step_of, weights=follows, minlength=starts.size)
    steady = np.zeros(starts.size, dtype=bool)
    steady[1:] = (continued[1:] == batch[1:]) & (batch[1:] == batch[:-1])
    return Steps(ends, batch, context, duration, steady)


def _one_instance(pools: Pools, run_dir: Path) -> None:
    streaming = pools.colocated + pools.decode
    if streaming != 1:
        raise RunDirError(f"{run_dir}: its tokens came from {streaming} instances; steps can be read back only "
                          "from a run where one instance streamed every token (1P1D, or one colocated instance)")


def _streams(rows: Sequence[MeasuredRequest]) -> list[tuple[int, list[float]]]:
    return [(r.prompt_tokens, list(r.token_times)) for r in rows if r.token_times]


def _group_label(low: int, high: int) -> str:
    return str(low) if low == high else f"{low}+" if high >= 10**9 else f"{low}-{high}"


def decode_price(cost: StepCost, steps: Steps) -> np.ndarray:
    """What the cost model charges for each step as a pure decode step of its batch and context (s)."""
    return np.array([cost.step_time(0, 0.0, int(b), int(c)) for b, c in zip(steps.batch, steps.context, strict=True)])


def compare_steps(measured: Steps, simulated: Steps, cost: StepCost) -> list[dict]:
    """Per batch group: the pure decode steps each side took (count, tokens, median batch and context), their
    median duration, and what the cost model prices the measured ones at (the median of its step times at their
    batch and context; the profile's step jitter left out). Steady steps over `PREFILL_FACTOR` times their price
    are left out as holding a prefill chunk, and counted (`with_prefill`)."""
    out = []
    low = 1
    prices = {"measured": decode_price(cost, measured), "simulated": decode_price(cost, simulated)}
    for high in BATCH_GROUPS:
        row: dict = {"batch": _group_label(low, high)}
        for side, steps in (("measured", measured), ("simulated", simulated)):
            group = steps.steady & (steps.batch >= low) & (steps.batch <= high)
            prefill = group & (steps.duration > PREFILL_FACTOR * prices[side])
            pick = group & ~prefill
            row[side] = {
                "with_prefill": int(prefill.sum()),
                "steps": int(pick.sum()),
                "tokens": int(steps.batch[pick].sum()),
                "batch_median": float(np.median(steps.batch[pick])) if pick.any() else None,
                "context_median": float(np.median(steps.context[pick])) if pick.any() else None,
                "step_ms_median": float(np.median(steps.duration[pick]) * 1e3) if pick.any() else None,
            }
            if side == "measured":
                row["model_ms_median"] = float(np.median(prices[side][pick]) * 1e3) if pick.any() else None
        out.append(row)
        low = high + 1
    return out


def steps_of_run(run_dir: Path, profile: Path, *, model: str, gap_s: float = STEP_GAP_S) -> dict:
    """Read back a run's decode steps, measured and simulated (the same arrivals replayed with `profile`), and
    compare them per batch group (`compare_steps`)."""
    replay = replay_of(Path(run_dir), profile, model=model)
    _one_instance(replay.spec.pools, Path(run_dir))
    prepared = prepare(replay.spec)
    sim = build(prepared)
    sim.run(replay.arrivals)
    # On the run's clock, so both sides' durations carry the same float rounding.
    origin = min(r.start for r in replay.rows)
    simulated_streams = [(r.arrival.prompt_tokens, list(token_times(r) + origin)) for r in sim.requests]
    measured, simulated = read_steps(_streams(replay.rows), gap_s), read_steps(simulated_streams, gap_s)
    return {"run": str(run_dir), "gap_ms": gap_s * 1e3,
            "groups": compare_steps(measured, simulated, prepared.cost)}
