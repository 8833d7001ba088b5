"""`pdlab bench backtoback`: does a prefill instance work through a queue of prompts as fast as through the same
prompts one at a time, and does it slow down while the decode instance beside it works?

On a 1P1D deployment, each round runs every condition once, in a rotated order (so a drift of a shared machine's
speed touches all alike), with `prompts` prompts of `tokens` tokens each:
- `alone`: sent to the prefill instance one at a time, each after the last one's answer (the sum of their times);
- `queued`: sent together (a hair apart, so the instance takes them in order), the decode instance idle;
- `queued-beside-prefill`: the same while the decode instance prefills prompts of the same length, one after
  another, until the queue is done;
- `queued-beside-decode`: the same while the decode instance streams `STREAMS` long answers;
- `queued-pd`: the P/D protocol (`pdlab.pdrequest`): each prompt's KV read by the decode instance as soon as the
  prefill instance answers, and `PD_OUTPUT_TOKENS` tokens decoded there, while the next prompts compute.
A queued condition's time runs from the first prompt sent to the last prefill answer. Each round's ratio to its own
`alone` is what counts (medians and extremes over rounds). The simulator's ratios for `queued` and `queued-pd`
come beside them (the profile's price of the same prompts, one at a time and together): where the measured ratio
is higher, back-to-back prefills cost more than the profile says (docs/dev/simulator-calibration.md, "Long ITL p99
at threshold 2,048"), and the `beside` conditions say whether the decode instance's work is the cause.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from pdlab.benchmarks import results
from pdlab.benchmarks.prefill import ProbeError, random_prompt, served_model
from pdlab.pdrequest import decode_body, prefill_body

CONDITIONS = ("alone", "queued", "queued-beside-prefill", "queued-beside-decode", "queued-pd")
#: Streams the decode instance serves in `queued-beside-decode`, their prompt and answer lengths (long enough to
#: outlast the queue).
STREAMS, STREAM_PROMPT_TOKENS, STREAM_OUTPUT_TOKENS = 4, 200, 4000
#: Tokens the decode instance generates for each prompt in `queued-pd` (the threshold sweep's answers are <= 64).
PD_OUTPUT_TOKENS = 16
#: Between prompts sent "together": enough for the instance to take them in the order sent.
SEND_GAP_S = 0.002
#: How long the decode instance's work runs before the queue is sent (its streams get going).
BESIDE_LEAD_S = 1.0


class _Round:
    """One round's requests, over one client."""

    def __init__(self, client: httpx.AsyncClient, model: str, prefill_url: str, decode_url: str,
                 rng: random.Random, tokens: int, vocab: int):
        self.client, self.model, self.prefill, self.decode = client, model, prefill_url, decode_url
        self.rng, self.tokens, self.vocab = rng, tokens, vocab

    def body(self, tokens: int | None = None, max_tokens: int = 1, stream: bool = True) -> dict[str, Any]:
        return {"model": self.model, "prompt": random_prompt(self.rng, tokens or self.tokens, self.vocab),
                "max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True, "stream": stream,
                "temperature": 0}

    async def post(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        """Send `body`; return the answer (a non-streamed one's JSON, or {} once a stream ends)."""
        if not body.get("stream"):
            response = await self.client.post(f"{url}/v1/completions", json=body)
            if response.is_error:
                raise ProbeError(f"{url} refused a request: {response.status_code} {response.text[:300]}")
            return response.json()
        async with self.client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.is_error:
                await response.aread()
                raise ProbeError(f"{url} refused a request: {response.status_code} {response.text[:300]}")
            async for _ in response.aiter_lines():
                pass
        return {}

    async def alone(self, prompts: int) -> float:
        began = time.perf_counter()
        for _ in range(prompts):
            await self.post(self.prefill, self.body())
        return time.perf_counter() - began

    async def queued(self, prompts: int, pd: bool = False) -> float:
        answered: list[float] = []

        async def one(body: dict[str, Any]) -> None:
            if not pd:
                await self.post(self.prefill, body)
                answered.append(time.perf_counter())
                return
            out = await self.post(self.prefill, prefill_body(body))
            answered.append(time.perf_counter())
            params = out.get("kv_transfer_params")
            if not params:
                raise ProbeError(f"{self.prefill} returned no kv_transfer_params: is it a NIXL prefill instance?")
            await self.post(self.decode, decode_body(dict(body, max_tokens=PD_OUTPUT_TOKENS,
                                                          min_tokens=PD_OUTPUT_TOKENS), params))

        bodies = [self.body(stream=not pd) for _ in range(prompts)]
        began = time.perf_counter()
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(one(body)))
            await asyncio.sleep(SEND_GAP_S)
        await asyncio.gather(*tasks)
        return max(answered) - began

    async def beside(self, condition: str, prompts: int) -> float:
        """`queued` while the decode instance prefills (`queued-beside-prefill`) or streams (`-decode`)."""
        done = asyncio.Event()

        async def keep_prefilling() -> None:
            while not done.is_set():
                await self.post(self.decode, self.body())

        if condition == "queued-beside-prefill":
            workers = [asyncio.create_task(keep_prefilling())]
        else:
            workers = [asyncio.create_task(self.post(self.decode, self.body(STREAM_PROMPT_TOKENS,
                                                                            STREAM_OUTPUT_TOKENS)))
                       for _ in range(STREAMS)]
        try:
            await asyncio.sleep(BESIDE_LEAD_S)
            for worker in workers:
                if worker.done():
                    worker.result()  # a refused request: raise it now
            return await self.queued(prompts)
        finally:
            done.set()
            for worker in workers:
                if condition == "queued-beside-decode":
                    worker.cancel()  # closing the stream aborts it on the server
            outcomes = await asyncio.gather(*workers, return_exceptions=True)
            failures = [o for o in outcomes if isinstance(o, Exception) and not isinstance(o, asyncio.CancelledError)]
            if failures:
                raise failures[0]


