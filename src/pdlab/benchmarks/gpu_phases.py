"""GPU phase costs: measure, with torch on one GPU, prefill time vs prompt tokens and decode step time vs
batch x context for Llama-shaped layers (random bf16 weights), and fit a simulator cost profile from them.

Its CPU mode (`--device cpu --quick`, a few seconds with pdlab-small) runs the same code path in the test suite.
The profiles it recorded on an H200 are under data/results/gpu/ (docs/dev/simulator-calibration.md, "GPU cost
profiles").

    python -m pdlab.benchmarks.gpu_phases --model Llama-3.1-8B --layers 4 --repeats 10   # 6-12 s on an H200
    python -m pdlab.benchmarks.gpu_phases --model Llama-3.1-70B --tensor-parallel 2 --layers 4 --repeats 10 --record
    python -m pdlab.benchmarks.gpu_phases --model pdlab-small --device cpu --quick --out /tmp/check.json

It is a module run with `python -m` rather than a `pdlab bench` command because a GPU box needs, besides torch,
pdlab's light dependencies only: pydantic, pyyaml, numpy and psutil (`PYTHONPATH=src` from a checkout is
enough). On a GPU box without internet, bring pydantic, pydantic-core, annotated-types, typing-inspection and
typing-extensions as wheels (`pip download` elsewhere, for the box's Python version) and install them with
`pip install --no-index`.

It builds `--layers` decoder layers of the catalog model's shape (divided by `--tensor-parallel`, as one GPU's
shard would be), times them with CUDA events (the wall clock on a CPU), scales the per-layer time to the model's
depth and adds a measured LM-head matmul. A step of up to `GRAPH_MAX_TOKENS` tokens (every decode batch of the
grid, and short prefills) is replayed from a CUDA graph, as vLLM replays the steps of its capture sizes (its eager
time, kernel launches included, is kept beside it as `eager`); longer steps run eager, where launch time is small
next to the work. No all-reduce is measured (one GPU; the simulator adds the shards' exchange to a profile of a
shard). The output, runs/bench/gpu/<model>-<gpu>-tp<N>.json (`--out` elsewhere; `--record` files it under
data/results/gpu/), holds the raw points, a fitted profile in pdlab's
format (usable as `profile:` in a sim spec), the held-out mixed steps and the environment.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from pdlab.benchmarks import results
from pdlab.environment import capture
from pdlab.model.catalog import load_catalog
from pdlab.model.shape import ModelShape
from pdlab.settings import runs_dir
from pdlab.sim.costs import CalibrationPoint, FittedCost, coefficients_by_name, fit_profile


@dataclass(frozen=True)
class Grid:
    """The points measured: whole-prompt prefills, prefill chunks after a cached prefix, decode batch x context."""

    prefill_tokens: tuple[int, ...]
    chunks: tuple[tuple[int, int], ...]
    """(chunk tokens, tokens already cached)."""
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    mixed: tuple[tuple[int, int, int, int], ...] = ()
    """Steps a chunked-prefill scheduler forms: (chunk tokens, tokens already cached, decoding sequences, their
    context). Held out of the fit: they check that the profile prices a mixed step from its parts."""


FULL = Grid((256, 512, 1024, 2048, 4096, 8192, 16384), ((2048, 4096), (2048, 12288)), (1, 8, 32, 128),
            (512, 2048, 8192), ((2048, 0, 32, 2048), (2048, 4096, 128, 2048), (512, 0, 128, 8192),
                                (8192, 0, 64, 2048)))
#: A few seconds on a CPU with pdlab-small: checks the code path, not a profile to keep.
QUICK = Grid((32, 64, 128, 256), ((64, 128),), (1, 4), (64, 256), ((64, 0, 2, 64),))


#: The largest step replayed from a CUDA graph: vLLM's largest capture size by default (512 tokens).
GRAPH_MAX_TOKENS = 512


class Layer(torch.nn.Module):
    """One Llama decoder layer's matmuls and attention, sharded `tp` ways (norms and rotary are negligible)."""

    def __init__(self, m: ModelShape, tp: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = m.num_heads // tp, max(m.num_kv_heads // tp, 1), m.head_dim
        self.qkv = torch.nn.Linear(m.hidden_size, (self.heads + 2 * self.kv_heads) * m.head_dim, bias=False)
        self.o = torch.nn.Linear(self.heads * m.head_dim, m.hidden_size, bias=False)
        self.gate_up = torch.nn.Linear(m.hidden_size, 2 * m.intermediate_size // tp, bias=False)
        self.down = torch.nn.Linear(m.intermediate_size // tp, m.hidden_size, bias=False)

    def attend(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, past: int) -> torch.Tensor:
        """Attention of `qkv`'s tokens (batch, new, ...) after `past` cached ones, their K and V written to the
        cache first; the output as (batch, new, heads x head_dim)."""
        b, n, _ = qkv.shape
        q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                             self.kv_heads * self.head_dim], dim=-1)
        q = q.reshape(b, n, self.heads, self.head_dim).transpose(1, 2)
        k_cache[:, :, past:past + n] = k.reshape(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v_cache[:, :, past:past + n] = v.reshape(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        keys, values = k_cache[:, :, :past + n], v_cache[:, :, :past + n]
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_mask(n, past),
                                              is_causal=n > 1 and past == 0, enable_gqa=True)
        return attn.transpose(1, 2).reshape(b, n, -1)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, past: int) -> torch.Tensor:
        return self.mlp(x + self.o(self.attend(self.qkv(x), k_cache, v_cache, past)))

    def forward_mixed(self, x: torch.Tensor, chunk_kv: tuple[torch.Tensor, torch.Tensor],
                      decode_kv: tuple[torch.Tensor, torch.Tensor], chunk: int, past: int, context: int
                      ) -> torch.Tensor:
        """One step of a prefill chunk (`chunk` tokens after `past` cached) and one token of each decoding
        sequence (after `context` each), as one batch: every matmul over all the tokens together, attention
        apart. `x` is (1, chunk + sequences, hidden)."""
        qkv = self.qkv(x)
        prefill = self.attend(qkv[:, :chunk], *chunk_kv, past)
        decode = self.attend(qkv[0, chunk:].unsqueeze(1), *decode_kv, context)
        return self.mlp(x + self.o(torch.cat([prefill, decode.transpose(0, 1)], dim=1)))


def causal_mask(new: int, past: int) -> object | None:
    """A chunk after `past` cached tokens: token i of the chunk sees the prefix and the chunk up to i (causal,
    aligned bottom-right, as vLLM's chunked prefill computes it). A whole prompt uses `is_causal`; a decode token
    sees everything."""
    return causal_lower_right(new, past + new) if new > 1 and past > 0 else None


def median_time(fn: Callable[[], None], repeats: int, device: torch.device) -> float:
    """Median seconds of `fn` after one warm-up run (kernel selection): CUDA events on a GPU, the wall clock on a
    CPU."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - began)
    return sorted(samples)[len(samples) // 2]


def graphed(step: Callable[[], None]) -> Callable[[], None]:
    """`step` captured once into a CUDA graph: its replay launches every kernel at once, as vLLM's decode does."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up off the capture: kernel selection and workspace allocation
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def warm_up(device: torch.device, seconds: float) -> None:
    """Bring an idle GPU to its working clock before timing: on a fresh machine, without it, the first points of
    several profiles came out up to 89% slower than the same points in a repeat."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def gpu_properties() -> dict[str, object]:
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "multiprocessors": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1), "capability": f"{props.major}.{props.minor}",
            "torch": torch.__version__, "cuda": torch.version.cuda}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Llama-3.1-8B")
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2, help="Layers actually built and timed.")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None,
                        help="Output JSON (default: runs/bench/gpu/<model>-<gpu>-tp<N>.json).")
    parser.add_argument("--record", action="store_true",
                        help="Also file the result under data/results/gpu/ (a new file, never overwriting one).")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: check the script itself (float32), with --quick and a small model.")
    parser.add_argument("--quick", action="store_true", help="A handful of small points instead of the full grid.")
    parser.add_argument("--warm-up-s", type=float, default=3.0, help="Seconds of matmuls before timing (GPU).")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="Time every step eagerly.")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("pdlab.benchmarks.gpu_phases needs a CUDA GPU (torch.cuda.is_available() is False); "
                         "`--device cpu --quick` checks the script without one")
    catalog = load_catalog().models
    if args.model not in catalog:
        raise SystemExit(f"--model {args.model!r} is not in the catalog; choose one of {', '.join(catalog)}")
    if args.tensor_parallel < 1 or args.layers < 1 or args.repeats < 1:
        raise SystemExit("--tensor-parallel, --layers and --repeats must be at least 1")
    tp, dev = args.tensor_parallel, torch.device(args.device)
    gpu = torch.cuda.get_device_name().replace(" ", "-") if dev.type == "cuda" else "cpu"
    out = args.out or results.new_path(runs_dir() / "bench" / "gpu", f"{args.model}-{gpu}-tp{tp}.json")
    try:
        results.ensure_new(out)  # before minutes of measuring, not after
    except FileExistsError as error:
        raise SystemExit(f"{error} (choose another --out)") from None
    started = time.perf_counter()
    torch.manual_seed(0)
    shape: ModelShape = catalog[args.model]
    grid = QUICK if args.quick else FULL
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    with dev:  # initialised where they run: billions of random weights are slow to make on a CPU
        layers = torch.nn.ModuleList(Layer(shape, tp) for _ in range(args.layers)).to(dtype).eval()
        lm_head = torch.nn.Linear(shape.hidden_size, shape.vocab_size // tp, bias=False).to(dtype)
    scale = shape.num_layers / args.layers
    kv_heads, hd = layers[0].kv_heads, shape.head_dim

    use_graphs = dev.type == "cuda" and not args.no_cuda_graphs
    eager: list[dict[str, float]] = []
    math_attention: list[dict[str, int]] = []

    def timed(body_step: Callable[[], None], head_step: Callable[[], None]) -> float:
        """A step of `args.layers` layers and the LM head, scaled to the model's depth."""
        body = median_time(body_step, args.repeats, dev)
        head = median_time(head_step, args.repeats, dev)
        return max(body - head, 0.0) * scale + head

    def fused_attention(measure_point: Callable[[], float], point: dict[str, int]) -> float:
        """One point, with the fused attention kernels a server uses; torch's unfused math attention (far slower
        on long contexts) only where none of them takes the shapes, and the point is listed as such."""
        if dev.type != "cuda":
            return measure_point()
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
                return measure_point()
        except RuntimeError as error:
            if "No available kernel" not in str(error):
                raise
            print(f"  no fused attention for {point}: math attention", flush=True)
            math_attention.append(point)
            return measure_point()

    def kv_caches(batch: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.empty(batch, kv_heads, length, hd, device=dev, dtype=dtype),
                 torch.empty(batch, kv_heads, length, hd, device=dev, dtype=dtype)) for _ in layers]

    def measure(batch: int, new: int, past: int) -> float:
        nonlocal use_graphs
        caches = kv_caches(batch, past + new)
        x = torch.randn(batch, new, shape.hidden_size, device=dev, dtype=dtype)

        def step() -> None:
            h = x
            for layer, (k, v) in zip(layers, caches, strict=True):
                h = layer(h, k, v, past)
            lm_head(h[:, -1:])

        def head_step() -> None:
            lm_head(x[:, -1:])

        with torch.inference_mode():
            eager_s = timed(step, head_step)
            if batch * new > GRAPH_MAX_TOKENS or not use_graphs:
                return eager_s
            eager.append({"batch": batch, "new": new, "past": past, "step_s": eager_s})
            try:
                return timed(graphed(step), graphed(head_step))
            except torch.cuda.OutOfMemoryError:
                raise
            except RuntimeError as error:  # kept eager from here on, and the profile says so
                print(f"  CUDA graph capture failed ({error}); steps timed eagerly", flush=True)
                use_graphs = False
                torch.cuda.synchronize()
                return eager_s

    def measure_mixed(chunk: int, past: int, batch: int, context: int) -> float:
        """A chunk and `batch` decodes in one step, eager (a mixed step's shapes change every step: vLLM does not
        replay them from a whole-step graph either)."""
        chunk_caches, decode_caches = kv_caches(1, past + chunk), kv_caches(batch, context + 1)
        x = torch.randn(1, chunk + batch, shape.hidden_size, device=dev, dtype=dtype)

        def step() -> None:
            h = x
            for layer, chunk_kv, decode_kv in zip(layers, chunk_caches, decode_caches, strict=True):
                h = layer.forward_mixed(h, chunk_kv, decode_kv, chunk, past, context)
            lm_head(h[:, chunk - 1:])  # the chunk's last token and every decode token

        def head_step() -> None:
            lm_head(x[:, chunk - 1:])

        with torch.inference_mode():
            return timed(step, head_step)

    if dev.type == "cuda":
        warm_up(dev, args.warm_up_s)
    points: list[CalibrationPoint] = []
    out_of_memory: list[dict[str, int]] = []

    def timed_point(label: str, measure_point: Callable[[], float], prefill: int, cached: int, batch: int,
                    context: int) -> CalibrationPoint | None:
        """Time one point; one whose KV cache does not fit (many layers, a large batch) is listed and skipped,
        not fatal."""
        where = {"prefill_tokens": prefill, "prefill_context": cached, "decode_seqs": batch, "decode_context": context}
        try:
            step_s = fused_attention(measure_point, where)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            out_of_memory.append(where)
            print(f"{label}: skipped, out of GPU memory", flush=True)
            return None
        print(f"{label}: {step_s * 1e3:.2f} ms", flush=True)
        return CalibrationPoint(prefill, cached, batch, context, step_s)

    def add(label: str, prefill: int, cached: int, batch: int, context: int) -> None:
        measure_point = partial(measure, batch, 1, context) if batch else partial(measure, 1, prefill, cached)
        if (point := timed_point(label, measure_point, prefill, cached, batch, context)) is not None:
            points.append(point)

    for n in grid.prefill_tokens:
        add(f"prefill {n}", n, 0, 0, 0)
    for chunk, past in grid.chunks:
        add(f"chunk {chunk} after {past}", chunk, past, 0, 0)
    for batch in grid.decode_batches:
        for context in grid.decode_contexts:
            add(f"decode batch {batch} context {context}", 0, 0, batch, context)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    profile = fit_profile(points, model=args.model,
                          source=f"pdlab.benchmarks.gpu_phases on {gpu}, tp shard {tp}, {args.layers} layers scaled")
    profile.update(dtype_bytes=dtype.itemsize, gpu=gpu, tensor_parallel=tp, grid="quick" if args.quick else "full",
                   layers_timed=args.layers, warm_up_s=args.warm_up_s if dev.type == "cuda" else 0.0,
                   cuda_graphs=use_graphs, graph_max_tokens=GRAPH_MAX_TOKENS,
                   eager=eager,
                   math_attention=math_attention, out_of_memory=out_of_memory, environment=capture())
    fitted = FittedCost(coefficients_by_name(profile["features"], profile["coefficients"]))
    mixed_steps = []
    for chunk, past, batch, context in grid.mixed:
        label = f"mixed: chunk {chunk} after {past} + {batch} decodes at {context}"
        point = timed_point(label, partial(measure_mixed, chunk, past, batch, context), chunk, past, batch, context)
        if point is not None:
            priced = fitted.step_time(*point.features()[1:])
            mixed_steps.append({**point.__dict__, "profile_s": priced,
                                "error_pct": (priced - point.step_s) / point.step_s * 100})
            print(f"  the profile prices it {priced * 1e3:.2f} ms ({mixed_steps[-1]['error_pct']:+.1f}%)", flush=True)
    profile["mixed_steps"] = mixed_steps
    profile["elapsed_s"] = time.perf_counter() - started
    if dev.type == "cuda":
        profile["gpu_properties"] = gpu_properties()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=2) + "\n")
    print(f"wrote {out} in {profile['elapsed_s']:.0f} s; fit error mean {profile['fit_error_pct']['mean']:.1f}%")
    if args.record:
        print(f"recorded: {results.record('gpu', out)}")


if __name__ == "__main__":
    main()
