"""Cost models: how long one scheduler step and one KV transfer take. The one place for the formulas.

A step is described by these numbers, the same for every cost model:
- `prefill_tokens`: prompt tokens computed in the step (chunks of one or more prompts);
- `prefill_attention`: sum over those chunks of `chunk * (already_computed + chunk / 2)`, the number of
  query-key pairs causal attention touches (grows quadratically with prompt length);
- `decode_seqs`: sequences producing one token each;
- `decode_context`: sum of those sequences' context lengths (attention reads the whole KV cache);
- `fresh_attention`: the part of `prefill_attention` in chunks that start a prompt (nothing of it cached yet).
  On pdlab's CPU tier such a chunk costs more per pair than one that reads cached context: pdlab-small on one
  core, idle (`pdlab bench prefill`, data/results/prefill/), prefills 2,048 tokens in ~775 ms, and the next 952
  tokens of the same prompt (more pairs, half the tokens) in ~435 ms; one price per pair puts that ratio at 1.6,
  measured 1.8, and loaded runs show the same (887 and 490 ms between a stream's tokens, hol-blocking colocated).
- `chunk_square`: sum over the chunks of `chunk * chunk / 2`, whether or not they start their prompt: work that grows
  with the square of each chunk, beside its causal pairs (as if attention computed the whole rectangle of a chunk's
  queries against its keys and masked half). It explains the same first-chunk premium, and also what
  `fresh_attention` gets wrong: prompts queued back to back share steps (a prompt's first chunk fills what the one
  before left of the budget), which cuts their fresh pairs by half and more but their chunks' squares by ~5%. On
  one instance, 4 prompts of 3,000 tokens sent together took 0.997 times as long as the same prompts one at a time
  (median of 10 rounds, 0.94-1.04; `pdlab bench backtoback`, data/results/backtoback/20261202-175725.json): priced
  by fresh pairs the queue takes 0.94 times, by chunk squares 0.99.
A fitted profile prices at most one of the two (`PREMIUMS`); they tell apart only through queued prompts.

`RooflineCost` turns them into time from a hardware and a model shape; `FittedCost` is a linear model in the same
features, fitted by least squares on measured step times (`fit_profile`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from pdlab.model.catalog import Hardware, Link
from pdlab.model.shape import ModelShape

FEATURES = ("constant", "prefill_tokens", "prefill_attention", "decode_seqs", "decode_context", "fresh_attention",
            "chunk_square")
#: What every fitted profile prices (profiles written before `fresh_attention` existed have just these).
BASE_FEATURES = FEATURES[:5]
#: The two ways to price a prefill chunk beyond its causal pairs; a profile has at most one.
PREMIUMS = ("fresh_attention", "chunk_square")
#: What a fit through the simulator prices (`pdlab sim calibrate --from-runs`): the chunks' squares get a queue of
#: prompts right where a premium on chunks that start their prompt does not (above).
DEFAULT_PREMIUM = "chunk_square"
#: What a fit on single measured steps prices (`fit_profile`: the torch grid, `pdlab sim fit`, the GPU bench): whole
#: prompts and chunks after cached context tell fresh pairs from cached ones, not chunks' squares from pairs.
GRID_PREMIUM = "fresh_attention"


def profile_features(premium: str) -> list[str]:
    """The features a fitted profile with `premium` (one of `PREMIUMS`) names, in order."""
    if premium not in PREMIUMS:
        raise ValueError(f"premium {premium!r}: choose one of {', '.join(PREMIUMS)}")
    return [*BASE_FEATURES, premium]


def step_features(prefill_tokens: float, prefill_attention: float, decode_seqs: float,
                  decode_context: float, fresh_attention: float = 0.0, chunk_square: float = 0.0
                  ) -> tuple[float, ...]:
    return (1.0, prefill_tokens, prefill_attention, decode_seqs, decode_context, fresh_attention, chunk_square)


def coefficients_by_name(features: list[str] | tuple[str, ...], values: list[float] | tuple[float, ...]
                         ) -> tuple[float, ...]:
    """A profile's coefficients (for the features it names) in `FEATURES` order, zero for those it does not price."""
    unknown = [f for f in features if f not in FEATURES]
    if unknown or len(set(features)) != len(features) or not set(BASE_FEATURES) <= set(features):
        raise ValueError(f"features {list(features)}: a fitted profile prices {', '.join(BASE_FEATURES)} and at "
                         f"most one of {', '.join(PREMIUMS)}")
    if sum(f in PREMIUMS for f in features) > 1:
        raise ValueError(f"features {list(features)}: price at most one of {', '.join(PREMIUMS)}")
    if len(values) != len(features):
        raise ValueError(f"{len(features)} features but {len(values)} coefficients")
    named = dict(zip(features, values, strict=True))
    return tuple(float(named.get(f, 0.0)) for f in FEATURES)


