"""`pdlab bench admission`: how long an idle instance gathers requests before its first step.

Two prompts of the same length go to an idle instance, the second `gap` milliseconds after the first, over
connections opened beforehand; they shared the first step when their first tokens came together (closer than half
of a lone prompt's time to first token), and not when the second waited for the first's step. vLLM's engine, woken
by a request, takes in every request queued by then; on a CPU server the API server and the engine share a core, so
how long that takes varies from one burst to the next. The expected window is the area under the share of pairs
that shared a step, over the gaps (E[W] = integral of P(W > g) dg); the simulator's `admission_s`
(`pdlab sim calibrate --from-runs ... --admission-probe FILE`). A trace's tied requests arrive within a
millisecond of each other: whether they share a step decides whether a burst's short prompts wait one step or
several.

Prompts are text, as the load generator sends them (the API server's tokenizing is part of how requests reach the
engine together; token-id prompts share a step far less often): random picks of the corpus's words (one or two
tokens each), so no two share a prefix.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from rich.progress import Progress

from pdlab.benchmarks import results
from pdlab.benchmarks.prefill import ProbeError, served_model
from pdlab.sse import StreamRecord

DEFAULT_GAPS_MS = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0)
#: Seconds an instance is left idle before each pair (its previous work and streams are over).
IDLE_S = 0.5


async def _first_token(client: httpx.AsyncClient, url: str, body: dict[str, Any], at: float) -> tuple[float, float]:
    """Send `body` at perf_counter time `at`; returns (sent, first token) perf_counter times."""
    await asyncio.sleep(max(at - time.perf_counter(), 0.0))
    sent = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.is_error:
            raise ProbeError(f"{url} refused a probe prompt: {response.status_code} {(await response.aread())[:300]!r}")
        record = StreamRecord()
        async for line in response.aiter_lines():
            record.feed(line, time.perf_counter())
            if record.token_times:
                return sent, record.token_times[0]
    raise ProbeError(f"{url} ended a stream without a token{': ' + record.error if record.error else ''}")


async def _probe(url: str, gaps_ms: Sequence[float], repeats: int, prompt_words: int, seed: int, progress: bool,
                 timeout_s: float) -> tuple[float, list[dict[str, Any]]]:
    from pdlab.load.prompts import corpus_words  # here: pdlab.load brings pandas, which the CLI need not load

    rng = random.Random(seed)
    words = corpus_words()
    limits = httpx.Limits(max_keepalive_connections=4, keepalive_expiry=300)
    with httpx.Client(timeout=timeout_s) as sync_client:
        model = served_model(sync_client, url)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        def body() -> dict[str, Any]:
            prompt = " ".join(rng.choice(words) for _ in range(prompt_words))
            return {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True}

        async def warm() -> None:  # two open connections: neither send waits for a TCP handshake
            await asyncio.gather(client.get(f"{url}/v1/models"), client.get(f"{url}/v1/models"))
            await asyncio.sleep(IDLE_S)

        lone = []
        for _ in range(3):
            await warm()
            sent, first = await _first_token(client, url, body(), time.perf_counter())
            lone.append(first - sent)
        rows = []
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task(f"admission probe of {url}", total=len(gaps_ms) * repeats)
            for gap in gaps_ms:
                sent_gaps, shared = [], []
                for _ in range(repeats):
                    await warm()
                    at = time.perf_counter() + 0.01
                    (sent_a, first_a), (sent_b, first_b) = await asyncio.gather(
                        _first_token(client, url, body(), at), _first_token(client, url, body(), at + gap / 1e3))
                    sent_gaps.append((sent_b - sent_a) * 1e3)
                    shared.append(abs(first_b - first_a) < min(lone) / 2)
                    bar.advance(task)
                rows.append({"gap_ms": gap, "sent_gaps_ms": sent_gaps, "shared": shared,
                             "shared_fraction": sum(shared) / len(shared)})
    return min(lone), rows


def expected_window_ms(rows: Sequence[dict[str, Any]]) -> float:
    """The area under the shared fraction over the gaps (trapezoids from the first gap, zero past the last):
    the mean window, if the gaps cover it."""
    points = sorted((float(r["gap_ms"]), float(r["shared_fraction"])) for r in rows)
    return sum((g1 - g0) * (f0 + f1) / 2 for (g0, f0), (g1, f1) in zip(points, points[1:], strict=False))


def check_gaps(gaps_ms: Sequence[float]) -> list[float]:
    """The gaps as a list, or a ValueError saying what is wrong with them (the window integrates over them)."""
    gaps = [float(gap) for gap in gaps_ms]
    if not gaps or sorted(gaps) != gaps or gaps[0] < 0:
        raise ValueError(f"gaps must be non-negative and in ascending order, got {gaps}")
    return gaps


def probe(url: str, gaps_ms: Sequence[float] = DEFAULT_GAPS_MS, *, repeats: int = 6, prompt_words: int = 300,
          seed: int = 0, progress: bool = True, timeout_s: float = 120.0) -> dict[str, Any]:
    """Probe `url` with pairs of prompts of `prompt_words` words at each gap, `repeats` times."""
    lone_s, rows = asyncio.run(_probe(url, check_gaps(gaps_ms), repeats, prompt_words, seed, progress, timeout_s))
    window = expected_window_ms(rows)
    return {"url": url, "prompt_words": prompt_words, "repeats": repeats, "lone_ttft_s": lone_s, "gaps": rows,
            "window_ms": window,
            "window_censored": rows[-1]["shared_fraction"] > 0,
            "method": "pairs of prompts to an idle instance; shared a step when their first tokens came closer "
                      "than half a lone prompt's TTFT; window = area under the shared fraction over the gaps"}


def run(targets: Sequence[tuple[str, str, str]], gaps_ms: Sequence[float] = DEFAULT_GAPS_MS, *, repeats: int = 6,
        prompt_words: int = 300, out: Path | None = None, deployment: str | None = None,
        progress: bool = True) -> dict[str, Any]:
    """Probe each (name, role, url) of `targets` in turn (the others idle) and write the result under
    data/results/admission/ (or `out`): every instance's probe, and `window_ms`, the mean window per role.
    Returns it with its `path`."""
    results.ensure_new(out)
    instances = [{"name": name, "role": role, **probe(url, gaps_ms, repeats=repeats, prompt_words=prompt_words,
                                                      progress=progress)}
                 for name, role, url in targets]
    by_role: dict[str, list[float]] = {}
    for instance in instances:
        by_role.setdefault(instance["role"], []).append(instance["window_ms"])
    result = {"deployment": deployment, "instances": instances,
              "window_ms": {role: sum(windows) / len(windows) for role, windows in by_role.items()}}
    path = results.write("admission", result, out)
    return {**result, "path": str(path)}


def load_windows_ms(path: Path) -> dict[str, float]:
    """The expected admission window (ms) per instance role of a `pdlab bench admission` JSON."""
    try:
        windows = json.loads(Path(path).read_text())["window_ms"]
        return {str(role): float(ms) for role, ms in windows.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{path}: not a `pdlab bench admission` result ({error})") from error