async def _probe(prefill_url: str, decode_url: str, model: str, *, prompts: int, tokens: int, rounds: int,
                 conditions: Sequence[str], vocab: int, seed: int, settle_s: float, timeout_s: float,
                 advance: Callable[[], None]) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        trial = _Round(client, model, prefill_url, decode_url, rng, tokens, vocab)
        await trial.alone(1)  # warm-up
        for number in range(rounds):
            shift = number % len(conditions)
            row: dict[str, Any] = {"round": number}
            for condition in [*conditions[shift:], *conditions[:shift]]:
                if condition == "alone":
                    seconds = await trial.alone(prompts)
                elif condition in ("queued", "queued-pd"):
                    seconds = await trial.queued(prompts, pd=condition == "queued-pd")
                else:
                    seconds = await trial.beside(condition, prompts)
                row[condition] = seconds
                advance()
                await asyncio.sleep(settle_s)  # both instances idle again
            if "alone" in row:
                row["ratio_to_alone"] = {c: row[c] / row["alone"] for c in conditions if c != "alone"}
            rows.append(row)
    return rows


def check_conditions(conditions: Sequence[str]) -> None:
    """Refuse unknown conditions, and a set without `alone` (every ratio is to it)."""
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown:
        raise ValueError(f"unknown {', '.join(unknown)}; choose from {', '.join(CONDITIONS)}")
    if "alone" not in conditions:
        raise ValueError(f"`alone` is missing (every ratio is to it); choose from {', '.join(CONDITIONS)}")


def probe(prefill_url: str, decode_url: str, *, prompts: int = 4, tokens: int = 3000, rounds: int = 6,
          conditions: Sequence[str] = CONDITIONS, vocab: int = 1000, seed: int = 0, settle_s: float = 1.5,
          timeout_s: float = 600.0, progress: bool = True) -> list[dict[str, Any]]:
    """Run every condition once per round, `rounds` rounds; one row per round with each condition's seconds and
    its ratio to the round's `alone`."""
    from rich.progress import Progress

    check_conditions(conditions)
    if prompts < 2 or tokens < 1 or rounds < 1:
        raise ValueError("a queue needs at least 2 prompts of at least 1 token, and at least one round")
    with httpx.Client(timeout=timeout_s) as client:
        model = served_model(client, prefill_url)
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("back-to-back prefills", total=rounds * len(conditions))
        return asyncio.run(_probe(prefill_url, decode_url, model, prompts=prompts, tokens=tokens, rounds=rounds,
                                  conditions=conditions, vocab=vocab, seed=seed, settle_s=settle_s,
                                  timeout_s=timeout_s, advance=lambda: bar.advance(task)))


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per condition: the median seconds, and the median, smallest and largest ratio to the same round's `alone`."""
    out: dict[str, dict[str, float]] = {}
    conditions = [c for c in CONDITIONS if any(c in row for row in rows)]
    for condition in conditions:
        seconds = [row[condition] for row in rows]
        out[condition] = {"seconds_median": statistics.median(seconds)}
        ratios = [row["ratio_to_alone"][condition] for row in rows if condition in row.get("ratio_to_alone", {})]
        if ratios:
            out[condition].update(ratio_median=statistics.median(ratios), ratio_min=min(ratios),
                                  ratio_max=max(ratios))
    return out