def chunk_attention(chunk: int, already_computed: int) -> float:
    """Causal attention work of a prefill chunk: each new token attends to everything before it."""
    return chunk * (already_computed + chunk / 2)


class StepCost(Protocol):
    """Anything that prices a scheduler step, in seconds."""

    def step_time(self, prefill_tokens: int, prefill_attention: float, decode_seqs: int,
                  decode_context: int, fresh_attention: float = 0.0, chunk_square: float = 0.0) -> float: ...


def logits_rows(prefill_tokens: int, decode_seqs: int) -> int:
    """Rows a step's LM head computes: one per decoding sequence, one for a prefill (its last token)."""
    return decode_seqs + (1 if prefill_tokens else 0)


@dataclass(frozen=True)
class TensorParallelExchange:
    """What the GPUs of a tensor-parallel instance exchange per step, in seconds, over `link`.

    Megatron-style sharding (as vLLM does it) all-reduces each token's hidden state twice per layer (after
    attention's output projection and after the MLP) and once after the vocab-parallel embedding, and gathers the
    sampled rows' logits. Each collective costs the alpha-beta model's time: a latency term of 2 * ceil(log2 tp)
    link latencies (a tree's reduce and broadcast) plus a bandwidth term of a ring's 2 * (tp - 1) / tp times the
    message (the gather: (tp - 1) / tp). vLLM runs them between kernels, not beside them, so they add to the step."""

    model: ModelShape
    tensor_parallel: int
    link: Link
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        m, tp, link = self.model, self.tensor_parallel, self.link
        all_reduces, bytes_per_s = 2 * m.num_layers + 1, link.bytes_per_s
        object.__setattr__(self, "_fixed", (all_reduces + 1) * 2 * math.ceil(math.log2(tp)) * link.latency_us / 1e6)
        object.__setattr__(self, "_per_token",
                           all_reduces * 2 * (tp - 1) / tp * m.hidden_size * self.dtype_bytes / bytes_per_s)
        object.__setattr__(self, "_per_logits_row", (tp - 1) / tp * m.vocab_size * self.dtype_bytes / bytes_per_s)

    def time(self, tokens: int, logits_rows: int) -> float:
        return self._fixed + tokens * self._per_token + logits_rows * self._per_logits_row

    def for_step(self, prefill_tokens: int, decode_seqs: int) -> float:
        """What a scheduler step's tokens exchange."""
        return self.time(prefill_tokens + decode_seqs, logits_rows(prefill_tokens, decode_seqs))


