"""A fitted profile moved to this machine's speed today, from a one-minute prefill probe.

A fitted profile describes the machine it was calibrated on, at that machine's speed on the day: the shipped
`pdlab-small-fitted` was fitted on a sitting whose `pdlab bench prefill` timed 1,024 tokens in 306 ms, while on
other days the same kind of machine timed them in 622-702 ms. A new sitting (`pdlab sim sitting`, about 1.5 hours)
describes a machine best; this is the quick way: time lone prompts of four lengths on one instance and find the
two factors that bring the profile's time to first token for them closest to the probe's: one for the model's
arithmetic (step costs, serving overheads, step jitter, admission windows) and one for the prefill's attention.
On the same CPU at another speed the two come out close (1.8-2.1 times slower: attention 0.85-1.13 times the
rest), but another CPU runs other kernels (vLLM's CPU backend picks them by the instruction set: AVX-512 and its
bf16 extension, or AVX2 alone): on an AVX2-only host the attention ran 1.8-2.0 times slower than the rest did.
The decode steps' cost of context stays with the arithmetic (a prefill probe cannot time it apart).

The KV transfer is left as it was (the loopback link and the sender's wake-ups): on a host 3-4 times slower,
vLLM's NIXL transfers took 440-660 ms, about what they took on the calibration machine (185-546 ms), while scaled
with the steps the simulator put them at 1.7-2.9 s; copying memory and a thread getting its core are not the
model's arithmetic. The rest of the profile's shape, what a sitting fits, is kept, and the profile records which
CPU facts differ (docs/dev/simulator-calibration.md has what rescaling did to a validation).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pdlab.sim.costs import FEATURES, FittedCost, ServingOverheads, load_profile

#: Profile `overheads` fields that are times in ms: scaled with the steps (the rest are flags and ratios).
_TIMED_OVERHEADS = ("request_ms", "request_per_stream_ms", "handoff_ms")
_TIMED_OVERHEAD_LISTS = ("step_jitter_ms", "step_jitter_pd_ms")

#: Prompt lengths a speed probe times: short (request overhead), mid and long (step costs); under a minute on a
#: slow 2-core host, three repeats each.
PROBE_LENGTHS = (64, 256, 1024, 3000)

#: What a CPU must share with the calibration machine's for its costs to keep their shape (the environment's `cpu`).
_CPU_SHAPE_FACTS = ("family", "model", "isa")
#: The prefill's attention terms: another CPU's kernels may run them at another pace than the rest (see above).
ATTENTION_FEATURES = ("prefill_attention", "fresh_attention", "chunk_square")
#: A probe length whose simulated time is at least this share attention lets the attention factor be fitted.
MIN_ATTENTION_SHARE = 0.1

#: Beyond this error on the probe after scaling, two factors do not describe the machine: a sitting does.
FIT_SPREAD_PCT = 10.0


class SpeedProbeError(ValueError):
    """The probe cannot say this machine's speed (too few points, or a length the profile cannot price)."""


def speed_factor(profile_path: Path, points: Sequence[tuple[int, float]]) -> dict[str, Any]:
    """How much slower (>1) or faster (<1) this machine is than `profile_path` says, from `pdlab bench prefill`
    points ((prompt tokens, fastest seconds)): `factor` for the model's arithmetic and `attention_factor` for the
    prefill's attention, the pair that brings the simulated time to first token closest to the measured one (least
    squares of the log ratios), with each point's ratio and the error the pair leaves. A probe with fewer than
    three lengths, or none whose time is at least a tenth attention, cannot tell the two apart: one factor, the
    geometric mean of the ratios, is both."""
    from scipy.optimize import least_squares

    from pdlab.calibration.calibrate import probe_ttft

    usable = [(int(tokens), float(seconds)) for tokens, seconds in points if tokens > 0 and seconds > 0]
    if len(usable) < 2:
        raise SpeedProbeError(f"a speed probe needs at least two prompt lengths with a time, got {len(usable)}: "
                              f"run `pdlab bench prefill --lengths {','.join(map(str, PROBE_LENGTHS))}`")
    cost, profile = load_profile(profile_path)
    overheads = ServingOverheads.from_json(profile.get("overheads"))
    # The simulated time is linear in the coefficients and the overheads: split it into the attention's part and
    # the rest, each then scaled by its own factor.
    without_attention = FittedCost(tuple(0.0 if name in ATTENTION_FEATURES else c
                                         for name, c in zip(FEATURES, cost.coefficients, strict=True)))
    measured = np.array([seconds for _, seconds in usable])
    total = np.array([probe_ttft(cost, overheads, tokens) for tokens, _ in usable])
    attention = total - np.array([probe_ttft(without_attention, overheads, tokens) for tokens, _ in usable])

    def scaled(factor: float, attention_factor: float) -> np.ndarray:
        return (total - attention) * factor + attention * attention_factor

    one = float(np.exp(np.mean(np.log(measured / total))))
    factor = attention_factor = one
    if len(usable) >= 3 and np.any(attention >= MIN_ATTENTION_SHARE * total):
        fit = least_squares(lambda logs: np.log(scaled(*np.exp(logs)) / measured), x0=[math.log(one)] * 2)
        factor, attention_factor = (float(f) for f in np.exp(fit.x))
    errors = (scaled(factor, attention_factor) / measured - 1) * 100
    rows = [{"prompt_tokens": tokens, "measured_ms": m * 1e3, "profile_ms": t * 1e3, "attention_ms": a * 1e3,
             "ratio": m / t, "error_after_pct": float(e)}
            for (tokens, _), m, t, a, e in zip(usable, measured, total, attention, errors, strict=True)]
    return {"factor": factor, "attention_factor": attention_factor, "points": rows,
            "error_after_pct": {"mean": float(np.mean(np.abs(errors))), "max": float(np.max(np.abs(errors)))}}


