"""What load to send (pdlab.load): one typed spec per workload kind, told apart by `kind`.

    workload: {kind: mixed, rate: 2.0, duration_s: 60, short_tokens: 64, long_tokens: 4000, long_fraction: 0.1}
    workload: {kind: trace, path: data/traces/conversation.jsonl, time_scale: 0.05, length_scale: 0.25}
    workload: {kind: probe, rate: 4.0, duration_s: 30}

Every length is in tokens of the served model's tokenizer, counting the BOS token vLLM adds (so it matches
vLLM's `prompt_tokens`). Arrivals are open-loop: a request is sent at its scheduled time whether or not earlier
ones have finished.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, model_validator

from pdlab.config.base import ConfigError, Spec
from pdlab.settings import DEFAULT_ROUTING_THRESHOLD

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
    """Bimodal load: short prompts (chat turns) and long prompts (documents) arriving at a total rate."""

    kind: Literal["mixed"] = "mixed"
    """Workload kind."""
    rate: float = Field(default=1.0, gt=0)
    """Total arrival rate of the main load, requests per second."""
    arrival: Arrival = "poisson"
    """`poisson`: exponential gaps (open-loop Poisson); `uniform`: evenly spaced arrivals."""
    short_tokens: int = Field(default=64, ge=2)
    """Prompt length of a short request, in tokens (BOS included)."""
    long_tokens: int = Field(default=DEFAULT_ROUTING_THRESHOLD, ge=2)
    """Prompt length of a long request, in tokens (BOS included)."""
    long_fraction: float = Field(default=0.1, ge=0, le=1)
    """Share of requests that are long (drawn per request with the seed)."""
    short_output_tokens: int = Field(default=128, ge=1)
    """Tokens a short request generates (`max_tokens`, with `ignore_eos`)."""
    long_output_tokens: int = Field(default=16, ge=1)
    """Tokens a long request generates."""


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