@dataclass(frozen=True)
class RooflineCost:
    """Per-operation roofline: each part takes max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth).

    Linear layers read every weight once per step and do 2 FLOPs per weight per token; attention does
    4 * heads * head_dim FLOPs per query-key pair per layer and reads the KV cache of every decoding sequence.
    Tensor parallelism multiplies compute and bandwidth, and adds what its GPUs exchange over `interconnect`
    (`hardware.tensor_parallel_link`; `TensorParallelExchange`)."""

    hardware: Hardware
    model: ModelShape
    dtype_bytes: int = 2
    tensor_parallel: int = 1
    interconnect: Link | None = None

    def __post_init__(self) -> None:
        hw, m, tp = self.hardware, self.model, self.tensor_parallel
        if tp > 1 and self.interconnect is None:
            raise ValueError(f"tensor_parallel {tp} needs the interconnect its all-reduces cross")
        flops = hw.peak_bf16_tflops * 1e12 * hw.compute_efficiency * tp
        bandwidth = hw.hbm_gbps * 1e9 * hw.memory_efficiency * tp
        # Precomputed per-unit costs keep step_time to a few float operations (it runs once per simulated step).
        object.__setattr__(self, "_s_per_linear_token", 2 * m.num_layers * m.layer_params / flops)
        object.__setattr__(self, "_s_per_logits_row", 2 * m.vocab_size * m.hidden_size / flops)
        object.__setattr__(self, "_s_weights", m.params * self.dtype_bytes / bandwidth)
        object.__setattr__(self, "_s_per_attention_pair", 4 * m.num_layers * m.num_heads * m.head_dim / flops)
        object.__setattr__(self, "_s_per_kv_token", m.kv_bytes_per_token(self.dtype_bytes) / bandwidth)
        object.__setattr__(self, "_overhead", hw.step_overhead_ms / 1e3 + m.num_layers * hw.layer_overhead_us / 1e6)
        object.__setattr__(self, "_exchange", TensorParallelExchange(m, tp, self.interconnect, self.dtype_bytes)
                           if tp > 1 else None)

    def terms(self, prefill_tokens: int, prefill_attention: float, decode_seqs: int,
              decode_context: int) -> tuple[float, float, float, float]:
        """A step's four roofline times at this hardware's efficiencies, in seconds: the linear layers' FLOPs, their
        weights' bytes, attention's FLOPs and the KV bytes it reads. The step takes the overhead, the larger of the
        first two, the larger of the last two, and the tensor-parallel exchange."""
        # FLOPs and bytes count causal pairs only: neither premium of the CPU tier's fitted profiles is priced.
        rows = logits_rows(prefill_tokens, decode_seqs)
        return ((prefill_tokens + decode_seqs) * self._s_per_linear_token + rows * self._s_per_logits_row,
                self._s_weights, (prefill_attention + decode_context) * self._s_per_attention_pair,
                (decode_context + prefill_tokens) * self._s_per_kv_token)

    def step_time(self, prefill_tokens: int, prefill_attention: float, decode_seqs: int,
                  decode_context: int, fresh_attention: float = 0.0, chunk_square: float = 0.0) -> float:
        if prefill_tokens + decode_seqs == 0:
            return 0.0
        linear_flops, weights, attention_flops, kv_reads = self.terms(prefill_tokens, prefill_attention,
                                                                      decode_seqs, decode_context)
        exchange = self._exchange.for_step(prefill_tokens, decode_seqs) if self._exchange is not None else 0.0
        if prefill_tokens and decode_seqs:
            # A mixed step: the chunk's attention (compute-bound) and the decodes' (reading their KV, memory-bound)
            # are separate work that cannot hide under each other, so each pays its own roofline; one max over both
            # priced the held-out mixed steps timed on an H200 a median 5.8% low (up to 25.6%), apart 4.4% (18.0%)
            # (docs/simulator.md, "Mixed steps on GPUs").
            attention = (max(prefill_attention * self._s_per_attention_pair, prefill_tokens * self._s_per_kv_token)
                         + decode_context * max(self._s_per_attention_pair, self._s_per_kv_token))
        else:
            attention = max(attention_flops, kv_reads)
        return self._overhead + max(linear_flops, weights) + attention + exchange