def simulated_ratios(profile: str | Path, prompts: int, tokens: int, *, budget: int | None = None,
                     seeds: int = 5) -> dict[str, float]:
    """The simulator's `queued` and `queued-pd` over `alone` for the same prompts with `profile`: one instance
    (token budget `budget`, vLLM CPU's default when None), and a 1P1D pair at threshold 0. Medians over seeds."""
    from pdlab.config.sim import SimSpec
    from pdlab.settings import VLLM_CPU_MAX_NUM_BATCHED_TOKENS
    from pdlab.sim.scenario import build, prepare
    from pdlab.sim.summary import token_times
    from pdlab.sim.workload import Arrival

    def spec(pools: dict[str, int]) -> SimSpec:
        return SimSpec.model_validate({
            "name": "backtoback", "model": "pdlab-small", "profile": str(profile), "dtype_bytes": 4,
            "link": {"name": "local-loopback"}, "pools": pools, "router": {"threshold": 0},
            "engine": {"max_num_batched_tokens": budget or VLLM_CPU_MAX_NUM_BATCHED_TOKENS, "kv_cache_gib": 1},
            "workload": {"requests": [{"at_s": 0, "prompt_tokens": tokens, "output_tokens": 1}]}})

    one, pair = prepare(spec({"colocated": 1})), prepare(spec({"prefill": 1, "decode": 1}))
    alone, queued, queued_pd = [], [], []
    for seed in range(seeds):
        total = 0.0
        for k in range(prompts):
            sim = build(one, seed * prompts + k)
            sim.run([Arrival(0.0, tokens, 1, "x")])
            total += token_times(sim.requests[0])[0]
        alone.append(total)
        sim = build(one, seed)
        sim.run([Arrival(k * SEND_GAP_S, tokens, 1, "x") for k in range(prompts)])
        queued.append(max(token_times(r)[0] for r in sim.requests))
        sim = build(pair, seed)
        sim.run([Arrival(k * SEND_GAP_S, tokens, PD_OUTPUT_TOKENS, "x") for k in range(prompts)])
        queued_pd.append(max(r.prefill_end for r in sim.requests))
    base = statistics.median(alone)
    return {"queued": float(statistics.median(queued) / base), "queued-pd": float(statistics.median(queued_pd) / base)}


def run(prefill_url: str, decode_url: str, *, out: Path | None = None, deployment: str | None = None,
        profile: str | Path | None = "pdlab-small-fitted", **options: Any) -> dict[str, Any]:
    """Probe, compare with the simulator (unless `profile` is None), and write the result under
    data/results/backtoback/ (or `out`); returns it with its `path`."""
    from pdlab.sim.scenario import resolve_profile

    results.ensure_new(out)
    profile_path = resolve_profile(Path(profile)) if profile is not None else None  # a bad name fails first
    rows = probe(prefill_url, decode_url, **options)
    settings = {k: options[k] for k in ("prompts", "tokens", "rounds") if k in options}
    result: dict[str, Any] = {"deployment": deployment, "prefill": prefill_url, "decode": decode_url, **settings,
                              "summary": summarize(rows), "rounds_measured": rows}
    if profile_path is not None:
        result["simulated"] = {"profile": str(profile), "ratio_to_alone": simulated_ratios(
            profile_path, options.get("prompts", 4), options.get("tokens", 3000))}
    written = results.write("backtoback", result, out)
    return {**result, "path": str(written)}