def cpu_differences(calibrated_on: dict[str, Any] | None, probed_on: dict[str, Any] | None) -> list[str]:
    """The CPU facts (family, model, instruction set) in which the probe's machine differs from the profile's, as
    'fact: profile's -> probe's'; empty where they agree or either environment does not say."""
    before = (calibrated_on or {}).get("cpu") or {}
    after = (probed_on or {}).get("cpu") or {}
    differences = []
    for fact in _CPU_SHAPE_FACTS:
        if fact in before and fact in after and before[fact] != after[fact]:
            shown = [", ".join(v) if isinstance(v, list) else str(v) for v in (before[fact], after[fact])]
            differences.append(f"{fact}: {shown[0]} -> {shown[1]}")
    return differences


def rescaled(profile: dict[str, Any], factor: float, attention_factor: float | None = None) -> dict[str, Any]:
    """A copy of `profile` (a fitted profile's JSON) with the times the model's arithmetic sets multiplied by
    `factor`, and its prefill attention's cost by `attention_factor` (`factor` when not given)."""
    attention_factor = factor if attention_factor is None else attention_factor
    if not (factor > 0 and attention_factor > 0):
        raise SpeedProbeError(f"speed factors must be positive, got {factor} and {attention_factor}")
    moved = copy.deepcopy(profile)
    moved["coefficients"] = [float(c) * (attention_factor if name in ATTENTION_FEATURES else factor)
                             for name, c in zip(profile["features"], profile["coefficients"], strict=True)]
    if "overheads" in moved:
        moved["overheads"] = scaled_overheads(moved["overheads"], factor)
    return moved


def scaled_overheads(overheads: dict[str, Any], factor: float) -> dict[str, Any]:
    """A copy of a profile's `overheads` with every time in them (the request's way in and its share per stream,
    the hand-off, the step jitter, the admission windows) multiplied by `factor`; flags, ratios and the busy
    sender's wake-ups (not the model's arithmetic) kept."""
    out = copy.deepcopy(overheads)
    for name in _TIMED_OVERHEADS:
        if name in out:
            out[name] = float(out[name]) * factor
    for name in _TIMED_OVERHEAD_LISTS:
        if name in out:
            out[name] = [float(q) * factor for q in out[name]]
    if isinstance(out.get("admission_ms"), dict):
        out["admission_ms"] = {role: float(ms) * factor for role, ms in out["admission_ms"].items()}
    return out


def rescale_profile(profile_path: Path, probe_path: Path, *, profile_name: str) -> dict[str, Any]:
    """The profile at `profile_path` moved to the speed `probe_path` (a `pdlab bench prefill` JSON) measured, with
    a `speed` block saying from what, by how much and how well the factors fit the probe; the fitted profile's
    own figures (fit errors, probes) stay as they were, under `speed.from`."""
    from pdlab.benchmarks.prefill import load_points
    from pdlab.environment import capture

    found = speed_factor(profile_path, load_points(probe_path))
    _, profile = load_profile(profile_path)
    probed_on = json.loads(Path(probe_path).read_text()).get("environment")
    moved = rescaled(profile, found["factor"], found["attention_factor"])
    moved["speed"] = {"from": profile_name, "from_source": profile.get("source"), "probe": str(probe_path),
                      **found,
                      "cpu_differences": cpu_differences(profile.get("environment"), probed_on),
                      "method": "the times the model's arithmetic sets multiplied by one factor and the prefill's "
                                "attention by another, fitted to the probe's measured over the profile's simulated "
                                "time to first token of lone prompts; the KV transfer left as calibrated "
                                "(pdlab.calibration.speed)"}
    moved["source"] = (f"{profile_name} moved to this machine's speed (x{found['factor']:.2f}, attention "
                       f"x{found['attention_factor']:.2f}) by {probe_path}")
    moved["environment"] = capture(include_busy=True)
    return moved