@dataclass(frozen=True)
class ForwardPassCost:
    """A GPU profile's forward pass (`pdlab.benchmarks.gpu_phases`, one GPU's shard where tensor-parallel), plus
    what the profile cannot time: the serving engine's own work per step (`hardware.step_overhead_ms`, as the
    roofline adds it) and, for a shard, what the GPUs exchange."""

    forward: StepCost
    serving_overhead_s: float
    exchange: TensorParallelExchange | None = None

    def step_time(self, prefill_tokens: int, prefill_attention: float, decode_seqs: int,
                  decode_context: int, fresh_attention: float = 0.0, chunk_square: float = 0.0) -> float:
        if prefill_tokens + decode_seqs == 0:
            return 0.0
        exchange = self.exchange.for_step(prefill_tokens, decode_seqs) if self.exchange is not None else 0.0
        return self.serving_overhead_s + exchange + self.forward.step_time(
            prefill_tokens, prefill_attention, decode_seqs, decode_context, fresh_attention, chunk_square)


@dataclass(frozen=True)
class FittedCost:
    """step_time = coefficients . step_features(...), fitted on measured steps of one machine and model.
    Coefficients in `FEATURES` order; fewer (5 or 6: profiles from before `fresh_attention` or `chunk_square`)
    leave the rest at zero. A profile names its features: `coefficients_by_name`."""

    coefficients: tuple[float, ...]

    def __post_init__(self) -> None:
        if not len(BASE_FEATURES) <= len(self.coefficients) <= len(FEATURES):
            raise ValueError(f"a fitted cost needs {len(BASE_FEATURES)} to {len(FEATURES)} coefficients "
                             f"({', '.join(FEATURES)}), got {len(self.coefficients)}")
        padded = (*self.coefficients, *(0.0,) * (len(FEATURES) - len(self.coefficients)))
        object.__setattr__(self, "coefficients", padded)

    def values_for(self, features: list[str]) -> list[float]:
        """The coefficients of `features` (names from `FEATURES`), as a profile writes them beside their names."""
        return [self.coefficients[FEATURES.index(f)] for f in features]

    def step_time(self, prefill_tokens: int, prefill_attention: float, decode_seqs: int,
                  decode_context: int, fresh_attention: float = 0.0, chunk_square: float = 0.0) -> float:
        if prefill_tokens == 0 and decode_seqs == 0:
            return 0.0
        c0, c1, c2, c3, c4, c5, c6 = self.coefficients
        return (c0 + c1 * prefill_tokens + c2 * prefill_attention + c3 * decode_seqs + c4 * decode_context
                + c5 * fresh_attention + c6 * chunk_square)


@dataclass(frozen=True)
class CalibrationPoint:
    """One measured step: what it computed and how long it took."""

    prefill_tokens: int
    prefill_context: int
    """Tokens of the same prompt already in the KV cache before this chunk (0 for a whole-prompt prefill)."""
    decode_seqs: int
    decode_context: int
    """Context length of each decoding sequence (all alike in a calibration grid)."""
    step_s: float

    def features(self) -> tuple[float, ...]:
        attention = chunk_attention(self.prefill_tokens, self.prefill_context) if self.prefill_tokens else 0.0
        return step_features(self.prefill_tokens, attention, self.decode_seqs, self.decode_seqs * self.decode_context,
                             attention if self.prefill_context == 0 else 0.0, self.prefill_tokens ** 2 / 2)


