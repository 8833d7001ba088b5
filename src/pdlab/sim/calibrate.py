"""Measure the local model's step costs with torch directly (one thread, like one pinned vLLM CPU instance) and
fit a cost profile for the simulator.

The grid times whole-prompt prefills, chunked prefills (a chunk after context already in the KV cache) and single
decode steps at a few batch sizes and context lengths. Each point is the fastest of `repeats` runs (decode steps,
being cheap, at least 5): on a shared machine the fastest run is the one least disturbed by other work.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pdlab.sim.costs import CalibrationPoint, fit_profile


@dataclass(frozen=True)
class CalibrationGrid:
    prefill_tokens: tuple[int, ...] = (128, 512, 1024, 2048)
    chunks: tuple[tuple[int, int], ...] = ((512, 1024),)
    """(chunk tokens, context already cached)."""
    decode_batches: tuple[int, ...] = (1, 4, 8)
    decode_contexts: tuple[int, ...] = (128, 1024)
    repeats: int = 2


def measure(model_name: str, grid: CalibrationGrid, progress: Callable[[str], None] = lambda _: None,
            threads: int = 1) -> list[CalibrationPoint]:
    import torch
    from transformers import DynamicCache, LlamaForCausalLM

    from pdlab.model import resolve

    torch.set_num_threads(threads)
    model = LlamaForCausalLM.from_pretrained(resolve(model_name), dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)

    def ids(batch: int, n: int) -> torch.Tensor:
        return torch.randint(4, vocab, (batch, n), generator=generator)

    def timed(fn: Callable[[], object]) -> float:
        samples = []
        for _ in range(grid.repeats):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return min(samples)

    def prefilled(batch: int, n: int) -> DynamicCache:
        cache = DynamicCache()
        model(ids(batch, n), past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache

    points: list[CalibrationPoint] = []
    with torch.inference_mode():
        model(ids(1, 16), logits_to_keep=1)  # warm-up
        for n in grid.prefill_tokens:
            progress(f"prefill {n} tokens")
            prompt = ids(1, n)
            step = timed(lambda prompt=prompt: model(prompt, use_cache=True, logits_to_keep=1))
            points.append(CalibrationPoint(n, 0, 0, 0, step))
        for chunk, context in grid.chunks:
            progress(f"prefill chunk {chunk} after {context}")
            samples = []
            for _ in range(grid.repeats):
                cache = prefilled(1, context)
                start = time.perf_counter()
                model(ids(1, chunk), past_key_values=cache, use_cache=True, logits_to_keep=1)
                samples.append(time.perf_counter() - start)
            points.append(CalibrationPoint(chunk, context, 0, 0, min(samples)))
        for batch in grid.decode_batches:
            for context in grid.decode_contexts:
                progress(f"decode batch {batch} at context {context}")
                cache = prefilled(batch, context)
                samples = []
                for _ in range(max(grid.repeats, 5)):  # consecutive steps: context grows by 1 each, negligible
                    start = time.perf_counter()
                    model(ids(batch, 1), past_key_values=cache, use_cache=True)
                    samples.append(time.perf_counter() - start)
                points.append(CalibrationPoint(0, 0, batch, context, min(samples)))
    return points


def calibrate(model_name: str, grid: CalibrationGrid | None = None,
              progress: Callable[[str], None] = lambda _: None) -> dict:
    """Measure and fit; returns the profile (JSON-ready), with the environment it was measured in."""
    from pdlab.environment import capture

    grid = grid or CalibrationGrid()
    start = time.perf_counter()
    points = measure(model_name, grid, progress)
    profile = fit_profile(points, model=model_name,
                          source="pdlab sim calibrate: torch eager fp32, one thread, transformers LlamaForCausalLM")
    profile["dtype_bytes"] = 4
    profile["elapsed_s"] = time.perf_counter() - start
    profile["environment"] = capture()
    return profile


def points_from_runs(rows: list, min_samples: int = 3) -> list[CalibrationPoint]:
    """Step observations read off measured requests (validate.MeasuredRequest rows of one run):

    - a request served directly that had the instance to itself until its first token gives a prefill point
      (TTFT = one whole-prompt prefill step);
    - an inter-token gap during which no request was prefilling gives a decode point, with batch = the requests
      streaming at that moment and context = their prompt plus tokens so far. Gaps are grouped by (batch, context
      bucket) and each group's median kept (at least `min_samples` gaps per group).

    Runs with one streaming instance only (one colocated replica, or 1P1D, whose decode instance streams every
    request): with several replicas, concurrency on one would be mistaken for concurrency on another. In 1P1D, a
    disaggregated request joining the decode batch costs one decode step, so its gaps count like any other.
    """
    from bisect import bisect_right

    import numpy as np

    served = [r for r in rows if r.token_times]
    direct = [r for r in served if r.path != "disaggregated"]  # prefilled on the instance that streams them
    prefilling = [(r.start, r.token_times[0]) for r in direct]
    points: list[CalibrationPoint] = []
    for r in direct:
        first = r.token_times[0]
        if not any(o is not r and o.start < first and o.token_times[-1] > r.start for o in served):
            points.append(CalibrationPoint(r.prompt_tokens, 0, 0, 0, first - r.start))
    groups: dict[tuple[int, int], list[float]] = {}
    for r in served:
        for i in range(1, len(r.token_times)):
            lo, hi = r.token_times[i - 1], r.token_times[i]
            if any(s < hi and e > lo for s, e in prefilling):
                continue
            streaming = [o for o in served if o.token_times[0] <= lo and o.token_times[-1] >= hi]
            contexts = [o.prompt_tokens + bisect_right(o.token_times, lo) for o in streaming]
            bucket = int(round(np.mean(contexts) / 64.0)) * 64
            groups.setdefault((len(streaming), bucket), []).append(hi - lo)
    for (batch, context), gaps in sorted(groups.items()):
        if len(gaps) >= min_samples and context > 0:
            points.append(CalibrationPoint(0, 0, batch, context, float(np.median(gaps))))
    return points


def calibrate_from_runs(run_dirs: list, model: str) -> dict:
    """Fit a profile on measured runs' per-request token timestamps (see points_from_runs)."""
    from pdlab.sim.validate import read_run

    points: list[CalibrationPoint] = []
    for run_dir in run_dirs:
        rows, _ = read_run(run_dir)
        points += points_from_runs(rows)
    if len(points) < 2:
        raise ValueError("the runs gave fewer than two usable step observations (isolated requests or decode-only "
                         "gaps); calibrate on runs with requests spaced apart")
    profile = fit_profile(points, model=model,
                          source="pdlab sim calibrate --from-runs: " + ", ".join(str(d) for d in run_dirs))
    profile["dtype_bytes"] = 4
    return profile
