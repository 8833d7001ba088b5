"""Why prefill and decode are different workloads, measured: prefill time against prompt length and decode step
time against batch and context, with torch on the local model, this CPU's single-thread roof, and the three drawn on
a roofline (`pdlab bench phases`, notebook 01).

Prefill pushes a whole prompt through every weight matrix at once: many FLOPs per byte of weights read, so it is
bound by compute. A decode step pushes one token per sequence through the same weights and reads the whole KV cache
of its sequence: few FLOPs per byte, so it is bound by memory bandwidth until the batch is large. Everything here
runs on one thread, like one vLLM CPU instance pinned to one core. The FLOPs and bytes of each sample come from the
model's shape (`pdlab.model.shape`, where the counting conventions are).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import plotly.colors
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from pdlab import model as local_models
from pdlab.model.catalog import Hardware
from pdlab.model.shape import DTYPE_BYTES, ModelShape

if TYPE_CHECKING:
    import torch
    from transformers import LlamaForCausalLM

class _Rates:
    """What every timed sample derives from its `seconds`, `flops` and `bytes`."""

    seconds: float
    flops: int
    bytes: int

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


@dataclass(frozen=True)
class PrefillSample(_Rates):
    """One measured prefill: a single prompt of `tokens` tokens."""

    tokens: int
    seconds: float
    """Median wall time of the forward pass."""
    flops: int
    bytes: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass(frozen=True)
class DecodeSample(_Rates):
    """One measured decode step: `batch` sequences at `context` cached tokens each, one new token each."""

    batch: int
    context: int
    seconds: float
    """Median wall time of one step."""
    flops: int
    bytes: int

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.seconds


@dataclass(frozen=True)
class CpuPeaks:
    """This machine's single-thread peaks, measured: the roof of its roofline."""

    flops_per_s: float
    """Best of a few float32 matrix multiplications."""
    bytes_per_s: float
    """Best of a few copies of an array larger than the caches (read + write counted)."""
    matmul_size: int
    copy_bytes: int

    @property
    def ridge_point(self) -> float:
        return self.flops_per_s / self.bytes_per_s


def records(samples: Sequence[PrefillSample | DecodeSample]) -> list[dict[str, Any]]:
    """Plain rows (fields plus the derived rates) for a pandas DataFrame."""
    rows = []
    for sample in samples:
        row = asdict(sample)
        row.update(tokens_per_s=sample.tokens_per_s, flops_per_s=sample.flops_per_s, intensity=sample.intensity)
        rows.append(row)
    return rows