def fit_coefficients(points: list[CalibrationPoint], premium: str = GRID_PREMIUM) -> tuple[float, ...]:
    """Non-negative least squares on relative error (so 5 ms decode steps weigh as much as 3 s prefills), in
    `FEATURES` order, with one of the `PREMIUMS` (the other stays zero: a grid of whole prompts and chunks after
    cached context cannot tell both from the causal pairs). Features whose coefficient comes out negative are
    dropped and the rest refitted: a negative cost per token would be an artefact of noise, and it would make the
    simulator predict faster steps for more work."""
    profile_features(premium)  # a known premium
    if len(points) < 2:
        raise ValueError("fitting needs at least two calibration points")
    x = np.array([p.features() for p in points], dtype=float)
    y = np.array([p.step_s for p in points], dtype=float)
    if np.any(y <= 0):
        raise ValueError("calibration step times must be positive")
    weights = 1.0 / y
    priced = FEATURES.index(premium)
    active = [i for i in range(x.shape[1]) if np.any(x[:, i] != 0) and (i == priced or FEATURES[i] not in PREMIUMS)]
    if np.array_equal(x[:, priced], x[:, FEATURES.index("prefill_attention")]):
        active = [i for i in active if i != priced]  # no chunk read cached context: one price for every pair
    while True:
        solution, *_ = np.linalg.lstsq(x[:, active] * weights[:, None], y * weights, rcond=None)
        if np.all(solution >= 0) or len(active) == 1:
            break
        active = [i for i, c in zip(active, solution, strict=True) if c > 0] or active[:1]
    coefficients = np.zeros(x.shape[1])
    coefficients[active] = np.clip(solution, 0, None)
    return tuple(float(c) for c in coefficients)


def fit_profile(points: list[CalibrationPoint], model: str, source: str, premium: str = GRID_PREMIUM) -> dict:
    """A fitted cost profile (JSON-ready): coefficients, the points, and the fit's own error."""
    features = profile_features(premium)
    cost = FittedCost(fit_coefficients(points, premium))
    errors = [abs(cost.step_time(*p.features()[1:]) - p.step_s) / p.step_s * 100 for p in points]
    return {
        "kind": "fitted",
        "model": model,
        "features": features,
        "coefficients": cost.values_for(features),
        "fit_error_pct": {"mean": float(np.mean(errors)), "max": float(np.max(errors))},
        "source": source,
        "points": [p.__dict__ for p in points],
    }


