"""pdlab.benchmarks.phases: exact FLOP/byte formulas on a hand-worked shape, the shape of the real local model, and the
measurements' structure (no timing assertions: timings are only checked to be positive and finite)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from pdlab.benchmarks import phases
from pdlab.model.catalog import load_catalog
from pdlab.model.shape import ModelShape, shape_of_dir

# A shape small enough to work out by hand: hidden 8, 2 layers, 2 query heads and 1 KV head of 4 dims, MLP 16,
# vocabulary 10, float32.
SMALL = ModelShape(hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16,
                   vocab_size=10, dtype_bytes=4)


def test_layer_params_and_bytes_by_hand() -> None:
    # q 8x8 + k,v 2 x 8x4 + o 8x8 + MLP 3 x 8x16
    assert SMALL.layer_params == 64 + 64 + 64 + 384
    # (2 layers x (576 + two norms of 8) + final norm 8 + LM head 8x10) x 4 bytes
    assert SMALL.weight_bytes == (2 * (576 + 16) + 8 + 80) * 4 == 5088
    # K and V, 2 layers, 1 head x 4 dims, 4 bytes
    assert SMALL.kv_bytes_per_token() == 2 * 2 * 4 * 4 == 64


def test_attention_flops_are_causal() -> None:
    # 3 new tokens on an empty cache attend to 1 + 2 + 3 = 6 keys; each key costs 4 x q_dim (8) per layer (2).
    assert SMALL.attention_flops(3, 0) == 2 * 4 * 8 * 6 == 384
    # 1 new token after 5 cached attends to 6 keys.
    assert SMALL.attention_flops(1, 5) == 384
    # 2 new tokens after 5 cached: 6 + 7 keys.
    assert SMALL.attention_flops(2, 5) == 2 * 4 * 8 * 13


def test_prefill_flops_and_bytes_by_hand() -> None:
    # matrices for 3 tokens + attention + LM head for the last token only
    assert SMALL.prefill_flops(3) == 2 * 3 * 2 * 576 + 384 + 2 * 8 * 10 == 7456
    # weights + 3 embedding rows + KV written for 3 tokens
    assert SMALL.prefill_bytes(3) == 5088 + 3 * 8 * 4 + 3 * 64 == 5376
    assert SMALL.prefill_intensity(3) == pytest.approx(7456 / 5376)


def test_decode_flops_and_bytes_by_hand() -> None:
    per_sequence = 2 * 2 * 576 + 384 + 2 * 8 * 10
    assert SMALL.decode_flops(2, 5) == 2 * per_sequence == 5696
    # weights once + per sequence: its embedding row, 6 tokens of KV (5 read, 1 written)
    assert SMALL.decode_bytes(2, 5) == 5088 + 2 * (8 * 4 + 6 * 64) == 5920
    assert SMALL.decode_intensity(2, 5) == pytest.approx(5696 / 5920)


def test_decode_intensity_grows_with_batch_and_prefill_dwarfs_decode() -> None:
    assert SMALL.decode_intensity(1, 64) < SMALL.decode_intensity(8, 64) < SMALL.decode_intensity(64, 64)
    assert SMALL.prefill_intensity(1024) > 10 * SMALL.decode_intensity(1, 1024)


def test_with_dtype_halves_bytes_not_flops() -> None:
    bf16 = SMALL.with_dtype(2)
    assert bf16.weight_bytes * 2 == SMALL.weight_bytes
    assert bf16.decode_flops(4, 100) == SMALL.decode_flops(4, 100)


def test_from_config_reads_llama_names_and_defaults_head_dim() -> None:
    config = SimpleNamespace(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             intermediate_size=16, vocab_size=10)
    assert ModelShape.from_config(config) == SMALL


@pytest.fixture(scope="module")
def tiny():
    return phases.load_model("pdlab-tiny")


def test_shape_matches_the_real_models_parameter_count(tiny) -> None:
    shape = phases.shape_of(tiny)
    params = sum(p.numel() for p in tiny.parameters())
    # every parameter is counted in weight_bytes except the embedding table (read only row by row)
    assert shape.weight_bytes // shape.dtype_bytes + shape.vocab_size * shape.hidden_size == params
    assert shape.dtype_bytes == 4


def test_shape_of_dir_reads_config_json_like_the_loaded_model(tiny) -> None:
    from pdlab import model as local_models

    assert shape_of_dir(local_models.resolve("pdlab-tiny")) == phases.shape_of(tiny)


def test_measure_prefill_records_each_length(tiny) -> None:
    shape = phases.shape_of(tiny)
    samples = phases.measure_prefill(tiny, [1, 8, 32], repeats=1)
    assert [s.tokens for s in samples] == [1, 8, 32]
    for s in samples:
        assert 0 < s.seconds < math.inf and s.tokens_per_s > 0
        assert (s.flops, s.bytes) == (shape.prefill_flops(s.tokens), shape.prefill_bytes(s.tokens))
    rows = phases.records(samples)
    assert set(rows[0]) >= {"tokens", "seconds", "flops", "bytes", "tokens_per_s", "flops_per_s", "intensity"}


def test_measure_decode_covers_the_grid(tiny) -> None:
    shape = phases.shape_of(tiny)
    samples = phases.measure_decode(tiny, batches=[1, 3], contexts=[4, 16], repeats=2)
    assert sorted((s.batch, s.context) for s in samples) == [(1, 4), (1, 16), (3, 4), (3, 16)]
    for s in samples:
        assert 0 < s.seconds < math.inf
        assert s.tokens_per_s == pytest.approx(s.batch / s.seconds)
        assert (s.flops, s.bytes) == (shape.decode_flops(s.batch, s.context), shape.decode_bytes(s.batch, s.context))


@pytest.mark.parametrize(("batches", "contexts"), [([0], [4]), ([1], [0])])
def test_measure_decode_rejects_empty_sizes(tiny, batches, contexts) -> None:
    with pytest.raises(ValueError, match="batch and context"):
        phases.measure_decode(tiny, batches, contexts, repeats=1)


def test_measure_prefill_rejects_empty_prompt(tiny) -> None:
    with pytest.raises(ValueError, match="lengths"):
        phases.measure_prefill(tiny, [0], repeats=1)


def test_single_thread_restores_the_thread_count() -> None:
    import torch

    before = torch.get_num_threads()
    with phases.single_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_cpu_peaks_are_positive() -> None:
    peaks = phases.measure_cpu_peaks(matmul_size=64, copy_mib=8, repeats=1)
    assert peaks.flops_per_s > 0 and peaks.bytes_per_s > 0
    assert peaks.copy_bytes == 2 * 8 * 2**20
    assert peaks.ridge_point == pytest.approx(peaks.flops_per_s / peaks.bytes_per_s)


def test_the_roofline_gpus_come_from_the_catalog_with_their_sources() -> None:
    gpus = load_catalog().hardware
    h100, h200 = gpus["H100-SXM5-80GB"], gpus["H200-SXM-141GB"]
    assert h100.ridge_point == pytest.approx(989e12 / 3350e9)
    assert h200.hbm_gbps > h100.hbm_gbps and h200.peak_bf16_tflops == h100.peak_bf16_tflops
    assert all("https://" in gpu.source for gpu in gpus.values())


def test_roofline_draws_each_roof_and_the_samples() -> None:
    cpu = phases.CpuPeaks(flops_per_s=1e11, bytes_per_s=1e10, matmul_size=1, copy_bytes=1)
    prefill = [phases.PrefillSample(tokens=64, seconds=0.01, flops=10**9, bytes=10**7)]
    decode = [phases.DecodeSample(batch=1, context=64, seconds=0.001, flops=10**6, bytes=2 * 10**6)]
    devices = load_catalog().hardware
    fig = phases.roofline_figure(cpu, prefill, decode, devices=devices)
    assert len(fig.data) == 1 + len(devices) + 2
    cpu_roof = fig.data[0]
    for x, y in zip(cpu_roof.x, cpu_roof.y, strict=True):
        assert y == pytest.approx(min(1e11, x * 1e10))
    assert list(fig.data[-2].x) == [100.0] and list(fig.data[-1].x) == [0.5]
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"


def test_prefill_and_decode_figures_have_one_trace_per_series() -> None:
    prefill = [phases.PrefillSample(t, 0.001 * t, 1, 1) for t in (1, 2, 4)]
    decode = [phases.DecodeSample(b, c, 0.001, 1, 1) for b in (1, 2) for c in (8, 16)]
    assert len(phases.prefill_figure(prefill).data) == 2
    figure = phases.decode_figure(decode)
    assert len(figure.data) == 4  # time and throughput, per context
    # a context keeps its colour in both panels, so the one legend reads for both
    assert figure.data[0].line.color == figure.data[1].line.color != figure.data[2].line.color


def test_bench_phases_writes_a_record_with_its_environment(tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from pdlab.cli import app

    result = CliRunner().invoke(app, ["bench", "phases", "--model", "pdlab-tiny", "--lengths", "4,8",
                                      "--batches", "1,2", "--contexts", "4", "--repeats", "1",
                                      "--out-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    [written] = list(tmp_path.glob("phases-pdlab-tiny-*.json"))
    record = json.loads(written.read_text())
    assert [row["tokens"] for row in record["prefill"]] == [4, 8]
    assert [(row["batch"], row["context"]) for row in record["decode"]] == [(1, 4), (2, 4)]
    assert record["cpu_peaks"]["flops_per_s"] > 0 and record["environment"]["packages"]["torch"]


def test_bench_phases_names_a_bad_option(tmp_path) -> None:
    from typer.testing import CliRunner

    from pdlab.cli import app

    result = CliRunner().invoke(app, ["bench", "phases", "--lengths", "4,x", "--out-dir", str(tmp_path)])
    assert result.exit_code != 0 and "--lengths" in result.output
