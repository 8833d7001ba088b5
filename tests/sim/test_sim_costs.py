"""Catalog figures load with their sources; fitting recovers known costs; the calibration benchmark runs."""

from __future__ import annotations

import json

import pytest
import yaml

from pdlab.config.base import ConfigError
from pdlab.config.sim import SimSpec
from pdlab.model.catalog import load_catalog
from pdlab.sim.costs import (
    CalibrationPoint,
    FittedCost,
    chunk_attention,
    fit_coefficients,
    fit_profile,
    load_profile,
)


def test_catalog_has_the_required_entries_each_with_a_source() -> None:
    catalog = load_catalog()
    for name in ("A100-SXM4-80GB", "H100-SXM5-80GB", "H200-SXM-141GB", "L40S"):
        assert name in catalog.hardware
    for name in ("Llama-3.1-8B", "Llama-3.1-70B", "Qwen2.5-7B", "pdlab-small", "pdlab-tiny"):
        assert name in catalog.models
    for name in ("efa-p4d", "efa-p5", "efa-p5en", "nvlink4", "infiniband-ndr", "tcp-10gbe", "tcp-100gbe"):
        assert name in catalog.links
    for table in (catalog.hardware, catalog.models, catalog.links):
        for entry in table.values():
            assert entry.source.strip()
            assert set(entry.assumed) <= set(type(entry).model_fields)


def test_every_accelerator_names_the_link_its_tensor_parallel_gpus_share(tmp_path) -> None:
    import shutil

    from pdlab.model.catalog import catalog_dir

    catalog = load_catalog()
    assert {hw.tensor_parallel_link for hw in catalog.hardware.values()} <= set(catalog.links)
    assert catalog.hardware["L40S"].tensor_parallel_link == "pcie4-x16"  # no NVLink on the L40S
    for name in ("hardware", "models", "links"):
        shutil.copy(catalog_dir() / f"{name}.yaml", tmp_path / f"{name}.yaml")
    hardware = (tmp_path / "hardware.yaml").read_text()
    (tmp_path / "hardware.yaml").write_text(hardware.replace("tensor_parallel_link: pcie4-x16",
                                                             "tensor_parallel_link: pcie9"))
    with pytest.raises(ConfigError, match=r"hardware\.L40S\.tensor_parallel_link.*pcie9"):
        load_catalog(tmp_path)


def test_a_catalog_shape_without_its_source_is_refused(tmp_path) -> None:
    from pdlab.model.catalog import catalog_dir

    for name in ("hardware", "models", "links"):
        (tmp_path / f"{name}.yaml").write_text((catalog_dir() / f"{name}.yaml").read_text())
    models = yaml.safe_load((tmp_path / "models.yaml").read_text())
    del models["Llama-3.1-8B"]["source"]
    (tmp_path / "models.yaml").write_text(yaml.safe_dump(models))
    with pytest.raises(ConfigError, match=r"models\.Llama-3\.1-8B\.source"):
        load_catalog(tmp_path)


def test_model_shapes_give_the_known_sizes() -> None:
    models = load_catalog().models
    assert models["Llama-3.1-8B"].params == pytest.approx(8.03e9, rel=0.01)
    assert models["Llama-3.1-70B"].params == pytest.approx(70.6e9, rel=0.01)
    # 2 (K and V) x 80 layers x 8 KV heads x 128 x 2 bytes = 320 KiB per token
    assert models["Llama-3.1-70B"].kv_bytes_per_token(2) == 327_680


def test_unknown_catalog_names_are_errors_that_list_the_choices() -> None:
    from pdlab.sim.scenario import prepare

    spec = SimSpec.model_validate({"hardware": "B300", "workload": {"poisson": {"rate_rps": 1, "num_requests": 1}}})
    with pytest.raises(ConfigError, match="H200-SXM-141GB"):
        prepare(spec)


def test_spec_errors_name_the_field() -> None:
    from pdlab.config.base import validate

    with pytest.raises(ConfigError, match="pools"):
        validate(SimSpec, {"pools": {"prefill": 1}, "workload": {"poisson": {"rate_rps": 1, "num_requests": 1}}})
    with pytest.raises(ConfigError, match="workload"):
        validate(SimSpec, {"workload": {}})
    with pytest.raises(ConfigError, match="router.threshold"):
        validate(SimSpec, {"router": {"threshold": -1}, "workload": {"poisson": {"rate_rps": 1, "num_requests": 1}}})


def grid_points(cost: FittedCost) -> list[CalibrationPoint]:
    points = []
    for n in (64, 256, 1024, 4096):
        points.append(CalibrationPoint(n, 0, 0, 0, 0.0))
    points.append(CalibrationPoint(512, 2048, 0, 0, 0.0))
    for b in (1, 4, 16):
        for c in (128, 2048):
            points.append(CalibrationPoint(0, 0, b, c, 0.0))
    return [CalibrationPoint(p.prefill_tokens, p.prefill_context, p.decode_seqs, p.decode_context,
                             cost.step_time(*p.features()[1:])) for p in points]


def test_fit_recovers_known_coefficients() -> None:
    # the grid's one chunk after cached context (512 after 2,048) tells fresh attention pairs from cached ones
    truth = FittedCost((0.004, 4e-4, 3e-8, 1e-3, 2e-7, 2e-8))
    fitted = fit_coefficients(grid_points(truth))
    assert fitted == pytest.approx(truth.coefficients, rel=1e-6)