@dataclass(frozen=True)
class ServingOverheads:
    """What a request pays outside the engine's steps, and how much steps vary, on a real server.

    - `request_s`: from the client sending to the instance's scheduler seeing it (HTTP, the router's token count
      and choice, vLLM's own tokenization): added to every TTFT;
    - `handoff_s`: on the P/D path, from prefill's answer to the decode instance starting to pull the KV (the
      router's second request);
    - `step_jitter_s`: how much a step's time strays from its cost model, in seconds (quantiles at evenly spaced
      probabilities, from 0 to 1): on a shared CPU the API server's streaming, other processes and Python's garbage
      collector add or take a few milliseconds around a step, which is what sets the p99 of inter-token latency.
      Additive, not a factor: a 1-second prefill step is not stretched by half because 10 ms decode steps vary by
      half. Empty: no variation;
    - `step_jitter_pd_s`: the same for the instances of a deployment with prefill and decode pools, read apart
      from P/D runs; empty: they use `step_jitter_s`. On the local tier their steps stray further: the decode
      instance's steps at batch 1 reach a p99 of 21-24 ms while the prefill instance computes against 14-15 ms
      while it idles (hol-blocking runs), and the P/D calibration runs' quiet gaps reach +8.9 ms at their 99th
      percentile where the colocated runs' reach +6.4;
    - `transfer_waits_for_sender`: a KV read depends on the prefill instance it reads from: beside an idle one it
      runs at the link's speed at once; posted while it computes, it completes only when the sender's side of the
      transfer gets to run (`sender_wake_s`), then its bytes move at the link's speed. On a CPU server the sending
      side of a transfer is served by threads that share the engine's core (NIXL's progress thread at idle
      priority, and the engine itself between steps). Measured on the local tier (1P1D, a 3,000-token prompt's 50
      MB of KV, `pdlab bench transfer`, data/results/transfer/): 6 ms beside an idle prefill instance, 0.3-1.0 s
      (median 0.86) while it prefilled another prompt in 2,048-token steps of ~0.9 s. False: transfers do not
      depend on the sender's engine (one-sided RDMA on GPUs);
    - `sender_wake_s`: with `transfer_waits_for_sender`, the mean time between the moments a computing sender
      serves its pending reads (its progress thread getting a slice of the busy core): a read posted while the
      sender computes completes at the first such moment or when the sender goes idle, whichever comes first,
      together with every other read waiting on that sender, whatever their sizes. The moments form a renewal
      process that starts when the sender starts computing (at a random point of a gap) and whose gaps are
      gamma-distributed with this mean and `sender_wake_cv` (seeded). 0: only when the sender goes idle. Why this
      shape: `pdlab bench transfer`'s hand-driven trials post one read, or three of 50 MB together, beside a sender
      computing a long prompt, and watch when the sender's idle-class thread (NIXL's progress thread) runs: every
      read's first token comes 26-76 ms (median 41 alone, 66 for three) after the first slice the thread gets
      after the read was posted, whether it is alone or one of three, and the three end within a few milliseconds
      of each other (data/results/transfer/20261202-030654.json). Fitted (`pdlab sim calibrate --from-runs`):
      the same bench measures the gaps directly, but on the machine and the day it runs, and the runs the profile
      is fitted on were recorded on another;
    - `sender_wake_cv`: the coefficient of variation of those gaps; 1 is exponential (memoryless). Measured, not
      fitted: 0.68 over 206 gaps (mean 642 ms, median 546) in the bench above; a ratio, so it carries over between
      days on which the machine ran at different speeds;
    - `admission_s`: per instance role (colocated, prefill, decode), how long an idle instance takes to start its
      first step after work arrives; whatever arrives meanwhile joins that step. vLLM's engine, woken by a
      request, takes in every request queued by then, and on a CPU server the API server, the engine and (on P/D
      instances) NIXL's progress threads share one core: `pdlab bench admission` measured 0.4-0.7 ms on colocated
      instances and 1.0-2.4 ms on P/D ones, from one hour to the next (data/results/admission/). A step started
      the instant the first request arrived would serve a trace's tied burst one prompt at a time;
    - `request_per_stream_s`: more of `request_s` per sequence decoding on the instance the request reaches (on
      the P/D path, the decode instance's share comes with the router's second request): its API server shares
      the core with the engine and streams every running sequence's tokens, so a new request is read, tokenized
      and handed over later the more streams it serves. `pdlab bench streams` measures how a short prompt's TTFT
      grows with the streams beside it; what the step costs do not explain of that is this (held in the fit).
    Zero (and False) for roofline (GPU) costs, which describe the engine alone."""

    request_s: float = 0.0
    handoff_s: float = 0.0
    step_jitter_s: tuple[float, ...] = ()
    step_jitter_pd_s: tuple[float, ...] = ()
    transfer_waits_for_sender: bool = False
    sender_wake_s: float = 0.0
    sender_wake_cv: float = 1.0
    admission_s: dict[str, float] = field(default_factory=dict)
    request_per_stream_s: float = 0.0

    def step_jitters(self, seed: int = 0, block: int = 256, pd: bool = False):  # type: ignore[no-untyped-def]
        """An endless supply of step-time offsets (s) drawn from `step_jitter_s` (0.0 when there are none); with
        `pd`, from `step_jitter_pd_s` when the profile has it. The same seed draws the same probabilities either way
        (an engine serves one kind of deployment), so equal quantiles give equal offsets. Drawn `block` at a time:
        numpy's generator gives the same stream whatever the block, and a small one spares the many short
        simulations of a calibration fit from drawing thousands of offsets they never use."""
        quantiles = self.step_jitter_pd_s if pd and self.step_jitter_pd_s else self.step_jitter_s
        if not quantiles:
            while True:
                yield 0.0
        rng = np.random.default_rng(seed)
        probs = np.linspace(0.0, 1.0, len(quantiles))
        while True:
            yield from np.interp(rng.random(block), probs, quantiles).tolist()

    def to_json(self) -> dict:
        return {"request_ms": self.request_s * 1e3, "request_per_stream_ms": self.request_per_stream_s * 1e3,
                "handoff_ms": self.handoff_s * 1e3,
                "step_jitter_ms": [q * 1e3 for q in self.step_jitter_s],
                "step_jitter_pd_ms": [q * 1e3 for q in self.step_jitter_pd_s],
                "transfer_waits_for_sender": self.transfer_waits_for_sender,
                "sender_wake_ms": self.sender_wake_s * 1e3,
                "sender_wake_cv": self.sender_wake_cv,
                "admission_ms": {role: seconds * 1e3 for role, seconds in self.admission_s.items()}}

    @classmethod
    def from_json(cls, data: dict | None) -> ServingOverheads:
        data = data or {}
        if "step_quantiles" in data:
            raise ValueError("this profile's overheads have `step_quantiles` (step variation as a factor, an "
                             "earlier pdlab); re-fit it with `pdlab sim calibrate --from-runs RUN_DIRS`")
        if "busy_sender_mb_s" in data:
            raise ValueError("this profile's overheads have `busy_sender_mb_s` (KV reads crawling at a rate beside "
                             "a busy sender, an earlier pdlab); re-fit it with `pdlab sim calibrate --from-runs "
                             "RUN_DIRS`")
        return cls(request_s=float(data.get("request_ms", 0.0)) / 1e3,
                   request_per_stream_s=float(data.get("request_per_stream_ms", 0.0)) / 1e3,
                   handoff_s=float(data.get("handoff_ms", 0.0)) / 1e3,
                   step_jitter_s=tuple(float(q) / 1e3 for q in data.get("step_jitter_ms", ())),
                   step_jitter_pd_s=tuple(float(q) / 1e3 for q in data.get("step_jitter_pd_ms", ())),
                   transfer_waits_for_sender=bool(data.get("transfer_waits_for_sender", False)),
                   sender_wake_s=float(data.get("sender_wake_ms", 0.0)) / 1e3,
                   sender_wake_cv=float(data.get("sender_wake_cv", 1.0)),
                   admission_s={str(role): float(ms) / 1e3 for role, ms in (data.get("admission_ms") or {}).items()})


