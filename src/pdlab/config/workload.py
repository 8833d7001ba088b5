"""What load to send (pdlab.load): one typed spec per workload kind, told apart by `kind`.

    workload: {kind: mixed, rate: 2.0, duration_s: 60, short_tokens: 64, long_tokens: 4000, long_fraction: 0.1}
    workload: {kind: trace, path: data/traces/conversation.jsonl, time_scale: 0.05, length_scale: 0.25}
    workload: {kind: probe, rate: 4.0, duration_s: 30}

Every length is in tokens of the served model's tokenizer, counting the BOS token vLLM adds (so it matches
vLLM's `prompt_tokens`). Arrivals are open-loop: a request is sent at its scheduled time whether or not earlier
ones have finished.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, model_validator

from pdlab.config.base import ConfigError, Spec
from pdlab.settings import DEFAULT_ROUTING_THRESHOLD, resolve_path

Api = Literal["completions", "chat"]
Arrival = Literal["poisson", "uniform"]


class ProbeSpec(Spec):
    """Tiny requests at a steady rate, sent alongside the main load to see how it stalls unrelated requests."""

    rate: float = Field(default=2.0, gt=0)
    """Probe requests per second, evenly spaced."""
    prompt_tokens: int = Field(default=16, ge=2)
    """Probe prompt length in tokens (BOS included)."""
    output_tokens: int = Field(default=16, ge=1)
    """Tokens each probe generates."""


class LongTail(Spec):
    """Some long prompts much longer than the others: documents' lengths have a tail."""

    tokens: int = Field(ge=2)
    """Prompt length of these long requests, in tokens (BOS included)."""
    share: float = Field(gt=0, lt=1)
    """Share of the long requests that are this long instead of `long_tokens` (drawn per request with the seed)."""


class _WorkloadBase(Spec):
    seed: int = 0
    """Seed for arrivals and prompt text: the same seed gives the same schedule, byte for byte."""
    duration_s: float | None = Field(default=None, gt=0)
    """Schedule arrivals during this many seconds (give this or `num_requests`)."""
    num_requests: int | None = Field(default=None, ge=1)
    """Schedule this many main-load requests (give this or `duration_s`; with both, whichever ends first)."""
    api: Api = "completions"
    """`completions` sends `/v1/completions` with a text prompt; `chat` sends `/v1/chat/completions`."""
    probe: ProbeSpec | None = None
    """Probe requests sent alongside the main load (class `probe`)."""
    users: int | None = Field(default=None, ge=1)
    """Locust users (concurrent senders). Default: enough that an arrival never waits for a free user."""
    timeout_s: float = Field(default=600.0, gt=0)
    """Seconds a request may wait for the next byte from the server before it counts as failed (`timeout`)."""

    @model_validator(mode="after")
    def _has_length(self) -> _WorkloadBase:
        if self.duration_s is None and self.num_requests is None and getattr(self, "kind", "") != "trace":
            raise ValueError("give `duration_s` or `num_requests` (or both)")
        return self


class MixedWorkload(_WorkloadBase):
    """Bimodal load: short prompts (chat turns) and long prompts (documents) arriving at a total rate, given as
    requests per second (`rate`) or as how busy the long prompts keep one prefill core on this machine
    (`prefill_load`)."""

    kind: Literal["mixed"] = "mixed"
    """Workload kind."""
    rate: float = Field(default=1.0, gt=0)
    """Total arrival rate of the main load, requests per second. Set by pdlab when `prefill_load` is given."""
    prefill_load: float | None = Field(default=None, gt=0, lt=1)
    """Instead of `rate`: the share of one core's time that prefilling the long prompts takes on this machine (0.55:
    busy 55% of the time). Machines prefill at very different speeds (1.2 to 7 s for 3,000 tokens on the 2-core
    machines recorded in data/results/prefill/), so a fixed rate that keeps one machine's prefill core comfortably
    busy saturates a slower one's. Before the first scenario, pdlab times lone prefills of the long lengths on the
    machine (`prefill_s`: their mean) and sets `rate = prefill_load / (long_fraction * prefill_s)`; the run's
    workload.json records both. The arrivals are the seed's one pattern stretched to that rate, so every machine
    sends the same requests in the same order."""
    prefill_s: float | None = Field(default=None, gt=0)
    """Set by pdlab when it sizes a `prefill_load` workload: the measured seconds of one lone long prefill (the mean
    over the long lengths, weighted by their shares, with a `long_tail`)."""
    arrival: Arrival = "poisson"
    """`poisson`: exponential gaps (open-loop Poisson); `uniform`: evenly spaced arrivals."""
    short_tokens: int = Field(default=64, ge=2)
    """Prompt length of a short request, in tokens (BOS included)."""
    long_tokens: int = Field(default=DEFAULT_ROUTING_THRESHOLD, ge=2)
    """Prompt length of a long request, in tokens (BOS included)."""
    long_tail: LongTail | None = None
    """A share of the long requests that are longer still (`{tokens: 1536, share: 0.1}`)."""
    long_fraction: float = Field(default=0.1, ge=0, le=1)
    """Share of requests that are long (drawn per request with the seed)."""
    short_output_tokens: int = Field(default=128, ge=1)
    """Tokens a short request generates (`max_tokens`, with `ignore_eos`)."""
    long_output_tokens: int = Field(default=16, ge=1)
    """Tokens a long request generates."""

    @model_validator(mode="after")
    def _rate_or_load(self) -> MixedWorkload:
        if self.prefill_load is not None:
            if "rate" in self.model_fields_set and self.prefill_s is None:
                raise ValueError("give `rate` or `prefill_load`, not both")
            if self.long_fraction == 0:
                raise ValueError("`prefill_load` sizes the load by its long prompts: `long_fraction` must be > 0")
        return self

    def long_lengths(self) -> dict[int, float]:
        """The long prompts' lengths (tokens) and the share of the long requests each makes up."""
        if self.long_tail is None:
            return {self.long_tokens: 1.0}
        return {self.long_tokens: 1.0 - self.long_tail.share, self.long_tail.tokens: self.long_tail.share}

    @property
    def needs_sizing(self) -> bool:
        """A `prefill_load` workload whose rate has not been set from a measured prefill yet."""
        return self.prefill_load is not None and self.prefill_s is None

    def sized(self, prefill_s: float) -> MixedWorkload:
        """This workload with `rate` set so that its long prompts keep one prefill core `prefill_load` busy, given
        that one lone long prefill takes `prefill_s` seconds on average (measured, or a simulator's estimate; see
        `mean_prefill_s`)."""
        if self.prefill_load is None:
            raise ValueError("only a workload with `prefill_load` is sized")
        if prefill_s <= 0:
            raise ValueError(f"prefill_s must be > 0, got {prefill_s}")
        rate = self.prefill_load / (self.long_fraction * prefill_s)
        return self.model_copy(update={"rate": round(rate, 4), "prefill_s": round(prefill_s, 4)})

    def mean_prefill_s(self, prefill_s_of: dict[int, float]) -> float:
        """The mean lone prefill of a long request, from the lone prefill time of each long length."""
        return sum(share * prefill_s_of[tokens] for tokens, share in self.long_lengths().items())


