"""`pdlab bench prefill`: how long a served instance takes to prefill a prompt of N tokens, alone.

One request at a time (`max_tokens=1`, not streamed), prompts given as token ids so their length is exact, each
length timed `repeats` times and the fastest kept (other work on a shared machine only ever adds time). This is
the simulator's step-time micro-benchmark on the real server: HTTP, the API server and vLLM's chunked prefill
included, nothing else running. `pdlab sim calibrate --from-runs ... --prefill-probe FILE` fits to it together
with the runs, which pins the prefill cost that loaded runs only show through queueing.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from rich.progress import Progress

from pdlab.benchmarks import results

DEFAULT_LENGTHS = (16, 64, 256, 512, 1024, 2048, 3000, 4096, 6000)


class ProbeError(RuntimeError):
    """The instance could not be probed (unreachable, or it refused a request)."""


def served_model(client: httpx.Client, url: str) -> str:
    try:
        models = client.get(f"{url}/v1/models").raise_for_status().json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as error:
        raise ProbeError(f"{url}/v1/models did not answer with a model list: {error}") from error
    if not models:
        raise ProbeError(f"{url} serves no model")
    return str(models[0]["id"])


def random_prompt(rng: random.Random, tokens: int, vocab: int = 1000) -> list[int]:
    """`tokens` token ids drawn below `vocab` (past the special ids): no two prompts share a prefix, so a server
    with prefix caching on still prefills each one."""
    return [rng.randrange(10, vocab) for _ in range(tokens)]


def probe(url: str, lengths: Sequence[int] = DEFAULT_LENGTHS, *, repeats: int = 3, vocab: int = 1000,
          seed: int = 0, progress: bool = True, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Time one `max_tokens=1` request per prompt length, `repeats` times each; returns one row per length with
    every sample and the fastest (`ttft_s`). Prompts are `random_prompt`s."""
    rng = random.Random(seed)
    rows = []
    with httpx.Client(timeout=timeout_s) as client, Progress(disable=not progress, transient=True) as bar:
        model = served_model(client, url)
        task = bar.add_task(f"prefill probe of {url}", total=len(lengths) * repeats)
        for tokens in lengths:
            samples = []
            for _ in range(repeats):
                prompt = random_prompt(rng, tokens, vocab)
                began = time.perf_counter()
                response = client.post(f"{url}/v1/completions",
                                       json={"model": model, "prompt": prompt, "max_tokens": 1, "stream": False})
                elapsed = time.perf_counter() - began
                if response.is_error:
                    raise ProbeError(f"{url} refused a {tokens}-token prompt: {response.status_code} "
                                     f"{response.text[:300]}")
                samples.append(elapsed)
                bar.advance(task)
            rows.append({"prompt_tokens": tokens, "ttft_s": min(samples), "samples_s": samples})
    return rows


def run(url: str, lengths: Sequence[int] = DEFAULT_LENGTHS, *, repeats: int = 3, out: Path | None = None,
        deployment: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Probe `url` and write the result under data/results/prefill/ (or `out`); returns it with its `path`."""
    results.ensure_new(out)
    rows = probe(url, lengths, repeats=repeats, progress=progress)
    result = {"url": url, "deployment": deployment, "repeats": repeats, "points": rows}
    path = results.write("prefill", result, out)
    return {**result, "path": str(path)}


def load_points(path: Path) -> list[tuple[int, float]]:
    """(prompt tokens, fastest seconds) pairs from a `pdlab bench prefill` JSON."""
    try:
        data = json.loads(Path(path).read_text())
        return [(int(p["prompt_tokens"]), float(p["ttft_s"])) for p in data["points"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a `pdlab bench prefill` result ({error})") from error