def load_profile(path: str | Path) -> tuple[FittedCost, dict]:
    """Read a fitted profile JSON (as written by `pdlab sim calibrate` or `fit_profile`); its serving overheads,
    if any, are `ServingOverheads.from_json(profile.get("overheads"))`."""
    profile = json.loads(Path(path).read_text())
    if profile.get("kind") != "fitted" or not isinstance(profile.get("features"), list):
        raise ValueError(f"{path}: not a pdlab fitted cost profile (kind 'fitted' with a list of features)")
    try:
        return FittedCost(coefficients_by_name(profile["features"], profile.get("coefficients") or [])), profile
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


@dataclass(frozen=True)
class TransferCost:
    """KV transfer over a link: latency plus bytes over bandwidth, split into `concurrency` equal lanes.
    With layer-wise overlap the prefill instance sends each layer's KV as soon as it is computed, so only the
    part that could not overlap the prefill (at least one layer's worth) remains after the prefill ends."""

    link: Link
    kv_bytes_per_token: int
    num_layers: int
    concurrency: int = 1
    layerwise_overlap: bool = False

    def transfer_time(self, tokens: int, prefill_s: float = 0.0) -> float:
        wire = tokens * self.kv_bytes_per_token / (self.link.bytes_per_s / self.concurrency)
        if self.layerwise_overlap:
            wire = max(wire - prefill_s * (self.num_layers - 1) / self.num_layers, wire / self.num_layers)
        return self.link.latency_us / 1e6 + wire