class TraceWorkload(_WorkloadBase):
    """Replay of a Mooncake-format trace (JSON lines with `timestamp` ms, `input_length`, `output_length`,
    `hash_ids`), scaled in time and length to fit the local model. Requests that share leading `hash_ids` share
    the same leading prompt text, so prefix caching sees what it would see in production."""

    kind: Literal["trace"] = "trace"
    """Workload kind."""
    path: str
    """Trace file (JSON lines)."""
    time_scale: float = Field(default=1.0, gt=0)
    """Multiply trace timestamps by this (0.1 replays ten times faster)."""
    length_scale: float = Field(default=1.0, gt=0)
    """Multiply input and output lengths (and the hash block size) by this."""
    block_tokens: int = Field(default=512, ge=1)
    """Tokens per `hash_ids` entry in the trace, before `length_scale` (Mooncake: 512)."""
    max_input_tokens: int = Field(default=7168, ge=2)
    """Cap on a scaled prompt length (keep under the model's context minus the output)."""
    max_output_tokens: int = Field(default=256, ge=1)
    """Cap on a scaled output length."""
    long_threshold_tokens: int = Field(default=DEFAULT_ROUTING_THRESHOLD, ge=2)
    """Prompts with at least this many tokens are class `long`, the others `short`."""
    spread_ties: bool = False
    """Spread requests that share a timestamp evenly, in trace order, over the gap to the next distinct timestamp.
    Mooncake's conversation trace records arrivals in ~3 s steps (up to 28 requests share one instant); replayed
    as recorded they arrive as one burst, and which of them a server takes first is chance, run to run."""


class ProbeWorkload(_WorkloadBase):
    """Probe requests only: the steady tiny load, without a main load (e.g. to measure an idle baseline)."""

    kind: Literal["probe"] = "probe"
    """Workload kind."""
    rate: float = Field(default=2.0, gt=0)
    """Probe requests per second, evenly spaced."""
    prompt_tokens: int = Field(default=16, ge=2)
    """Probe prompt length in tokens (BOS included)."""
    output_tokens: int = Field(default=16, ge=1)
    """Tokens each probe generates."""


WorkloadSpec = Annotated[MixedWorkload | TraceWorkload | ProbeWorkload, Field(discriminator="kind")]
"""A load to send at a deployment; `kind` picks the class."""

_ADAPTER: TypeAdapter[MixedWorkload | TraceWorkload | ProbeWorkload] = TypeAdapter(WorkloadSpec)


def parse_workload(data: Any, source: str = "workload") -> MixedWorkload | TraceWorkload | ProbeWorkload:
    """Validate plain data (e.g. a YAML mapping) into the workload class its `kind` names."""
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as error:
        raise ConfigError.from_validation(source, error) from None


def read_trace(path: str | Path) -> list[dict]:
    """Rows of a Mooncake-format trace (JSON lines: timestamp ms, input_length, output_length, hash_ids), sorted by
    timestamp. A relative path that is not found from the working directory is read from the checkout (so lab and
    sim specs can say `data/traces/...` and run from notebooks/ too)."""
    path = resolve_path(path)
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        missing = {"timestamp", "input_length", "output_length"} - row.keys()
        if missing:
            raise ValueError(f"{path}:{n}: trace row lacks {', '.join(sorted(missing))}")
        rows.append(row)
    return sorted(rows, key=lambda row: row["timestamp"])
