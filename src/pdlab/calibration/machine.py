"""This machine's profile: the shipped fitted profile moved to what `pdlab sim probe` measured here.

A fitted profile prices a scheduler step as `c0 + c1 prefill_tokens + c2 attention_pairs + c3 decode_seqs +
c4 decode_context + c5 premium` plus serving overheads (docs/simulator.md). The probe (`pdlab.calibration.probe`)
times the parts of that sum apart, so the fit moves each group of terms on its own:

- **the decode step** (`c0`, `c3`, `c4`): the probe's decode steps at several batches and contexts. Where one
  factor brings every one within the tolerance, the shape held and the three are rescaled by it; where not, they
  are refitted (non-negative least squares on relative error), if that brings every step within it (else the
  rescale stands: what neither explains is the probe's own noise, ~10% per step between two probes). The serving
  overheads that are the scheduler's and the API server's Python work (the request's way in per stream, the
  router's hand-off, the step jitter, the admission windows) move with the decode step's factor: they are the same
  kind of work.
- **the prefill** (`c1`, `c2`, the chunk premium) and the request's way in (`request_ms`): the probe's lone
  prefills, with the step's constant now known. One factor for the three prefill terms where it holds; where not,
  one for the linear layers and one for attention (pairs and chunk squares: another CPU's kernels can run attention
  at another pace) if that holds, which is as far as five prompt lengths can tell the terms apart. The request's way
  in is fitted beside them, a time of its own.
- **mixed steps** (a chunk beside decodes) are priced as the sum of their parts; the probe's are reported beside
  that price, not fitted (the local tier showed no interaction: docs/simulator.md, "Left out").
- **the KV transfer**: the loopback's bandwidth from the reads beside an idle sender (vLLM's own transfer time),
  and a busy sender's wake-ups (the mean and spread of the gaps between its progress thread's slices) from the
  reads posted while it computed, where the probe saw enough of them; else they are kept.

Everything else of the profile (what a sitting fits and a probe cannot see) is kept. The result records, per group,
what was done and each probe point's error before and after (`machine`).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import least_squares, nnls

from pdlab.calibration.speed import scaled_overheads
from pdlab.settings import VLLM_CPU_MAX_NUM_BATCHED_TOKENS
from pdlab.sim.costs import FEATURES, PREMIUMS, coefficients_by_name

#: Beyond this error on a probe point, one factor does not describe a group of terms: they are refitted.
TOLERANCE_PCT = 10.0
#: Fewest gaps between a busy sender's slices that say their mean and spread (else the profile's are kept).
MIN_SENDER_GAPS = 10
DECODE_TERMS = ("constant", "decode_seqs", "decode_context")
LINEAR_TERMS = ("prefill_tokens",)
ATTENTION_TERMS = ("prefill_attention", *PREMIUMS)


class MachineFitError(ValueError):
    """The probe cannot be fitted (missing parts, or a profile without the terms the fit moves)."""


def _index(name: str) -> int:
    return FEATURES.index(name)


def prefill_chunks(prompt_tokens: int, budget: int = VLLM_CPU_MAX_NUM_BATCHED_TOKENS) -> list[tuple[int, int]]:
    """(chunk, tokens already computed) of a lone prompt under a token budget, as vLLM's chunked prefill splits it."""
    chunks, done = [], 0
    while done < prompt_tokens:
        chunk = min(budget, prompt_tokens - done)
        chunks.append((chunk, done))
        done += chunk
    return chunks


def lone_prefill_features(prompt_tokens: int) -> np.ndarray:
    """The summed step features (FEATURES order) of the steps that prefill one prompt on an idle instance."""
    total = np.zeros(len(FEATURES))
    for chunk, past in prefill_chunks(prompt_tokens):
        pairs = chunk * (past + chunk / 2)
        total += np.array([1.0, chunk, pairs, 0.0, 0.0, pairs if past == 0 else 0.0, chunk * chunk / 2])
    return total


def decode_features(batch: int, context_tokens: float) -> np.ndarray:
    return np.array([1.0, 0.0, 0.0, batch, context_tokens, 0.0, 0.0])


def mixed_features(chunk: int, batch: int, context_tokens: float) -> np.ndarray:
    pairs = chunk * chunk / 2
    return np.array([1.0, chunk, pairs, batch, context_tokens, pairs, chunk * chunk / 2])


