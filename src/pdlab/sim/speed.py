"""A fitted profile moved to this machine's speed today, from a one-minute prefill probe.

A fitted profile describes the machine it was calibrated on, at that machine's speed on the day: the shipped
`pdlab-small-fitted` was fitted on a sitting whose `pdlab bench prefill` timed 1,024 tokens in 306 ms, while the same
CPU model (same family, model and microcode) on other days timed them in 634-678 ms. A new sitting (`pdlab sim
sitting`, about 1.5 hours) describes a machine best; this is the quick way: time lone prompts on one instance, find
the one factor that brings the profile's time to first token for them closest to the probe's (geometric mean of
the ratios), and multiply every time the profile holds by it: step costs, serving overheads, step jitter, the
sender's wake-up and admission windows, and the loopback link's transfer time (on a CPU server moving KV is the
machine's own work too). The profile's shape, what a sitting fits, is kept; only its speed moves.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdlab.sim.costs import ServingOverheads, load_profile

#: Profile `overheads` fields that are times in ms: scaled with the steps (the rest are flags and ratios).
_TIMED_OVERHEADS = ("request_ms", "request_per_stream_ms", "handoff_ms", "sender_wake_ms")
_TIMED_OVERHEAD_LISTS = ("step_jitter_ms", "step_jitter_pd_ms")

#: Prompt lengths a speed probe times: short (request overhead), mid and long (step costs); under a minute on a
#: slow 2-core host, three repeats each.
PROBE_LENGTHS = (64, 256, 1024, 3000)


class SpeedProbeError(ValueError):
    """The probe cannot say this machine's speed (too few points, or a length the profile cannot price)."""


def speed_factor(profile_path: Path, points: Sequence[tuple[int, float]]) -> dict[str, Any]:
    """How much slower (>1) or faster (<1) this machine is than `profile_path` says, from `pdlab bench prefill`
    points ((prompt tokens, fastest seconds)): the geometric mean of measured over simulated time to first token,
    with each point's ratio and the spread the one factor leaves (each point's error after scaling)."""
    from pdlab.sim.calibrate import probe_ttft

    usable = [(int(tokens), float(seconds)) for tokens, seconds in points if tokens > 0 and seconds > 0]
    if len(usable) < 2:
        raise SpeedProbeError(f"a speed probe needs at least two prompt lengths with a time, got {len(usable)}: "
                              f"run `pdlab bench prefill --lengths {','.join(map(str, PROBE_LENGTHS))}`")
    cost, profile = load_profile(profile_path)
    overheads = ServingOverheads.from_json(profile.get("overheads"))
    rows = [{"prompt_tokens": tokens, "measured_ms": seconds * 1e3,
             "profile_ms": probe_ttft(cost, overheads, tokens) * 1e3} for tokens, seconds in usable]
    factor = math.exp(sum(math.log(r["measured_ms"] / r["profile_ms"]) for r in rows) / len(rows))
    for row in rows:
        row["ratio"] = row["measured_ms"] / row["profile_ms"]
        row["error_after_pct"] = (row["profile_ms"] * factor / row["measured_ms"] - 1) * 100
    errors = [abs(row["error_after_pct"]) for row in rows]
    return {"factor": factor, "points": rows,
            "error_after_pct": {"mean": sum(errors) / len(errors), "max": max(errors)}}


def rescaled(profile: dict[str, Any], factor: float) -> dict[str, Any]:
    """A copy of `profile` (a fitted profile's JSON) with every time it holds multiplied by `factor`."""
    if not factor > 0:
        raise SpeedProbeError(f"a speed factor must be positive, got {factor}")
    moved = copy.deepcopy(profile)
    moved["coefficients"] = [float(c) * factor for c in profile["coefficients"]]
    overheads = moved.get("overheads") or {}
    for name in _TIMED_OVERHEADS:
        if name in overheads:
            overheads[name] = float(overheads[name]) * factor
    for name in _TIMED_OVERHEAD_LISTS:
        if name in overheads:
            overheads[name] = [float(q) * factor for q in overheads[name]]
    if isinstance(overheads.get("admission_ms"), dict):
        overheads["admission_ms"] = {role: float(ms) * factor for role, ms in overheads["admission_ms"].items()}
    if isinstance(moved.get("link"), dict):
        for name in ("bandwidth_gbps", "measured_gbps"):
            if name in moved["link"]:
                moved["link"][name] = float(moved["link"][name]) / factor
    return moved


def rescale_profile(profile_path: Path, probe_path: Path, *, profile_name: str) -> dict[str, Any]:
    """The profile at `profile_path` moved to the speed `probe_path` (a `pdlab bench prefill` JSON) measured, with
    a `speed` block saying from what, by how much and how well one factor fits the probe; the fitted profile's
    own figures (fit errors, probes) stay as they were, under `speed.from`."""
    from pdlab.benchmarks.prefill import load_points
    from pdlab.environment import capture

    found = speed_factor(profile_path, load_points(probe_path))
    _, profile = load_profile(profile_path)
    moved = rescaled(profile, found["factor"])
    moved["speed"] = {"from": profile_name, "from_source": profile.get("source"), "probe": str(probe_path),
                      **found,
                      "method": "every time in the profile multiplied by the geometric mean of the probe's "
                                "measured over the profile's simulated time to first token of lone prompts "
                                "(pdlab.sim.speed)"}
    moved["source"] = f"{profile_name} moved to this machine's speed (x{found['factor']:.2f}) by {probe_path}"
    moved["environment"] = capture(include_busy=True)
    return moved