def test_only_a_chunk_that_starts_its_prompt_has_fresh_attention() -> None:
    whole, later = CalibrationPoint(512, 0, 0, 0, 0.1), CalibrationPoint(512, 2048, 0, 0, 0.1)
    assert whole.features()[5] == whole.features()[2] == 512 * 256
    assert later.features()[5] == 0 and later.features()[2] == 512 * (2048 + 256)
    cost = FittedCost((0.0, 0.0, 1e-9, 0.0, 0.0, 1e-9))
    assert cost.step_time(*whole.features()[1:]) == pytest.approx(2 * 1e-9 * 512 * 256)


def test_a_profile_from_before_fresh_attention_prices_every_pair_alike(tmp_path) -> None:
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"kind": "fitted", "features": ["constant", "prefill_tokens", "prefill_attention",
                                                                "decode_seqs", "decode_context"],
                                "coefficients": [0.01, 1e-4, 1e-8, 1e-3, 1e-6]}))
    cost, _ = load_profile(path)
    assert cost.coefficients == (0.01, 1e-4, 1e-8, 1e-3, 1e-6, 0.0, 0.0)
    with pytest.raises(ValueError, match="5 to 7 coefficients"):
        FittedCost((0.01, 1e-4, 1e-8, 1e-3))


BASE = ["constant", "prefill_tokens", "prefill_attention", "decode_seqs", "decode_context"]


def test_a_profile_names_its_premium_and_is_read_by_name(tmp_path) -> None:
    path = tmp_path / "square.json"
    path.write_text(json.dumps({"kind": "fitted", "features": [*BASE, "chunk_square"],
                                "coefficients": [0.01, 1e-4, 1e-8, 1e-3, 1e-6, 2e-8]}))
    cost, _ = load_profile(path)
    assert cost.coefficients == (0.01, 1e-4, 1e-8, 1e-3, 1e-6, 0.0, 2e-8)
    # a chunk of 100 after 50 cached tokens: 100 x 100 / 2 squares, whether or not it starts its prompt
    assert cost.step_time(100, chunk_attention(100, 50), 0, 0, 0.0, 5000.0) == pytest.approx(
        0.01 + 1e-2 + 1e-8 * 10_000 + 2e-8 * 5000)


@pytest.mark.parametrize("features, message", [
    ([*BASE, "fresh_attention", "chunk_square"], "at most one of fresh_attention, chunk_square"),
    ([*BASE, "chunk_cube"], "prices constant, prefill_tokens"),
    (BASE[:4], "prices constant, prefill_tokens"),
])
def test_a_profile_with_features_it_cannot_price_is_refused_naming_them(tmp_path, features, message) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"kind": "fitted", "features": features, "coefficients": [0.0] * len(features)}))
    with pytest.raises(ValueError, match=message) as refused:
        load_profile(path)
    assert str(path) in str(refused.value)


def test_fit_never_returns_negative_costs(tmp_path) -> None:
    points = grid_points(FittedCost((0.004, 4e-4, 0.0, 1e-3, 0.0)))
    noisy = [CalibrationPoint(p.prefill_tokens, p.prefill_context, p.decode_seqs, p.decode_context,
                              p.step_s * (1.07 if i % 2 else 0.94)) for i, p in enumerate(points)]
    profile = fit_profile(noisy, model="pdlab-tiny", source="synthetic")
    assert all(c >= 0 for c in profile["coefficients"])
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    cost, loaded = load_profile(path)
    assert profile["features"] == [*BASE, "fresh_attention"]  # the torch grid's premium
    assert cost.coefficients == (*profile["coefficients"], 0.0) and loaded["model"] == "pdlab-tiny"
    path.write_text(json.dumps({"kind": "roofline"}))
    with pytest.raises(ValueError, match="fitted"):
        load_profile(path)


def test_calibration_measures_the_tiny_model_and_fits_it() -> None:
    from pdlab.calibration.calibrate import CalibrationGrid, calibrate

    grid = CalibrationGrid(prefill_tokens=(32, 256), chunks=((64, 128),), decode_batches=(1, 2),
                           decode_contexts=(32, 256), repeats=1)
    profile = calibrate("pdlab-tiny", grid)
    assert len(profile["points"]) == 2 + 1 + 4
    assert all(p["step_s"] > 0 for p in profile["points"])
    cost = FittedCost(tuple(profile["coefficients"]))
    # more prompt costs more time: the fit must say so, as the measurements do
    assert cost.step_time(256, 256 * 128, 0, 0) > cost.step_time(32, 32 * 16, 0, 0)
    assert profile["environment"]["python"] and profile["dtype_bytes"] == 4


def test_without_a_chunk_after_cached_context_every_pair_gets_one_price() -> None:
    truth = FittedCost((0.004, 4e-4, 3e-8, 1e-3, 2e-7))
    whole_prompts = [p for p in grid_points(truth) if p.prefill_context == 0]
    fitted = fit_coefficients(whole_prompts)
    assert fitted[5] == 0 and fitted == pytest.approx(truth.coefficients, rel=1e-6)
