"""`pdlab bench transfer`: how long one prompt's KV transfer takes, beside idle and busy instances.

A probe prompt goes through the router's P/D path (prefill instance, NIXL read, decode instance) under four
conditions, each repeated:
- `idle`: nothing else running;
- `prefill-busy`: a longer prompt sent straight to the prefill instance just after the probe, so the prefill
  instance computes it while the probe's KV is read;
- `decode-prefilling`: a longer prompt sent straight to the decode instance, so it prefills while the probe's KV
  arrives;
- `decode-streaming`: several streams decoding on the decode instance;
- `prefill-busy-alone` and `prefill-busy-together`: the P/D protocol driven by hand (`pdlab.pdrequest`), so that
  reads are posted at a chosen moment: one probe (alone) or `TOGETHER` probes (together) are prefilled, a longer
  prompt is sent to the prefill instance, and once it computes the probes' decode requests go to the idle decode
  instance at once, which posts their reads in one step. Each read's first token, their spread, and whether they
  came before the busy prompt's answer (the end of its last step) are recorded.
Each trial records the probe's time to first token and the transfer time vLLM measured for it (the change of the
decode instance's `vllm:nixl_xfer_time_seconds` over the trial). This is what the simulator's
`ServingOverheads.transfer_waits_for_sender` and `sender_wake_s` describe: on a CPU a read completes only when the
instance it reads from, while it computes, gets around to serving it, and reads waiting on it complete together.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
from rich.progress import Progress

from pdlab.benchmarks import results
from pdlab.benchmarks.prefill import ProbeError, random_prompt, served_model
from pdlab.metrics.kv import scrape_kv_transfer
from pdlab.pdrequest import prefill_body

CONDITIONS = ("idle", "prefill-busy", "decode-prefilling", "decode-streaming", "prefill-busy-alone",
              "prefill-busy-together")
#: Reads posted at once in `prefill-busy-together` (one in `prefill-busy-alone`).
TOGETHER = 3
#: In the hand-driven conditions: how long after the busy prompt is sent the probes' decode requests follow (it
#: is computing by then).
BUSY_LEAD_S = 0.3
#: How long after the probe is sent the busy prompt follows: behind the probe on the prefill instance (FCFS), or
#: while the probe is still being prefilled, for the decode instance.
BUSY_AFTER_S = {"prefill-busy": 0.1, "decode-prefilling": 0.3}
STREAMS = 8
STREAM_PROMPT_TOKENS = 200
STREAM_OUTPUT_TOKENS = 400


class _Trial:
    """One probe with its background load, on threads of its own (joined before the next trial)."""

    def __init__(self, client: httpx.Client, model: str, rng: random.Random, vocab: int):
        self.client, self.model, self.rng, self.vocab = client, model, rng, vocab
        self.threads: list[threading.Thread] = []
        self.errors: list[str] = []

    def prompt(self, tokens: int) -> list[int]:
        return random_prompt(self.rng, tokens, self.vocab)

    def post(self, url: str, prompt: list[int], max_tokens: int) -> None:
        response = self.client.post(f"{url}/v1/completions", json={
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
        if response.is_error:
            self.errors.append(f"{url} answered {response.status_code}: {response.text[:200]}")

    def later(self, delay_s: float, fn: Callable[..., None], *args: Any) -> None:
        def run() -> None:
            time.sleep(delay_s)
            try:
                fn(*args)
            except httpx.HTTPError as error:
                self.errors.append(f"background request failed: {error}")
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)

    def first_token_s(self, url: str, prompt: list[int], kv_transfer_params: dict[str, Any] | None = None
                      ) -> float:
        """Stream the probe and time its first token."""
        began = time.perf_counter()
        body = {"model": self.model, "prompt": prompt, "max_tokens": 2, "ignore_eos": True, "stream": True}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        with self.client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.is_error:
                response.read()
                raise ProbeError(f"{url} refused the probe: {response.status_code} {response.text[:300]}")
            first = None
            for line in response.iter_lines():  # read to the end, so the trial ends with the request
                if first is None and line.startswith("data:") and line.strip() != "data: [DONE]":
                    first = time.perf_counter() - began
        if first is None:
            raise ProbeError(f"{url} streamed no token for the probe")
        return first

    def join(self) -> None:
        for thread in self.threads:
            thread.join()

    def prefill_leg(self, prefill_url: str, prompt: list[int]) -> dict[str, Any]:
        """Prefill `prompt` for a remote decode; the `kv_transfer_params` its decode request must carry."""
        body = prefill_body({"model": self.model, "prompt": prompt, "max_tokens": 2, "ignore_eos": True})
        response = self.client.post(f"{prefill_url}/v1/completions", json=body)
        if response.is_error:
            raise ProbeError(f"{prefill_url} refused the probe's prefill: {response.status_code} "
                             f"{response.text[:300]}")
        params = response.json().get("kv_transfer_params")
        if not params:
            raise ProbeError(f"{prefill_url} returned no kv_transfer_params: is it a NIXL prefill instance?")
        return params

    def reads_beside_busy_sender(self, prefill_url: str, decode_url: str, prompts: list[list[int]],
                                 busy_prompt: list[int]) -> dict[str, Any]:
        """Prefill `prompts`, keep the prefill instance busy with `busy_prompt`, then send their decode requests
        together to the (idle) decode instance; times are from that moment."""
        params = [self.prefill_leg(prefill_url, prompt) for prompt in prompts]
        busy_done: list[float] = []

        def busy() -> None:
            self.post(prefill_url, busy_prompt, 1)
            busy_done.append(time.perf_counter())

        self.later(0.0, busy)
        time.sleep(BUSY_LEAD_S)
        firsts: list[float | None] = [None] * len(prompts)

        def decode(i: int) -> None:
            try:
                firsts[i] = self.first_token_s(decode_url, prompts[i], params[i])
            except (ProbeError, httpx.HTTPError) as error:
                self.errors.append(f"probe {i}'s decode request: {error}")

        readers = [threading.Thread(target=decode, args=(i,), daemon=True) for i in range(len(prompts))]
        began = time.perf_counter()
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join()
        self.join()
        if any(first is None for first in firsts) or not busy_done:
            raise ProbeError("; ".join(self.errors) or "a probe's decode request streamed no token")
        firsts_ms = [first * 1e3 for first in firsts if first is not None]
        busy_answer_ms = (busy_done[0] - began) * 1e3
        return {"reads": len(prompts), "first_tokens_ms": firsts_ms, "spread_ms": max(firsts_ms) - min(firsts_ms),
                "busy_answer_ms": busy_answer_ms, "before_busy_answer": max(firsts_ms) < busy_answer_ms}


def probe(router_url: str, prefill_url: str, decode_url: str, *, prompt_tokens: int = 3000,
          busy_tokens: int = 6000, repeats: int = 3, conditions: Sequence[str] = CONDITIONS, vocab: int = 1000,
          seed: int = 0, settle_s: float = 2.0, progress: bool = True, timeout_s: float = 300.0
          ) -> list[dict[str, Any]]:
    """Run every condition `repeats` times (interleaved, so slow drifts of a shared machine hit all alike); one
    row per trial. `prompt_tokens` must be at or above the router's threshold (the probe must take the P/D path)."""
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown:
        raise ValueError(f"unknown condition(s) {unknown}; choose from {list(CONDITIONS)}")
    rng = random.Random(seed)
    rows = []
    with httpx.Client(timeout=timeout_s) as client, Progress(disable=not progress, transient=True) as bar:
        model = served_model(client, router_url)
        task = bar.add_task("KV transfer probe", total=repeats * len(conditions))
        for repeat in range(repeats):
            for condition in conditions:
                trial = _Trial(client, model, rng, vocab)
                if condition == "decode-streaming":
                    for _ in range(STREAMS):
                        trial.later(0.0, trial.post, decode_url, trial.prompt(STREAM_PROMPT_TOKENS),
                                    STREAM_OUTPUT_TOKENS)
                    time.sleep(1.0)  # let the streams get going
                before = scrape_kv_transfer(decode_url)
                extra: dict[str, Any] = {}
                if condition in ("prefill-busy-alone", "prefill-busy-together"):
                    reads = TOGETHER if condition == "prefill-busy-together" else 1
                    extra = trial.reads_beside_busy_sender(prefill_url, decode_url,
                                                           [trial.prompt(prompt_tokens) for _ in range(reads)],
                                                           trial.prompt(busy_tokens))
                    ttft = statistics.median(extra["first_tokens_ms"]) / 1e3
                else:
                    if condition in BUSY_AFTER_S:
                        target = prefill_url if condition == "prefill-busy" else decode_url
                        trial.later(BUSY_AFTER_S[condition], trial.post, target, trial.prompt(busy_tokens), 1)
                    ttft = trial.first_token_s(router_url, trial.prompt(prompt_tokens))
                after = scrape_kv_transfer(decode_url)
                trial.join()
                if trial.errors:
                    raise ProbeError("; ".join(trial.errors))
                moved = after.transfers - before.transfers
                rows.append({"condition": condition, "repeat": repeat, "ttft_s": ttft, "transfers": moved,
                             "xfer_ms": (after.xfer_seconds - before.xfer_seconds) / moved * 1e3 if moved else None,
                             "bytes": after.bytes - before.bytes, **extra})
                bar.advance(task)
                time.sleep(settle_s)  # the instances go idle again before the next trial
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Median probe TTFT and transfer time per condition; for the hand-driven ones also the median spread of a
    trial's first tokens and the share of trials whose reads all finished before the busy prompt's answer."""
    out: dict[str, dict[str, float | None]] = {}
    for condition in dict.fromkeys(r["condition"] for r in rows):
        mine = [r for r in rows if r["condition"] == condition]
        xfers = [r["xfer_ms"] for r in mine if r["xfer_ms"] is not None]
        out[condition] = {"ttft_ms_median": statistics.median(r["ttft_s"] for r in mine) * 1e3,
                          "xfer_ms_median": statistics.median(xfers) if xfers else None,
                          "xfer_ms_max": max(xfers) if xfers else None}
        if "spread_ms" in mine[0]:
            out[condition].update(spread_ms_median=statistics.median(r["spread_ms"] for r in mine),
                                  before_busy_answer=sum(r["before_busy_answer"] for r in mine) / len(mine))
    return out


def run(router_url: str, prefill_url: str, decode_url: str, *, out: Path | None = None,
        deployment: str | None = None, **options: Any) -> dict[str, Any]:
    """Probe and write the result under data/results/transfer/ (or `out`); returns it with its `path`."""
    rows = probe(router_url, prefill_url, decode_url, **options)
    settings = {k: v for k, v in options.items() if k in ("prompt_tokens", "busy_tokens", "repeats")}
    result = {"deployment": deployment, "router": router_url, "prefill": prefill_url, "decode": decode_url,
              **settings, "summary": summarize(rows), "trials": rows}
    path = results.write("transfer", result, out)
    return {**result, "path": str(path)}
