"""The roofline's efficiency factors, fitted on GPU cost profiles (`pdlab.benchmarks.gpu_phases`): the fraction of
a GPU's peak FLOP/s and memory bandwidth that Llama-shaped layers reach, and the fixed time per layer of a forward
pass beyond both. The catalog's factors for a GPU that was measured come from this fit (data/catalog/hardware.yaml,
`pdlab sim efficiency`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from pdlab.model.catalog import Catalog, Hardware, load_catalog
from pdlab.sim.costs import CalibrationPoint, RooflineCost

#: The efficiencies tried, in steps of 0.005: finer than the spread of repeated GPU runs (about 2%).
GRID = np.round(np.arange(0.10, 1.0001, 0.005), 3)


def profile_points(profile: dict[str, Any]) -> list[CalibrationPoint]:
    return [CalibrationPoint(p["prefill_tokens"], p["prefill_context"], p["decode_seqs"], p["decode_context"],
                             p["step_s"]) for p in profile["points"]]


def roofline_terms(profile: dict[str, Any], hardware: Hardware, catalog: Catalog) -> np.ndarray:
    """Each point's four roofline times (`RooflineCost.terms`) on `hardware` at full efficiency, for the shard
    the profile timed (its tensor-parallel degree, without the exchange, which one GPU cannot time), and the
    model's layer count as a fifth column."""
    ideal = hardware.model_copy(update={"compute_efficiency": 1.0, "memory_efficiency": 1.0,
                                        "step_overhead_ms": 0.0, "layer_overhead_us": 0.0})
    tp = int(profile.get("tensor_parallel", 1))
    model = catalog.get("models", profile["model"])
    cost = RooflineCost(ideal, model, int(profile.get("dtype_bytes", 2)), tp,
                        catalog.get("links", hardware.tensor_parallel_link))
    rows = []
    for point in profile_points(profile):
        features = point.features()
        rows.append((*cost.terms(point.prefill_tokens, features[2], point.decode_seqs, int(features[4])),
                     model.num_layers))
    return np.array(rows)


def predicted(terms: np.ndarray, compute: float, memory: float | np.ndarray, layer_overhead_s: float) -> np.ndarray:
    """The forward pass as the roofline prices it (no serving overhead: a profile times the forward pass alone);
    `memory` may be a column of efficiencies, for a row of prices per efficiency."""
    return (terms[:, 4] * layer_overhead_s + np.maximum(terms[:, 0] / compute, terms[:, 1] / memory)
            + np.maximum(terms[:, 2] / compute, terms[:, 3] / memory))


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Per row of `values`: the value minimising sum(weights * |values - m|)."""
    order = np.argsort(values, axis=-1)
    ranked = np.take_along_axis(values, order, axis=-1)
    cumulative = np.cumsum(np.take_along_axis(weights, order, axis=-1), axis=-1)
    half = cumulative[..., -1:] / 2
    return np.take_along_axis(ranked, np.argmax(cumulative >= half, axis=-1)[..., None], axis=-1)[..., 0]


def abs_errors_pct(measured: np.ndarray, prediction: np.ndarray) -> np.ndarray:
    return np.abs(prediction - measured) / measured * 100


def _summary(errors: np.ndarray) -> dict[str, float]:
    return {"median": float(np.median(errors)), "mean": float(errors.mean()), "max": float(errors.max())}


def fit_efficiency(profiles: list[dict[str, Any]], hardware_name: str,
                   catalog: Catalog | None = None) -> dict[str, Any]:
    """Compute and memory efficiency on `GRID` and a per-layer overhead (>= 0) that minimise the mean absolute
    relative error of the roofline's forward pass over every profile's points together. For each pair of
    efficiencies the best overhead is a weighted median: of what the roofline leaves unexplained per layer, with
    weights layers / measured time."""
    catalog = catalog or load_catalog()
    hardware = catalog.get("hardware", hardware_name)
    if not profiles:
        raise ValueError("fit_efficiency needs at least one GPU profile")
    each = [(roofline_terms(p, hardware, catalog), np.array([point.step_s for point in profile_points(p)]))
            for p in profiles]
    terms = np.concatenate([profile_terms for profile_terms, _ in each])
    measured = np.concatenate([times for _, times in each])
    layers = terms[:, 4]
    weights = np.broadcast_to(layers / measured, (len(GRID), len(measured)))
    best: tuple[float, float, float, float] | None = None
    for compute in GRID:
        rooflines = predicted(terms, compute, GRID[:, None], 0.0)  # rows: the memory efficiencies; columns: points
        per_layer = np.maximum(_weighted_median((measured - rooflines) / layers, weights), 0)
        mean_errors = np.mean(np.abs(rooflines + per_layer[:, None] * layers - measured) / measured, axis=1)
        i = int(np.argmin(mean_errors))
        if best is None or mean_errors[i] < best[0]:
            best = (float(mean_errors[i]), float(compute), float(GRID[i]), float(per_layer[i]))
    assert best is not None
    _, compute, memory, per_layer_s = best

    def errors(profile_terms: np.ndarray, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return (abs_errors_pct(times, predicted(profile_terms, compute, memory, per_layer_s)),
                abs_errors_pct(times, predicted(profile_terms, hardware.compute_efficiency,
                                                hardware.memory_efficiency, per_layer_s)))

    per_profile = []
    for profile, (profile_terms, times) in zip(profiles, each, strict=True):
        fitted_errors, catalog_errors = errors(profile_terms, times)
        per_profile.append({"model": profile["model"], "tensor_parallel": int(profile.get("tensor_parallel", 1)),
                            "points": len(times), "error_pct": _summary(fitted_errors),
                            "catalog_error_pct": _summary(catalog_errors)})
    fitted_errors, catalog_errors = errors(terms, measured)
    return {"hardware": hardware_name, "compute_efficiency": compute, "memory_efficiency": memory,
            "layer_overhead_us": per_layer_s * 1e6,
            "achieved_tflops": hardware.peak_bf16_tflops * compute, "achieved_hbm_gbps": hardware.hbm_gbps * memory,
            "error_pct": _summary(fitted_errors),
            "catalog_before": {"compute_efficiency": hardware.compute_efficiency,
                               "memory_efficiency": hardware.memory_efficiency,
                               "error_pct": _summary(catalog_errors),
                               "note": "the catalog's efficiencies with the fitted per-layer overhead"},
            "profiles": per_profile}


def load_profiles(paths: list[Path]) -> list[dict[str, Any]]:
    """GPU profiles from JSON files; a CPU one (or anything else) is refused by name."""
    profiles = []
    for path in paths:
        profile = json.loads(Path(path).read_text())
        if profile.get("kind") != "fitted" or profile.get("gpu") in (None, "cpu") or not profile.get("points"):
            raise ValueError(f"{path}: not a GPU profile from pdlab.benchmarks.gpu_phases (kind 'fitted', a GPU, "
                             "measured points)")
        profiles.append(profile)
    return profiles