@contextmanager
def single_thread() -> Iterator[None]:
    """Run torch on one thread (as one vLLM CPU instance on one core), restoring the previous setting after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def load_model(name: str = "pdlab-tiny") -> LlamaForCausalLM:
    """The local model `name` (a catalog name, made if missing, or a model directory) in float32, eval mode."""
    import torch
    from transformers import LlamaForCausalLM

    path = local_models.resolve(name)
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def shape_of(model: LlamaForCausalLM) -> ModelShape:
    return ModelShape.from_config(model.config, dtype_bytes=DTYPE_BYTES[str(model.dtype).removeprefix("torch.")])


def _token_ids(model: LlamaForCausalLM, batch: int, tokens: int, seed: int) -> torch.Tensor:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, model.config.vocab_size, (batch, tokens), generator=generator)


def _fastest_seconds(run: Any, repeats: int) -> float:
    """The fastest of `repeats` timed runs: other processes on a shared machine only ever add time, so the minimum
    is the best estimate of what the step itself costs (the median drifts with whatever else is busy)."""
    return min(_repeat_times(run, repeats))


def measure_prefill(model: LlamaForCausalLM, lengths: Sequence[int], repeats: int = 3, seed: int = 0
                    ) -> list[PrefillSample]:
    """Time one prefill of each prompt length (random token ids, fresh KV cache, logits for the last token)."""
    import torch
    from transformers import DynamicCache

    shape = shape_of(model)
    samples = []
    with single_thread(), torch.inference_mode():
        for tokens in lengths:
            if tokens < 1:
                raise ValueError(f"lengths: a prompt needs at least 1 token, got {tokens}")
            ids = _token_ids(model, 1, tokens, seed)

            def run(ids: torch.Tensor = ids) -> None:
                model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True,
                      logits_to_keep=1)

            seconds = _fastest_seconds(run, repeats)
            samples.append(PrefillSample(tokens, seconds, shape.prefill_flops(tokens), shape.prefill_bytes(tokens)))
    return samples


def measure_decode(model: LlamaForCausalLM, batches: Sequence[int], contexts: Sequence[int], repeats: int = 5,
                   seed: int = 0) -> list[DecodeSample]:
    """Time one decode step for each (batch, context): fill a KV cache with `context` tokens, copy it to `batch`
    sequences, then time steps of one new token per sequence, cropping the cache back after each step so every step
    sees the same context. (The copies hold the same keys and values, which costs a step the same as distinct ones:
    what decode pays for is reading them.)"""
    import torch
    from transformers import DynamicCache

    shape = shape_of(model)
    samples = []
    with single_thread(), torch.inference_mode():
        for context in contexts:
            if context < 1:
                raise ValueError(f"batch and context must be >= 1, got context={context}")
            # One prefill per context, not per batch: a batched prefill of long contexts would dominate the run.
            filled = DynamicCache(config=model.config)
            model(input_ids=_token_ids(model, 1, context, seed), past_key_values=filled, use_cache=True,
                  logits_to_keep=1)
            for batch in batches:
                if batch < 1:
                    raise ValueError(f"batch and context must be >= 1, got batch={batch}")
                cache = copy.deepcopy(filled)
                cache.batch_repeat_interleave(batch)
                step_ids = _token_ids(model, batch, 1, seed + 1)
                positions = torch.full((batch, 1), context, dtype=torch.long)

                def step(cache: DynamicCache = cache, ids: torch.Tensor = step_ids,
                         positions: torch.Tensor = positions) -> None:
                    model(input_ids=ids, past_key_values=cache, position_ids=positions, use_cache=True)
                    cache.crop(-1)  # drop the token just added: every timed step sees `context` cached tokens

                seconds = _fastest_seconds(step, repeats)
                ended = (cache.get_seq_length(), cache.layers[0].keys.shape[0])
                if ended != (context, batch):  # the timing would be of another shape than the one recorded
                    raise RuntimeError(f"decode cache ended at {ended[0]} tokens x {ended[1]} sequences, "
                                       f"expected {context} x {batch}")
                samples.append(DecodeSample(batch, context, seconds, shape.decode_flops(batch, context),
                                            shape.decode_bytes(batch, context)))
    return samples


def measure_cpu_peaks(matmul_size: int = 512, copy_mib: int = 256, repeats: int = 3) -> CpuPeaks:
    """This CPU's single-thread roof: float32 matmul FLOP/s and copy bandwidth (bytes read + written per second)."""
    import torch

    with single_thread(), torch.inference_mode():
        a = torch.rand(matmul_size, matmul_size)
        b = torch.rand(matmul_size, matmul_size)
        matmul_s = min(_repeat_times(lambda: torch.mm(a, b), repeats))
        source = torch.empty(copy_mib * 2**20 // 4, dtype=torch.float32).fill_(1.0)
        target = torch.empty_like(source)
        copy_s = min(_repeat_times(lambda: target.copy_(source), repeats))
    copy_bytes = 2 * source.numel() * 4
    return CpuPeaks(flops_per_s=2 * matmul_size**3 / matmul_s, bytes_per_s=copy_bytes / copy_s,
                    matmul_size=matmul_size, copy_bytes=copy_bytes)


def _repeat_times(run: Any, repeats: int) -> list[float]:
    run()  # warm-up: first-call allocations and kernel selection are not what we want to time
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def roofline_figure(cpu: CpuPeaks, prefill: Sequence[PrefillSample], decode: Sequence[DecodeSample],
                    devices: Mapping[str, Hardware] | None = None) -> go.Figure:
    """Log-log roofline: attainable FLOP/s = min(peak, intensity x bandwidth) for this CPU (measured) and each
    device, by name (the catalog's published bf16 peaks), with the measured prefill and decode samples placed at
    their intensity."""
    intensities = [s.intensity for s in (*prefill, *decode)] or [1.0]
    x_min = min(0.1, min(intensities) / 2)
    x_max = max(1e4, max(intensities) * 2)
    xs = [x_min * (x_max / x_min) ** (i / 200) for i in range(201)]
    fig = go.Figure()
    roofs = [(f"this CPU, 1 thread (measured, fp32): ridge {cpu.ridge_point:.1f} FLOP/B", cpu.flops_per_s,
              cpu.bytes_per_s, "solid")]
    roofs += [(f"{name} (bf16, datasheet): ridge {gpu.ridge_point:.0f} FLOP/B", gpu.peak_bf16_tflops * 1e12,
               gpu.hbm_gbps * 1e9, "dash") for name, gpu in (devices or {}).items()]
    for label, peak, bandwidth, dash in roofs:
        fig.add_scatter(x=xs, y=[min(peak, x * bandwidth) for x in xs], mode="lines", name=label,
                        line={"dash": dash})
    if prefill:
        fig.add_scatter(x=[s.intensity for s in prefill], y=[s.flops_per_s for s in prefill], mode="markers",
                        name="prefill (measured)", marker={"symbol": "circle", "size": 9},
                        text=[f"prefill {s.tokens} tokens" for s in prefill])
    if decode:
        fig.add_scatter(x=[s.intensity for s in decode], y=[s.flops_per_s for s in decode], mode="markers",
                        name="decode step (measured)", marker={"symbol": "diamond", "size": 9},
                        text=[f"decode batch {s.batch}, context {s.context}" for s in decode])
    fig.update_xaxes(type="log", title="arithmetic intensity (FLOP / byte)")
    fig.update_yaxes(type="log", title="FLOP/s")
    fig.update_layout(title="Roofline: prefill is compute-bound, decode is memory-bound", legend={"font": {"size": 10}})
    return fig


def prefill_figure(samples: Sequence[PrefillSample]) -> go.Figure:
    """Prefill time and throughput (tokens/s) against prompt length."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("time of one prefill", "prefill throughput"))
    tokens = [s.tokens for s in samples]
    fig.add_scatter(x=tokens, y=[s.seconds * 1e3 for s in samples], mode="lines+markers", name="time", row=1, col=1)
    fig.add_scatter(x=tokens, y=[s.tokens_per_s for s in samples], mode="lines+markers", name="tokens/s", row=1,
                    col=2)
    fig.update_xaxes(title="prompt tokens", type="log")
    fig.update_yaxes(title="ms", row=1, col=1)
    fig.update_yaxes(title="prompt tokens / s", row=1, col=2)
    fig.update_layout(title="Prefill: longer prompts use the hardware better (until attention's n^2 grows)",
                      showlegend=False)
    return fig


def decode_figure(samples: Sequence[DecodeSample]) -> go.Figure:
    """Decode step time and generated tokens/s against batch size, one line per context length."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("time of one decode step", "decode throughput"))
    palette = plotly.colors.qualitative.Plotly
    for i, context in enumerate(sorted({s.context for s in samples})):
        rows = sorted((s for s in samples if s.context == context), key=lambda s: s.batch)
        batches = [s.batch for s in rows]
        style = {"mode": "lines+markers", "name": f"context {context}", "legendgroup": str(context),
                 "line": {"color": palette[i % len(palette)]}}
        fig.add_scatter(x=batches, y=[s.seconds * 1e3 for s in rows], row=1, col=1, **style)
        fig.add_scatter(x=batches, y=[s.tokens_per_s for s in rows], showlegend=False, row=1, col=2, **style)
    fig.update_xaxes(title="batch (sequences decoded together)", type="log")
    fig.update_yaxes(title="ms", row=1, col=1)
    fig.update_yaxes(title="generated tokens / s", row=1, col=2)
    fig.update_layout(title="Decode: batching is nearly free while weight reads dominate; "
                            "at long contexts the KV cache reads take over")
    return fig


def benchmark(name: str, lengths: Sequence[int], batches: Sequence[int], contexts: Sequence[int],
              repeats: int = 5) -> dict[str, Any]:
    """Measure prefill, decode and this CPU's roof for model `name`; a JSON-ready record with the environment
    (and the load average, since other processes on the same cores change the numbers)."""
    import os

    from pdlab import environment

    model = load_model(name)
    shape = shape_of(model)
    load_before = os.getloadavg()
    prefill = measure_prefill(model, lengths, repeats=repeats)
    decode = measure_decode(model, batches, contexts, repeats=repeats)
    cpu = measure_cpu_peaks()
    return {
        "benchmark": "phases",
        "model": name,
        "shape": shape.model_dump(include={"hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                                           "intermediate_size", "vocab_size", "dtype_bytes"}),
        "threads": 1,
        "repeats": repeats,
        "prefill": records(prefill),
        "decode": records(decode),
        "cpu_peaks": {**asdict(cpu), "ridge_point": cpu.ridge_point},
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "environment": environment.capture(),
    }