def _decode_rows(probe: dict) -> tuple[np.ndarray, np.ndarray]:
    from pdlab.calibration.probe import DECODE_TOKENS

    rows = probe.get("decode") or []
    if len(rows) < 3:
        raise MachineFitError(f"the probe timed {len(rows)} decode steps; the fit needs at least three")
    # Each stream's context grows by a token a step over the window timed: priced at its middle.
    x = np.array([decode_features(r["batch"], r["context_tokens"] + r["batch"] * DECODE_TOKENS / 2) for r in rows])
    return x, np.array([r["step_s"] for r in rows])


def _errors_pct(priced: np.ndarray, measured: np.ndarray) -> np.ndarray:
    return (priced / measured - 1) * 100


def _points(labels: Sequence[dict], measured: np.ndarray, before: np.ndarray, after: np.ndarray) -> list[dict]:
    return [{**label, "measured_ms": m * 1e3, "before_ms": b * 1e3, "after_ms": a * 1e3,
             "error_before_pct": (b / m - 1) * 100, "error_after_pct": (a / m - 1) * 100}
            for label, m, b, a in zip(labels, measured, before, after, strict=True)]


def _summary(errors: np.ndarray) -> dict[str, float]:
    return {"mean": float(np.mean(np.abs(errors))), "max": float(np.max(np.abs(errors)))}


def fit_decode(coefficients: np.ndarray, probe: dict, tolerance_pct: float = TOLERANCE_PCT) -> dict[str, Any]:
    """The decode step's terms on this machine: rescaled by one factor where that brings every probed step within
    `tolerance_pct`, else refitted. Returns the new coefficients and what was done."""
    x, y = _decode_rows(probe)
    idx = [_index(t) for t in DECODE_TERMS]
    before = x @ coefficients
    factor = float(np.exp(np.mean(np.log(y / before))))
    scaled = coefficients.copy()
    scaled[idx] *= factor
    rescaled_errors = _errors_pct(x @ scaled, y)
    decision, chosen = "rescaled", scaled
    if np.max(np.abs(rescaled_errors)) > tolerance_pct:
        # Relative error: a batch-1 step weighs as much as a batch-8 one. Kept only where it brings every step
        # within the tolerance: two probes of one machine differ by up to ~10% per step, and three terms refitted
        # to that noise swing far (one probe's refit put a sequence at 7 times the rescaled price).
        solution, _ = nnls(x[:, idx] / y[:, None], np.ones(len(y)))
        refit = coefficients.copy()
        refit[idx] = solution
        if np.max(np.abs(_errors_pct(x @ refit, y))) <= tolerance_pct:
            decision, chosen = "refitted", refit
    labels = [{"batch": r["batch"], "context_tokens": r["context_tokens"]} for r in probe["decode"]]
    return {"coefficients": chosen, "decision": decision, "factor": factor,
            "points": _points(labels, y, before, x @ chosen),
            "error_after_pct": _summary(_errors_pct(x @ chosen, y)),
            "rescaled_error_pct": _summary(rescaled_errors)}


