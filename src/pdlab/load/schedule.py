"""The schedule: every request of a run, decided before the load starts (when it is sent, its class, its exact
prompt and output length). Locust then only sends, so prompt building never competes with sending for the CPU
and a seed gives the same schedule byte for byte.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from pdlab.config.workload import MixedWorkload, ProbeSpec, ProbeWorkload, TraceWorkload, read_trace
from pdlab.load.prompts import PromptBuilder, seeded_rng

Workload = MixedWorkload | TraceWorkload | ProbeWorkload

#: Most locust users `users_for` picks: past this many requests in flight, a 2-core machine is saturated anyway,
#: and `late_s` in the rows shows any arrival that had to wait.
MAX_DEFAULT_USERS = 256

#: Request classes. `short`/`long` split the main load; `probe` marks the steady tiny requests.
CLASSES = ("short", "long", "probe")


@dataclass(frozen=True)
class ScheduledRequest:
    """One request to send."""

    request_id: str
    """Unique within the run, in arrival order (`r00000`, ...)."""
    offset_s: float
    """When to send it, seconds after the load starts."""
    cls: str
    """`short`, `long` or `probe`."""
    prompt: str
    """Prompt text (the message content for chat)."""
    prompt_tokens: int
    """Exact prompt length in tokens as vLLM counts it."""
    max_tokens: int
    """Tokens to generate (sent with `ignore_eos`, so this is the output length)."""
    prefix_id: str = ""
    """Requests with the same prefix id start with the same text (trace: the first hash id)."""
    shared_prefix_tokens: int = 0
    """Leading tokens this prompt shares with an earlier request of the schedule (trace replay)."""


def build_schedule(workload: Workload, builder: PromptBuilder) -> list[ScheduledRequest]:
    """All requests of `workload`, sorted by send time, with prompts sized by `builder`'s tokenizer."""
    if isinstance(workload, MixedWorkload):
        main = _mixed(workload, builder)
    elif isinstance(workload, TraceWorkload):
        main = _trace(workload, builder)
    else:
        main = []
    probes = _probes(workload, builder, main)
    items = sorted(main + probes, key=lambda item: (item.offset, item.order))
    return [
        ScheduledRequest(request_id=f"r{i:05d}", offset_s=round(item.offset, 6), **item.fields)
        for i, item in enumerate(items)
    ]


@dataclass
class _Draft:
    offset: float
    order: int
    fields: dict


def _arrivals(rate: float, poisson: bool, seed: int, duration_s: float | None, limit: int | None,
              measured_rate: bool = False) -> list[float]:
    """Arrival offsets. Poisson gaps are seeded unit-mean draws divided by `rate`. A rate the spec gives is part of
    the seed (each rate of a sweep draws its own pattern); a rate measured on the machine (`prefill_load`) is not:
    the seed's one pattern is stretched to it, so every machine and every run sends the same requests in the same
    order, at the same times measured in that machine's prefills."""
    rng = seeded_rng(seed, "arrivals") if measured_rate else seeded_rng(seed, "arrivals", rate)
    times: list[float] = []
    t = 0.0
    while limit is None or len(times) < limit:
        if poisson:
            t += rng.expovariate(1.0) / rate
        elif times:
            t += 1.0 / rate
        if duration_s is not None and t >= duration_s:
            break
        times.append(t)
    return times


def _mixed(spec: MixedWorkload, builder: PromptBuilder) -> list[_Draft]:
    if spec.needs_sizing:
        raise ValueError(f"this workload gives `prefill_load: {spec.prefill_load}` and no rate yet: size it first with "
                         "a measured prefill (pdlab.experiment.lab.size_workload, or MixedWorkload.sized)")
    classes = seeded_rng(spec.seed, "classes")
    lengths = seeded_rng(spec.seed, "long lengths")  # its own stream: a tail changes no arrival and no class
    drafts = []
    for i, t in enumerate(_arrivals(spec.rate, spec.arrival == "poisson", spec.seed, spec.duration_s,
                                    spec.num_requests, measured_rate=spec.prefill_load is not None)):
        long = classes.random() < spec.long_fraction
        tokens = spec.short_tokens
        if long:
            tail = spec.long_tail is not None and lengths.random() < spec.long_tail.share
            tokens = spec.long_tail.tokens if tail and spec.long_tail else spec.long_tokens
        prompt = builder.prompt(tokens, key=f"{spec.seed}/mixed/{i}", api=spec.api)
        drafts.append(_Draft(t, i, {"cls": "long" if long else "short", "prompt": prompt, "prompt_tokens": tokens,
                                    "max_tokens": spec.long_output_tokens if long else spec.short_output_tokens}))
    return drafts


