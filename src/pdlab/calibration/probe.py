"""`pdlab sim probe`: what the simulator's local profile needs, measured on this machine in a few minutes.

The shipped profile (`pdlab-small-fitted`) was fitted through the simulator on a 1.5-hour sitting of one machine
(`pdlab sim sitting`). On another machine, or the same kind on another day, its costs move, and not all by one
factor: a machine whose lone prefills run as fast may take 1.7 times as long per decode step (the scheduler's and
the API server's Python work per step, not the model's arithmetic). So the probe times each part of a step
apart, on the real server, with nothing else running:

- **lone prefills** of several lengths on the prefill instance, one request at a time (the fastest of the repeats,
  as `pdlab bench prefill`): the prefill's cost per token, per attention pair and per chunk, and the request's
  way in;
- **decode steps** on the decode instance at several batch sizes and contexts: k streams started together, and the
  time between tokens once every one of them decodes (the mean, which a merged chunk of tokens does not upset);
- **mixed steps**: while streams decode, one prompt of a chunk's size arrives; the longest gap of the streams around
  it is the step that computed the chunk beside them;
- **the KV transfer** over the loopback beside an idle sender, and reads posted while the sender computes a long
  prompt, watching when its progress thread gets the core (`pdlab bench transfer`'s conditions, fewer trials).

It brings up `labs/local-1p1d-router.yaml` (one prefill and one decode instance on a core each, the router in
front: ~30 s), and measures for about a minute and a half. `pdlab.calibration.machine` turns the result into this
machine's profile.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pdlab.benchmarks import transfer
from pdlab.benchmarks.prefill import ProbeError, random_prompt, served_model
from pdlab.sse import STREAM_OPTIONS, StreamRecord

#: Lone prompts timed on the prefill instance: the request's way in (64), one chunk of growing size, and a prompt
#: of two chunks (3,000 tokens: vLLM's CPU budget is 2,048 a step), whose second chunk reads cached context.
PREFILL_LENGTHS = (64, 512, 1024, 2048, 3000)
PREFILL_REPEATS = 2


@dataclass(frozen=True)
class DecodeCell:
    """Streams started together on the decode instance: their prompts' lengths (one stream each)."""

    prompts: tuple[int, ...]

    @property
    def batch(self) -> int:
        return len(self.prompts)

    @property
    def label(self) -> str:
        lengths = sorted(set(self.prompts))
        return f"batch {self.batch}, prompts of " + " and ".join(f"{n:,}" for n in lengths) + " tokens"


#: Batch 1 and 8 at short and long context, and batch 4: the step's constant, its price per sequence and per token
#: of context apart (the simulator prices a decode step by the batch and the summed context).
DECODE_CELLS = (DecodeCell((64,)), DecodeCell((3000,)), DecodeCell((64,) * 4), DecodeCell((64,) * 8),
                DecodeCell((3000,) + (64,) * 7))
#: Tokens each decode stream asks for; the steps timed are those after the last stream's first token.
DECODE_TOKENS = 48
#: Mixed steps: (streams decoding, tokens of the prompt that arrives beside them), each one chunk of the budget.
MIXED_CELLS = ((4, 512), (8, 1024), (4, 2048))
MIXED_REPEATS = 2
MIXED_STREAM_PROMPT = 64
#: How long the streams decode before the prompt arrives, and after its answer before they are closed.
MIXED_LEAD_S = 0.4
MIXED_TAIL_S = 0.25
#: The KV transfer: prompt lengths (a read of ~35 MB of pdlab-small's fp32 KV for 2,048 tokens), the prompt that
#: keeps the sender busy (three steps of the budget) and the trials of each condition.
TRANSFER_PROMPT_TOKENS = 2048
TRANSFER_BUSY_TOKENS = 6000
TRANSFER_REPEATS = 3
TRANSFER_CONDITIONS = ("idle", "prefill-busy-together")