def fit_prefill(coefficients: np.ndarray, request_s: float, admission_s: float, probe: dict,
                tolerance_pct: float = TOLERANCE_PCT) -> dict[str, Any]:
    """The prefill's terms and the request's way in on this machine, the step's constant (in `coefficients`) held:
    one factor for the prefill terms where it brings every lone prompt within `tolerance_pct`, else one for the
    linear layers and one for attention. The request's way in is fitted beside them (least squares of the log
    ratios)."""
    rows = probe.get("prefill") or []
    if len(rows) < 3:
        raise MachineFitError(f"the probe timed {len(rows)} prompt lengths; the fit needs at least three")
    x = np.array([lone_prefill_features(r["prompt_tokens"]) for r in rows])
    y = np.array([r["ttft_s"] for r in rows])
    linear = [_index(t) for t in LINEAR_TERMS]
    attention = [_index(t) for t in ATTENTION_TERMS]
    fixed = x[:, [i for i in range(len(FEATURES)) if i not in linear + attention]] @ coefficients[
        [i for i in range(len(FEATURES)) if i not in linear + attention]] + admission_s
    lin = x[:, linear] @ coefficients[linear]
    att = x[:, attention] @ coefficients[attention]
    before = fixed + lin + att + request_s

    def model(params: np.ndarray, split: bool) -> np.ndarray:
        request, f_lin = math.exp(params[0]), math.exp(params[1])
        f_att = math.exp(params[2]) if split else f_lin
        return fixed + request + lin * f_lin + att * f_att

    def solve(split: bool) -> tuple[np.ndarray, np.ndarray]:
        start = [math.log(max(request_s, 1e-4)), *([math.log(float(np.median(y / before)))] * (3 if split else 2))]
        fit = least_squares(lambda p: np.log(model(p, split) / y), x0=start[: 3 if split else 2])
        return fit.x, model(fit.x, split)

    params, priced = solve(split=False)
    decision = "rescaled"
    one_factor_errors = _errors_pct(priced, y)
    if np.max(np.abs(one_factor_errors)) > tolerance_pct and len(rows) >= 4:
        split_params, split_priced = solve(split=True)
        if np.max(np.abs(_errors_pct(split_priced, y))) <= tolerance_pct:
            params, priced, decision = split_params, split_priced, "refitted"
    f_lin = math.exp(params[1])
    f_att = math.exp(params[2]) if decision == "refitted" else f_lin
    new = coefficients.copy()
    new[linear] *= f_lin
    new[attention] *= f_att
    labels = [{"prompt_tokens": r["prompt_tokens"]} for r in rows]
    return {"coefficients": new, "request_s": math.exp(params[0]), "decision": decision, "factor": f_lin,
            "attention_factor": f_att, "points": _points(labels, y, before, priced),
            "error_after_pct": _summary(_errors_pct(priced, y)),
            "rescaled_error_pct": _summary(one_factor_errors)}


def price_mixed(coefficients: np.ndarray, probe: dict) -> list[dict]:
    """Each probed mixed step beside its price as the sum of its parts (and the decode step the streams ran
    before the chunk came)."""
    out = []
    for row in probe.get("mixed") or []:
        priced = float(mixed_features(row["chunk_tokens"], row["streams"], row["context_tokens"]) @ coefficients)
        out.append({"streams": row["streams"], "chunk_tokens": row["chunk_tokens"], "measured_ms": row["step_s"] * 1e3,
                    "priced_ms": priced * 1e3, "error_pct": (priced / row["step_s"] - 1) * 100})
    return out


def fit_transfer(profile: dict, probe: dict) -> dict[str, Any]:
    """The loopback's bandwidth beside an idle sender (bytes over vLLM's transfer time, the median trial) and a busy
    sender's wake-up gaps (mean and spread), where the probe saw them; what it kept otherwise."""
    summary = (probe.get("transfer") or {}).get("summary") or {}
    trials = [t for t in (probe.get("transfer") or {}).get("trials") or []
              if t["condition"] == "idle" and t.get("xfer_ms") and t.get("transfers")]
    out: dict[str, Any] = {}
    if trials:
        rates = sorted(t["bytes"] / t["transfers"] * 8 / (t["xfer_ms"] / 1e3) / 1e9 for t in trials)
        out["bandwidth_gbps"] = float(np.median(rates))
        out["idle_trials"] = len(trials)
    busy = next((s for s in summary.values() if "sender_gap_ms_mean" in s), None)
    if busy and busy.get("sender_gaps", 0) >= MIN_SENDER_GAPS:
        out.update(sender_wake_ms=busy["sender_gap_ms_mean"], sender_wake_cv=busy["sender_gap_cv"],
                   sender_gaps=busy["sender_gaps"])
    return out


