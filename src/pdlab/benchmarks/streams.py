"""`pdlab bench streams`: how a short prompt's time to first token grows with the streams an instance serves.

For each count k, k requests stream long answers from the instance; once every one of them is streaming, short
prompts (`max_tokens=1`) go one at a time, a random few tens of milliseconds apart so they land anywhere in a decode
step, and their TTFT is timed; then the k streams are closed (vLLM aborts a request whose client went away). On a
CPU server the API server shares the core with the engine and streams every running sequence's tokens, so a new
request is read, tokenized and handed over later the more streams it serves. The simulator prices steps by their
batch and context; what the TTFT grows by beyond that is its per-stream request overhead
(`ServingOverheads.request_per_stream_s`, `pdlab sim calibrate --from-runs ... --streams-probe FILE`).

Prompts are text, as the load generator sends them: random picks of the corpus's words, so no two share a prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from rich.progress import Progress

from pdlab.benchmarks import results
from pdlab.benchmarks.prefill import ProbeError, served_model
from pdlab.sse import STREAM_OPTIONS, StreamRecord

DEFAULT_STREAMS = (0, 1, 2, 4, 6, 8)
#: Tokens each background stream asks for: more than it streams while the probes run (it is closed after them).
STREAM_TOKENS = 2000
#: Seconds between one probe's answer and the next probe: drawn uniformly, so probes fall anywhere in a step.
PROBE_SPACING_S = (0.02, 0.08)


async def _ttft(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[float, int | None]:
    """Send `body` (one token asked for), read its stream to the end; (seconds to the first token, prompt tokens)."""
    sent = time.perf_counter()
    record = StreamRecord()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.is_error:
            raise ProbeError(f"{url} refused a probe prompt: {response.status_code} {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            record.feed(line, time.perf_counter() - sent)
    if not record.token_times:
        raise ProbeError(f"{url} ended a stream without a token{': ' + record.error if record.error else ''}")
    return record.token_times[0], record.usage_prompt_tokens


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], streaming: asyncio.Event) -> None:
    """One background stream: sets `streaming` at its first token, then reads until cancelled (or it ends)."""
    record = StreamRecord()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.is_error:
            raise ProbeError(f"{url} refused a stream: {response.status_code} {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            record.feed(line, 0.0)
            if record.token_times:
                streaming.set()
    raise ProbeError(f"a background stream of {url} ended before the probes did ({len(record.token_times)} tokens);"
                     " ask for more tokens")


async def _probe(url: str, streams: Sequence[int], repeats: int, prompt_words: int, seed: int, progress: bool,
                 timeout_s: float) -> list[dict[str, Any]]:
    from pdlab.load.prompts import corpus_words  # here: pdlab.load brings pandas, which the CLI need not load

    rng = random.Random(seed)
    words = corpus_words()
    with httpx.Client(timeout=timeout_s) as sync_client:
        model = served_model(sync_client, url)

    def prompt(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    limits = httpx.Limits(max_connections=max(streams, default=0) + 4, keepalive_expiry=300)
    points = []
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task(f"streams probe of {url}", total=len(streams) * repeats)
            for count in streams:
                started = [asyncio.Event() for _ in range(count)]
                background = [asyncio.create_task(_stream(
                    client, url, {"model": model, "prompt": prompt(8), "max_tokens": STREAM_TOKENS,
                                  "ignore_eos": True, "stream": True}, event)) for event in started]
                all_streaming = asyncio.ensure_future(asyncio.gather(*(event.wait() for event in started)))
                try:
                    # every stream decoding before the first probe; one that failed or ended raises here
                    await asyncio.wait([all_streaming, *background], return_when=asyncio.FIRST_COMPLETED)
                    for stream in background:
                        if stream.done():
                            stream.result()
                    ttfts, prompt_tokens = [], []
                    for _ in range(repeats):
                        await asyncio.sleep(rng.uniform(*PROBE_SPACING_S))
                        seconds, tokens = await _ttft(client, url, {
                            "model": model, "prompt": prompt(prompt_words), "max_tokens": 1, "stream": True,
                            "stream_options": STREAM_OPTIONS})
                        ttfts.append(seconds)
                        if tokens is not None:
                            prompt_tokens.append(tokens)
                        bar.advance(task)
                    for stream in background:
                        if stream.done():  # a stream that ended early: the probes did not see `count` streams
                            stream.result()
                finally:
                    for stream in [all_streaming, *background]:
                        stream.cancel()
                    for stream in [all_streaming, *background]:
                        with contextlib.suppress(asyncio.CancelledError):
                            await stream
                points.append({"streams": count, "ttft_s": ttfts, "median_ttft_s": statistics.median(ttfts),
                               "prompt_tokens": round(statistics.median(prompt_tokens)) if prompt_tokens else None})
    return points


def slope_per_stream(points: Sequence[tuple[int, float]]) -> float:
    """Least-squares slope of TTFT over the stream count, from one stream on: with none the instance is idle
    and a probe does not wait for a step under way, a jump the simulator models itself."""
    busy = [(float(k), float(t)) for k, t in points if k >= 1]
    if len(busy) < 2 or len({k for k, _ in busy}) < 2:
        raise ValueError("a slope needs TTFTs at two or more stream counts of one or more")
    mean_k = sum(k for k, _ in busy) / len(busy)
    mean_t = sum(t for _, t in busy) / len(busy)
    return sum((k - mean_k) * (t - mean_t) for k, t in busy) / sum((k - mean_k) ** 2 for k, _ in busy)


def check_streams(streams: Sequence[int]) -> list[int]:
    """The stream counts as a list, or a ValueError saying what is wrong with them."""
    counts = [int(k) for k in streams]
    if sorted(set(counts)) != counts or not counts or counts[0] < 0 or sum(k >= 1 for k in counts) < 2:
        raise ValueError(f"stream counts must be distinct, ascending, non-negative, with at least two of one or "
                         f"more (the slope is taken over those), got {counts}")
    return counts


def probe(url: str, streams: Sequence[int] = DEFAULT_STREAMS, *, repeats: int = 24, prompt_words: int = 48,
          seed: int = 0, progress: bool = True, timeout_s: float = 120.0) -> dict[str, Any]:
    """Time `repeats` short prompts of `prompt_words` words at `url` beside each count of streams."""
    points = asyncio.run(_probe(url, check_streams(streams), repeats, prompt_words, seed, progress, timeout_s))
    slope = slope_per_stream([(p["streams"], p["median_ttft_s"]) for p in points])
    return {"url": url, "prompt_words": prompt_words, "repeats": repeats, "points": points,
            "slope_ms_per_stream": slope * 1e3,
            "method": "k streams decoding, then short prompts one at a time at random gaps; TTFT median per k; "
                      "slope by least squares over k >= 1"}


def run(targets: Sequence[tuple[str, str, str]], streams: Sequence[int] = DEFAULT_STREAMS, *, repeats: int = 24,
        prompt_words: int = 48, out: Path | None = None, deployment: str | None = None,
        progress: bool = True) -> dict[str, Any]:
    """Probe each (name, role, url) of `targets` in turn (the others idle) and write the result under
    data/results/streams/ (or `out`). Returns it with its `path`."""
    results.ensure_new(out)
    instances = [{"name": name, "role": role, **probe(url, streams, repeats=repeats, prompt_words=prompt_words,
                                                      progress=progress)}
                 for name, role, url in targets]
    result = {"deployment": deployment, "instances": instances}
    path = results.write("streams", result, out)
    return {**result, "path": str(path)}


def load_points(path: Path) -> list[dict[str, Any]]:
    """Each probed instance of a `pdlab bench streams` JSON as {role, prompt_tokens, points: [(streams, TTFT s)]}."""
    try:
        instances = json.loads(Path(path).read_text())["instances"]
        return [{"role": str(inst["role"]),
                 "prompt_tokens": int(next(p["prompt_tokens"] for p in inst["points"] if p["prompt_tokens"])),
                 "points": [(int(p["streams"]), float(p["median_ttft_s"])) for p in inst["points"]]}
                for inst in instances]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, StopIteration) as error:
        raise ValueError(f"{path}: not a `pdlab bench streams` result ({error})") from error