def _probes(spec: Workload, builder: PromptBuilder, main: list[_Draft]) -> list[_Draft]:
    if isinstance(spec, ProbeWorkload):
        probe = ProbeSpec(rate=spec.rate, prompt_tokens=spec.prompt_tokens, output_tokens=spec.output_tokens)
        span, limit = spec.duration_s, spec.num_requests
    elif spec.probe is not None:
        probe, limit = spec.probe, None
        # Probes cover the main load's arrival span (a main load of n requests spans its last arrival).
        span = spec.duration_s if spec.duration_s is not None else (max(d.offset for d in main) if main else 0.0)
        span = max(span, 1.0 / probe.rate)
    else:
        return []
    drafts = []
    for i, t in enumerate(_arrivals(probe.rate, False, spec.seed, span, limit)):
        prompt = builder.prompt(probe.prompt_tokens, key=f"{spec.seed}/probe/{i}", api=spec.api)
        drafts.append(_Draft(t, 1_000_000 + i, {"cls": "probe", "prompt": prompt, "prompt_tokens": probe.prompt_tokens,
                                                "max_tokens": probe.output_tokens}))
    return drafts


def _spread_ties(times: list[float]) -> list[float]:
    """Sorted timestamps with each run of equal values spread evenly over the gap to the next distinct value (the
    last run over the median gap between distinct values), keeping their order."""
    distinct = sorted(set(times))
    nxt = {a: b - a for a, b in zip(distinct, distinct[1:], strict=False)}
    last_gap = statistics.median(nxt.values()) if nxt else 0.0
    count = Counter(times)
    seen: Counter[float] = Counter()
    spread = []
    for t in times:
        spread.append(t + seen[t] * nxt.get(t, last_gap) / count[t])
        seen[t] += 1
    return spread


def _trace(spec: TraceWorkload, builder: PromptBuilder) -> list[_Draft]:
    rows = read_trace(spec.path)
    if not rows:
        return []
    block = max(1, round(spec.block_tokens * spec.length_scale))
    times = _spread_ties([row["timestamp"] for row in rows]) if spec.spread_ties else [row["timestamp"] for row in rows]
    t0 = times[0]
    overhead = builder.count("", spec.api)
    blocks: dict[tuple[int, int], str] = {}  # (hash id, tokens) -> text, so equal hash ids give equal text
    seen: set[tuple[tuple[int, int], ...]] = set()
    drafts = []
    for i, (row, at_ms) in enumerate(zip(rows, times, strict=True)):
        offset = (at_ms - t0) / 1000.0 * spec.time_scale
        if spec.num_requests is not None and len(drafts) >= spec.num_requests:
            break
        if spec.duration_s is not None and offset >= spec.duration_s:
            break
        tokens = min(spec.max_input_tokens, max(overhead + 1, round(row["input_length"] * spec.length_scale)))
        output = min(spec.max_output_tokens, max(1, round(row["output_length"] * spec.length_scale)))
        prefix, left, shared, chain, sharing = "", tokens - overhead, 0, (), True
        for hash_id in row.get("hash_ids", []):
            take = min(block, left)
            if take <= 0:
                break
            key = (int(hash_id), take)
            if key not in blocks:
                blocks[key] = builder.body(take, key=f"{spec.seed}/block/{hash_id}/{take}")
            prefix += blocks[key]
            left -= take
            chain = (*chain, key)
            sharing = sharing and chain in seen  # shared only while every earlier block was shared too
            shared += take if sharing else 0
            seen.add(chain)
        prompt = builder.prompt(tokens, key=f"{spec.seed}/trace/{i}", api=spec.api, prefix=prefix)
        hash_ids = row.get("hash_ids") or []
        drafts.append(_Draft(offset, i, {
            "cls": "long" if tokens >= spec.long_threshold_tokens else "short", "prompt": prompt,
            "prompt_tokens": tokens, "max_tokens": output, "prefix_id": str(hash_ids[0]) if hash_ids else "",
            "shared_prefix_tokens": shared}))
    return drafts


def write_schedule(items: Iterable[ScheduledRequest], path: str | Path) -> Path:
    """Write the schedule as JSON lines (one request per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for item in items:
            out.write(json.dumps(asdict(item)) + "\n")
    return path


def read_schedule(path: str | Path) -> list[ScheduledRequest]:
    return [ScheduledRequest(**json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]


def schedule_span(items: list[ScheduledRequest]) -> float:
    """Seconds from the first to the last send time."""
    return max((item.offset_s for item in items), default=0.0)


def users_for(items: list[ScheduledRequest], timeout_s: float) -> int:
    """Locust users enough that no arrival waits for a free user: the most requests whose send windows
    [offset, offset + timeout] overlap (a request cannot outlive its timeout), at most MAX_DEFAULT_USERS."""
    if not items:
        return 1
    events = sorted([(i.offset_s, 1) for i in items] + [(i.offset_s + timeout_s, -1) for i in items],
                    key=lambda e: (e[0], e[1]))
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return max(1, min(MAX_DEFAULT_USERS, math.ceil(peak)))