def fit_machine(start: dict, probe: dict, *, tolerance_pct: float = TOLERANCE_PCT, source: str = "") -> dict:
    """`start` (a fitted profile's JSON) moved to the machine `probe` (a `pdlab sim probe` result) measured."""
    if start.get("kind") != "fitted":
        raise MachineFitError("a machine fit starts from a fitted local profile (such as pdlab-small-fitted)")
    features = list(start["features"])
    coefficients = np.array(coefficients_by_name(features, start["coefficients"]))
    decode = fit_decode(coefficients, probe, tolerance_pct)
    # The scheduler's and the API server's Python work beside the steps moves with the decode step; the request's
    # way in is then fitted on the lone prompts (below), from its scaled value.
    overheads = scaled_overheads(start.get("overheads") or {}, decode["factor"])
    admission_s = float((overheads.get("admission_ms") or {}).get("colocated", 0.0)) / 1e3
    prefill = fit_prefill(decode["coefficients"], float(overheads.get("request_ms", 0.0)) / 1e3, admission_s, probe,
                          tolerance_pct)
    overheads["request_ms"] = prefill["request_s"] * 1e3
    new = prefill["coefficients"]
    transfer = fit_transfer(start, probe)
    for name in ("sender_wake_ms", "sender_wake_cv"):
        if name in transfer:
            overheads[name] = transfer[name]
    moved = copy.deepcopy(start)
    moved["coefficients"] = [float(new[_index(f)]) for f in features]
    moved["overheads"] = overheads
    if "bandwidth_gbps" in transfer:
        moved["link"] = {**(start.get("link") or {}), "bandwidth_gbps": transfer["bandwidth_gbps"],
                         "source": "measured by `pdlab sim probe`: KV reads beside an idle prefill instance (vLLM's "
                                   "transfer time)"}
    mixed = price_mixed(new, probe)

    def group(result: dict) -> dict:
        return {k: v for k, v in result.items() if k != "coefficients"}

    moved["machine"] = {
        "from": start.get("name") or source or "the start profile", "from_source": start.get("source"),
        "tolerance_pct": tolerance_pct, "decode": group(decode), "prefill": group(prefill), "mixed": mixed,
        "transfer": transfer,
        "method": "decode terms and the scheduler's Python overheads by the decode steps, prefill terms and the "
                  "request's way in by the lone prefills (the step's constant held): rescaled by one factor where "
                  "that keeps every probe point within the tolerance, refitted where not; the loopback and a busy "
                  "sender's wake-ups measured; mixed steps priced as their parts (pdlab.calibration.machine)"}
    return moved


def load_probe(path: Path) -> dict:
    """A `pdlab sim probe` result (probe.json), or a MachineFitError naming the file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise MachineFitError(f"{path}: not readable as a probe result ({error})") from None
    if not isinstance(data, dict) or data.get("benchmark") != "sim-probe":
        raise MachineFitError(f"{path}: not a `pdlab sim probe` result (probe.json)")
    return data


def fit_and_write(probe: dict, *, start: str, out: Path, probe_path: Path | None = None,
                  record: bool = False, tolerance_pct: float = TOLERANCE_PCT) -> dict[str, Any]:
    """Fit `probe` from the profile `start` (a name or path), and write `out`/probe.json and `out`/profile.json
    (`probe_path`: where the probe was read from); with `record`, the same two under a new directory of
    data/results/sim-probe/ named as `out`. The profile carries the probe's environment: it is this machine's only
    where it was measured here. Returns the profile and the paths written."""
    from pdlab.benchmarks.results import ensure_new, new_path
    from pdlab.settings import data_dir
    from pdlab.sim.scenario import resolve_profile

    start_path = resolve_profile(Path(start))
    profile = fit_machine({"name": start, **json.loads(start_path.read_text())}, probe, tolerance_pct=tolerance_pct)
    profile.pop("name", None)
    # The probe lies beside the profile (a recorded copy too), wherever the checkout is.
    profile["machine"]["probe"] = "probe.json"
    if probe_path is not None:
        profile["machine"]["probe_from"] = str(probe_path)
    profile["source"] = (f"{start} moved to the machine `pdlab sim probe` measured (probe.json beside it): decode "
                         f"x{profile['machine']['decode']['factor']:.2f} ({profile['machine']['decode']['decision']}), "
                         f"prefill x{profile['machine']['prefill']['factor']:.2f} "
                         f"({profile['machine']['prefill']['decision']})")
    profile["environment"] = probe.get("environment")
    ensure_new(out / "profile.json")
    targets = [out] + ([new_path(data_dir() / "results" / "sim-probe", out.name)] if record else [])
    for folder in targets:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "probe.json").write_text(json.dumps(probe, indent=1) + "\n")
        (folder / "profile.json").write_text(json.dumps(profile, indent=1) + "\n")
    return {"profile": profile, "paths": [str(folder / "profile.json") for folder in targets]}