def lone_prefills(url: str, lengths: Sequence[int] = PREFILL_LENGTHS, *, repeats: int = PREFILL_REPEATS,
                  rng: random.Random, client: httpx.Client, model: str,
                  advance: Callable[[], None] = lambda: None) -> list[dict[str, Any]]:
    """One `max_tokens=1` request at a time per length, `repeats` times; the fastest kept (`ttft_s`), as `pdlab
    bench prefill` does."""
    rows = []
    for tokens in lengths:
        samples = []
        for _ in range(repeats):
            began = time.perf_counter()
            response = client.post(f"{url}/v1/completions", json={
                "model": model, "prompt": random_prompt(rng, tokens), "max_tokens": 1, "stream": False})
            samples.append(time.perf_counter() - began)
            if response.is_error:
                raise ProbeError(f"{url} refused a {tokens}-token prompt: {response.status_code} "
                                 f"{response.text[:300]}")
            advance()
        rows.append({"prompt_tokens": tokens, "ttft_s": min(samples), "samples_s": samples})
    return rows


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], record: StreamRecord,
                  started: float) -> None:
    """Stream `body` into `record`, token times in seconds after `started` (perf_counter)."""
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.is_error:
            raise ProbeError(f"{url} refused a stream: {response.status_code} {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            record.feed(line, time.perf_counter() - started)


def _stream_body(model: str, prompt: list[int], tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "stream_options": STREAM_OPTIONS}


def decode_step(records: Sequence[StreamRecord]) -> dict[str, float]:
    """The decode step of streams that ran together: over the window in which every stream decodes (from the last
    first token to the first last token), each stream's time per token (its first and last token in the window,
    over the tokens between), and the median of the streams; also the single gaps' median, 90th and 99th
    percentiles (how much steps stray), for reference."""
    times = [r.token_times for r in records]
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    per_stream, gaps = [], []
    for t in times:
        inside = [x for x in t if start <= x <= end]
        if len(inside) >= 3 and inside[-1] > inside[0]:
            per_stream.append((inside[-1] - inside[0]) / (len(inside) - 1))
            gaps += [b - a for a, b in zip(inside, inside[1:], strict=False) if b > a]
    if not per_stream:
        raise ProbeError("the streams did not decode together long enough to time a step; ask for more tokens")
    spread = statistics.quantiles(gaps, n=100) if len(gaps) >= 2 else [0.0] * 99
    return {"step_s": statistics.median(per_stream), "gap_median_s": statistics.median(gaps) if gaps else 0.0,
            "gap_p90_s": spread[89], "gap_p99_s": spread[98],
            "tokens_timed": sum(len([x for x in t if start <= x <= end]) for t in times)}


async def _decode_cell(client: httpx.AsyncClient, url: str, model: str, cell: DecodeCell,
                       rng: random.Random) -> dict[str, Any]:
    records = [StreamRecord() for _ in cell.prompts]
    began = time.perf_counter()
    await asyncio.gather(*(_stream(client, url, _stream_body(model, random_prompt(rng, n), DECODE_TOKENS), record,
                                   began) for n, record in zip(cell.prompts, records, strict=True)))
    if any(len(r.token_times) < DECODE_TOKENS for r in records):
        raise ProbeError(f"a decode stream of {cell.label} ended early: {[len(r.token_times) for r in records]}")
    step = decode_step(records)
    return {"prompts": list(cell.prompts), "batch": cell.batch, "context_tokens": sum(cell.prompts), **step}


async def _mixed_cell(client: httpx.AsyncClient, url: str, model: str, streams: int, chunk: int,
                      rng: random.Random) -> dict[str, Any]:
    """`streams` decode; once all stream, a `chunk`-token prompt arrives (one token asked). The step that computed
    it beside them is the longest gap of each stream between the prompt's sending and its answer (plus a step),
    the median over the streams; beside it, the streams' decode step before the prompt came."""
    records = [StreamRecord() for _ in range(streams)]
    began = time.perf_counter()
    tasks = [asyncio.create_task(_stream(client, url, _stream_body(model, random_prompt(rng, MIXED_STREAM_PROMPT),
                                                                   4000), record, began)) for record in records]
    try:
        while not all(r.token_times for r in records):
            for task in tasks:
                if task.done():
                    task.result()  # a stream that failed or ended raises here
            await asyncio.sleep(0.01)
        await asyncio.sleep(MIXED_LEAD_S)
        sent = time.perf_counter() - began
        response = await client.post(f"{url}/v1/completions", json={
            "model": model, "prompt": random_prompt(rng, chunk), "max_tokens": 1, "stream": False})
        answered = time.perf_counter() - began
        if response.is_error:
            raise ProbeError(f"{url} refused a {chunk}-token prompt: {response.status_code} {response.text[:300]}")
        await asyncio.sleep(MIXED_TAIL_S)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
    mixed, before = [], []
    for record in records:
        t = record.token_times
        gaps = [(b - a, b) for a, b in zip(t, t[1:], strict=False) if b > a]
        around = [gap for gap, end in gaps if sent < end <= answered + MIXED_TAIL_S]
        quiet = [gap for gap, end in gaps if end <= sent]
        if around:
            mixed.append(max(around))
        if quiet:
            before.extend(quiet[-20:])
    if not mixed:
        raise ProbeError(f"no stream token came while the {chunk}-token prompt was computed beside {streams} streams")
    return {"streams": streams, "chunk_tokens": chunk, "stream_prompt_tokens": MIXED_STREAM_PROMPT,
            "context_tokens": streams * MIXED_STREAM_PROMPT, "step_s": statistics.median(mixed),
            "decode_step_s": statistics.median(before) if before else None, "ttft_s": answered - sent}


async def _decode_and_mixed(url: str, cells: Sequence[DecodeCell], mixed: Sequence[tuple[int, int]],
                            mixed_repeats: int, rng: random.Random, model: str, timeout_s: float,
                            advance: Callable[[], None]) -> tuple[list[dict], list[dict]]:
    limits = httpx.Limits(max_connections=max([c.batch for c in cells] + [s for s, _ in mixed]) + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        decode = []
        for cell in cells:
            decode.append(await _decode_cell(client, url, model, cell, rng))
            advance()
        mixed_rows = []
        for _ in range(mixed_repeats):
            for streams, chunk in mixed:
                mixed_rows.append(await _mixed_cell(client, url, model, streams, chunk, rng))
                advance()
    return decode, mixed_rows


def probe(router_url: str, prefill_url: str, decode_url: str, *, prefill_pid: int | None = None,
          watch_cores: Sequence[int] = (), threshold: int = 0, seed: int = 0, quick: bool = False,
          timeout_s: float = 300.0, progress: Callable[[str, float], None] = lambda what, done: None
          ) -> dict[str, Any]:
    """Every measurement above on a running 1P1D deployment with a router (whose `threshold` the transfer's prompt
    must reach, to take the P/D path); `progress(what, fraction done)` is called as it goes. `quick` (tests):
    fewer and shorter points, on any model."""
    rng = random.Random(seed)
    lengths = (16, 64, 128) if quick else PREFILL_LENGTHS
    cells = (DecodeCell((16,)), DecodeCell((128,)), DecodeCell((16,) * 3)) if quick else DECODE_CELLS
    mixed = ((2, 64),) if quick else MIXED_CELLS
    mixed_repeats = 1 if quick else MIXED_REPEATS
    transfer_repeats = 1 if quick else TRANSFER_REPEATS
    steps = len(lengths) * PREFILL_REPEATS + len(cells) + len(mixed) * mixed_repeats + 1
    done = [0]

    def advance(what: str) -> Callable[[], None]:
        def step() -> None:
            done[0] += 1
            progress(what, done[0] / steps)
        return step

    started = time.perf_counter()
    with httpx.Client(timeout=timeout_s) as client:
        model = served_model(client, prefill_url)
        progress("lone prefills on the prefill instance", 0.0)
        prefills = lone_prefills(prefill_url, lengths, rng=rng, client=client, model=model,
                                 advance=advance("lone prefills on the prefill instance"))
    progress("decode and mixed steps on the decode instance", done[0] / steps)
    decode, mixed_rows = asyncio.run(_decode_and_mixed(decode_url, cells, mixed, mixed_repeats, rng, model, timeout_s,
                                                       advance("decode and mixed steps on the decode instance")))
    progress("KV transfers beside an idle and a busy sender", done[0] / steps)
    prompt_tokens, busy_tokens = (64, 256) if quick else (TRANSFER_PROMPT_TOKENS, TRANSFER_BUSY_TOKENS)
    prompt_tokens = max(prompt_tokens, threshold)
    trials = transfer.probe(router_url, prefill_url, decode_url, prompt_tokens=prompt_tokens, busy_tokens=busy_tokens,
                            repeats=transfer_repeats, conditions=TRANSFER_CONDITIONS, seed=seed, settle_s=0.3,
                            progress=False, timeout_s=timeout_s, prefill_pid=prefill_pid, watch_cores=watch_cores)
    advance("KV transfers")()
    return {"model": model, "elapsed_s": time.perf_counter() - started,
            "prefill": prefills, "decode": decode, "mixed": mixed_rows,
            "transfer": {"prompt_tokens": prompt_tokens, "busy_tokens": busy_tokens,
                         "summary": transfer.summarize(trials), "trials": trials}}


def measure(lab_path: Path, *, deployment: str | None = None, console: Any = None,
            progress: Callable[[str, float], None] = lambda what, done: None, quick: bool = False) -> dict[str, Any]:
    """Bring up `lab_path`'s deployment (a 1P1D pair with a router), probe it, stop it; or probe the running
    `deployment` (`pdlab up`'s name) and leave it running. The result with the deployment's name, its start-up time
    (0 for a running one) and the environment."""
    from pdlab.config import load_lab
    from pdlab.deploy import Deployment
    from pdlab.deploy.launcher import DeployError
    from pdlab.environment import capture

    def on(dep: Deployment, what: str) -> dict[str, Any]:
        spec = dep.spec
        if spec.router is None or not dep.router_url or not dep.urls("prefill") or not dep.urls("decode"):
            raise ProbeError(f"{what}: the probe needs a deployment of a prefill and a decode instance with a "
                             "router, such as labs/local-1p1d-router.yaml")
        sender = next(inst for inst in dep.instances if inst.spec.role == "prefill")
        watch = [core for inst in dep.instances if inst.spec.role == "decode" for core in inst.spec.cores]
        return probe(dep.router_url, dep.urls("prefill")[0], dep.urls("decode")[0], prefill_pid=sender.pid,
                     watch_cores=watch, threshold=spec.router.threshold, quick=quick, progress=progress)

    began = time.perf_counter()
    try:
        if deployment is not None:
            dep = Deployment.attach(deployment)
            up_s, source, result = 0.0, f"deployment {deployment}", on(dep, f"deployment {deployment!r}")
        else:
            spec = load_lab(lab_path).deployment
            if spec is None:
                raise ProbeError(f"{lab_path}: the lab has no deployment; the probe needs a prefill and a decode "
                                 "instance with a router, such as labs/local-1p1d-router.yaml")
            with Deployment(spec, console=console) as dep:
                up_s, source = time.perf_counter() - began, str(lab_path)
                result = on(dep, str(lab_path))
    except DeployError as error:
        raise ProbeError(str(error)) from None
    return {"benchmark": "sim-probe", "lab": source, "deployment": dep.spec.name, "startup_s": up_s,
            "total_s": time.perf_counter() - began, **result, "environment": capture()}
