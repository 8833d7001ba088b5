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
When the bench runs on the machine that hosts the prefill instance, the hand-driven trials also record when that
instance's idle-class threads (NIXL's progress thread, which pdlab moves to SCHED_IDLE) got the CPU while it
computed (`SenderWatch`): the moments its side of a read can be served, the gaps between them, and how long after
the last such moment each read's first token came.
Each trial records the probe's time to first token and the transfer time vLLM measured for it (the change of the
decode instance's `vllm:nixl_xfer_time_seconds` over the trial). This is what the simulator's
`ServingOverheads.transfer_waits_for_sender` and `sender_wake_s` describe: on a CPU a read completes only when the
instance it reads from, while it computes, gets around to serving it, and reads waiting on it complete together.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
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
from pdlab.deploy.process import idle_class_threads
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


#: How often `SenderWatch` reads the threads' run times: the resolution of the moments it records.
WATCH_INTERVAL_S = 0.001
#: Run time seen in samples less than this apart is one burst (a slice can be cut by a wake-up on its core).
SLICE_MERGE_S = 0.02
#: A burst with more run time than this is the thread having the core to itself (the instance not computing),
#: not a slice granted beside the engine (those measured 0.01-5 ms).
FREE_RUN_MS = 10.0


class SenderWatch:
    """Records when the idle-class threads of a process tree get the CPU, from their cumulative run time in
    /proc/<pid>/task/<tid>/schedstat, read every WATCH_INTERVAL_S by a thread of this process (pinned to
    `cores`, to keep the sampling off the core it watches). Linux only; `available` is False when there is
    nothing to watch (another machine's instance, no idle-class thread, no /proc)."""

    def __init__(self, pid: int | None, cores: Sequence[int] = ()):
        threads = idle_class_threads(pid) if pid is not None else []
        self._files = []
        for proc_id, thread_id in threads:
            with contextlib.suppress(OSError):
                self._files.append(open(f"/proc/{proc_id}/task/{thread_id}/schedstat", "rb"))  # noqa: SIM115
        self.available = bool(self._files)
        self.cores = list(cores)
        self.samples: list[tuple[float, float]] = []
        """(perf_counter seconds, ms of run time since the previous sample) for each sample that saw some."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _run_ns(self) -> int:
        total = 0
        for handle in self._files:
            handle.seek(0)
            total += int(handle.read().split()[0])
        return total

    def _sample(self) -> None:
        if self.cores:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, self.cores)  # this thread only
        last = self._run_ns()
        while not self._stop.wait(WATCH_INTERVAL_S):
            try:
                now_ns = self._run_ns()
            except (OSError, ValueError):  # the instance went away
                return
            if now_ns > last:
                self.samples.append((time.perf_counter(), (now_ns - last) / 1e6))
            last = now_ns

    def __enter__(self) -> SenderWatch:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        for handle in self._files:
            handle.close()

    def bursts(self, start: float, end: float) -> list[tuple[float, float]]:
        """(start in perf_counter seconds, ms of run time) of each burst seen between `start` and `end`."""
        out: list[list[float]] = []
        last = -1.0
        for moment, run_ms in self.samples:
            if start <= moment <= end:
                if out and moment - last < SLICE_MERGE_S:
                    out[-1][1] += run_ms
                else:
                    out.append([moment, run_ms])
                last = moment
        return [(begin, run_ms) for begin, run_ms in out]


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
                                 busy_prompt: list[int], watch: SenderWatch | None = None) -> dict[str, Any]:
        """Prefill `prompts`, keep the prefill instance busy with `busy_prompt`, then send their decode requests
        together to the (idle) decode instance; times are from that moment. With a `watch` on the prefill
        instance, also the bursts in which its idle-class threads ran (`sender_bursts_ms`: start and ms of run
        time, from the busy prompt being sent to its answer) and, per read, how long after the last slice before
        its first token that token came (`after_slice_ms`)."""
        params = [self.prefill_leg(prefill_url, prompt) for prompt in prompts]
        busy_done: list[float] = []

        def busy() -> None:
            self.post(prefill_url, busy_prompt, 1)
            busy_done.append(time.perf_counter())

        busy_sent = time.perf_counter()
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
        row = {"reads": len(prompts), "first_tokens_ms": firsts_ms, "spread_ms": max(firsts_ms) - min(firsts_ms),
               "busy_answer_ms": busy_answer_ms, "before_busy_answer": max(firsts_ms) < busy_answer_ms}
        if watch is not None and watch.available:
            bursts = [((t - began) * 1e3, run_ms) for t, run_ms in watch.bursts(busy_sent, busy_done[0])]
            row.update(busy_sent_ms=(busy_sent - began) * 1e3, sender_bursts_ms=bursts,
                       after_slice_ms=[after_last_slice(bursts, first) for first in firsts_ms])
        return row


def after_last_slice(bursts: list[tuple[float, float]], first_ms: float) -> float | None:
    """How long after the last burst before it a read's first token came, if that burst was a slice granted
    beside the computing engine (None if the sender had the core to itself then, or never ran)."""
    before = [(t, run_ms) for t, run_ms in bursts if t < first_ms]
    if not before or before[-1][1] >= FREE_RUN_MS:
        return None
    return first_ms - before[-1][0]


def slice_gaps(bursts: list[tuple[float, float]]) -> list[float]:
    """Gaps (ms) between consecutive slices granted beside the computing engine (free runs break the chain)."""
    return [b[0] - a[0] for a, b in itertools.pairwise(bursts) if a[1] < FREE_RUN_MS and b[1] < FREE_RUN_MS]


def probe(router_url: str, prefill_url: str, decode_url: str, *, prompt_tokens: int = 3000,
          busy_tokens: int = 6000, repeats: int = 3, conditions: Sequence[str] = CONDITIONS, vocab: int = 1000,
          seed: int = 0, settle_s: float = 2.0, progress: bool = True, timeout_s: float = 300.0,
          prefill_pid: int | None = None, watch_cores: Sequence[int] = ()) -> list[dict[str, Any]]:
    """Run every condition `repeats` times (interleaved, so slow drifts of a shared machine hit all alike); one
    row per trial. `prompt_tokens` must be at or above the router's threshold (the probe must take the P/D path).
    `prefill_pid` (an instance on this machine) turns on `SenderWatch` in the hand-driven conditions, sampling
    from `watch_cores`."""
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
                    with SenderWatch(prefill_pid, watch_cores) as watch:
                        extra = trial.reads_beside_busy_sender(prefill_url, decode_url,
                                                               [trial.prompt(prompt_tokens) for _ in range(reads)],
                                                               trial.prompt(busy_tokens), watch)
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
        gaps = [gap for r in mine for gap in slice_gaps(r.get("sender_bursts_ms", []))]
        if len(gaps) >= 2:
            mean = statistics.fmean(gaps)
            after = [a for r in mine for a in r["after_slice_ms"] if a is not None]
            out[condition].update(sender_gaps=len(gaps), sender_gap_ms_mean=mean,
                                  sender_gap_ms_median=statistics.median(gaps),
                                  sender_gap_cv=statistics.pstdev(gaps) / mean,
                                  after_slice_ms_median=statistics.median(after) if after else None)
    return out


def load_gap_cv(path: Path) -> float:
    """The coefficient of variation of the gaps between a busy sender's slices in a `pdlab bench transfer`
    result, pooled over its hand-driven trials (what the simulator's `sender_wake_cv` holds)."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("benchmark") != "transfer" or "trials" not in data:
        raise ValueError(f"{path}: not a `pdlab bench transfer` result")
    gaps = [gap for row in data["trials"] for gap in slice_gaps(row.get("sender_bursts_ms", []))]
    if len(gaps) < 10:
        raise ValueError(f"{path}: {len(gaps)} gaps between the sender's slices; at least 10 are needed (run the "
                         "bench on the machine that hosts the deployment, with the prefill-busy-alone or "
                         "prefill-busy-together condition)")
    return statistics.pstdev(gaps) / statistics.fmean(gaps)


def run(router_url: str, prefill_url: str, decode_url: str, *, out: Path | None = None,
        deployment: str | None = None, **options: Any) -> dict[str, Any]:
    """Probe and write the result under data/results/transfer/ (or `out`); returns it with its `path`."""
    rows = probe(router_url, prefill_url, decode_url, **options)
    settings = {k: v for k, v in options.items() if k in ("prompt_tokens", "busy_tokens", "repeats")}
    result = {"deployment": deployment, "router": router_url, "prefill": prefill_url, "decode": decode_url,
              **settings, "summary": summarize(rows), "trials": rows}
    path = results.write("transfer", result, out)
    return {**result, "path": str(path)}
