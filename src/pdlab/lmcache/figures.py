"""LMCache's own figures, read back from an instance: the counters LMCache keeps in each vLLM process, served as
Prometheus text by LMCache's internal HTTP server (`internal_api_server_*` in its config; pdlab turns it on with
`connector.lmcache.api_port`). The scheduler side listens on the first port, the worker side (where chunks are
stored, pushed and loaded) on the next. LMCache folds its statistics into these counters every 10 s, so a figure
read right after a request may not count it yet (`settled_figures` waits until they stop moving).

LMCache also logs each request's store and load (`logged_tokens`), which is what tests read per request.

Beside them, vLLM's own view: `vllm:external_prefix_cache_hits` on an instance's /metrics counts prompt tokens
vLLM took from its KV connector instead of computing them (see pdlab.metrics.kv).
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

#: vLLM's counter of prompt tokens taken from the KV connector (LMCache) rather than computed, per instance.
VLLM_CONNECTOR_HITS = "vllm:external_prefix_cache_hits"
#: vLLM's counter of prompt tokens it asked the KV connector about.
VLLM_CONNECTOR_QUERIES = "vllm:external_prefix_cache_queries"

#: LMCache's stats logger folds its statistics into the Prometheus counters this often (cache_engine.py).
FOLD_INTERVAL_S = 10.0

_COUNTERS = {
    "stored_tokens": "lmcache:num_stored_tokens",
    "hit_tokens": "lmcache:num_hit_tokens",
    "requested_tokens": "lmcache:num_requested_tokens",
    "lookup_tokens": "lmcache:num_lookup_tokens",
    "lookup_hits": "lmcache:num_lookup_hits",
    "store_requests": "lmcache:num_store_requests",
    "retrieve_requests": "lmcache:num_retrieve_requests",
}


@dataclass(frozen=True)
class LMCacheFigures:
    """LMCache's counters of one instance (both its processes), or the difference of two readings."""

    stored_tokens: float = 0
    """Tokens whose KV LMCache stored: into its CPU tier (offload) or, on a P/D sender, pushed to a receiver."""
    hit_tokens: float = 0
    """Tokens whose KV LMCache loaded into vLLM's cache (from its CPU tier, or pushed by a sender)."""
    requested_tokens: float = 0
    """Tokens LMCache was asked to load."""
    lookup_tokens: float = 0
    """Prompt tokens the scheduler looked up in LMCache."""
    lookup_hits: float = 0
    """Of those, tokens LMCache held."""
    store_requests: float = 0
    retrieve_requests: float = 0

    def __sub__(self, earlier: LMCacheFigures) -> LMCacheFigures:
        return LMCacheFigures(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def __add__(self, other: LMCacheFigures) -> LMCacheFigures:
        return LMCacheFigures(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def hit_rate(self) -> float | None:
        """Share of looked-up prompt tokens LMCache held."""
        return self.lookup_hits / self.lookup_tokens if self.lookup_tokens else None

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}


def parse_figures(text: str) -> LMCacheFigures:
    """LMCache's counters in a Prometheus text exposition, summed over label sets (absent ones count zero)."""
    sums = _sums(text)
    return LMCacheFigures(**{field: sums.get(f"{name}_total", 0.0) for field, name in _COUNTERS.items()})


def _sums(text: str) -> dict[str, float]:
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def connector_hit_tokens(instance_url: str, timeout_s: float = 5.0) -> float:
    """vLLM's own count, on one instance, of prompt tokens it took from LMCache (at once, unlike LMCache's)."""
    response = httpx.get(instance_url.rstrip("/") + "/metrics", timeout=timeout_s)
    response.raise_for_status()
    return _sums(response.text).get(f"{VLLM_CONNECTOR_HITS}_total", 0.0)


def api_urls(config: dict | None) -> list[str]:
    """The URLs of LMCache's HTTP servers in an instance with this LMCache config (scheduler, worker)."""
    if not config or not config.get("internal_api_server_enabled"):
        return []
    host, start = config.get("internal_api_server_host", "127.0.0.1"), config["internal_api_server_port_start"]
    return [f"http://{host}:{start}", f"http://{host}:{start + 1}"]


def read_figures(urls: list[str], timeout_s: float = 5.0) -> LMCacheFigures:
    """The counters of one instance now (its LMCache HTTP servers' /metrics, added up)."""
    total = LMCacheFigures()
    for url in urls:
        response = httpx.get(url + "/metrics", timeout=timeout_s)
        response.raise_for_status()
        total = total + parse_figures(response.text)
    return total


def settled_figures(urls: list[str], timeout_s: float = 3 * FOLD_INTERVAL_S) -> LMCacheFigures:
    """The counters once LMCache has folded in everything done so far: read until two readings one fold interval
    apart agree (or `timeout_s` passes)."""
    deadline = time.monotonic() + timeout_s
    last = read_figures(urls)
    while time.monotonic() < deadline:
        time.sleep(FOLD_INTERVAL_S + 0.5)
        now = read_figures(urls)
        if now == last:
            return now
        last = now
    return last


#: LMCache's log lines for one request's store (a push, on a sender) and load, as LMCache 0.5 writes them, with
#: the time LMCache took (`cost`: a store's copy out of vLLM's cache and its put, the push on a P/D sender; a load's
#: copy into vLLM's cache); vLLM names the request `cmpl-<x-request-id>-<n>-<suffix>`.
_STORED = re.compile(r"\[req_id=cmpl-(?P<rid>.+?)-\d+-[0-9a-f]+\] Stored (?P<n>\d+) out of total \d+ tokens"
                     r"(?:.*? size: (?P<gib>[\d.]+) gb)?(?:.*? cost (?P<ms>[\d.]+) ms)?", re.IGNORECASE)
_RETRIEVED = re.compile(r"\[req_id=cmpl-(?P<rid>.+?)-\d+-[0-9a-f]+\] Retrieved (?P<n>\d+) out of \d+ required"
                        r"(?:.*? size: (?P<gib>[\d.]+) gb)?(?:.*? cost (?P<ms>[\d.]+) ms)?", re.IGNORECASE)
#: LMCache logs a store's or load's size in GiB (bytes / 2**30, "GB" in its text) to four decimals: this many bytes.
LOGGED_SIZE_STEP = 1e-4 * 2**30


def logged_tokens(log_path: str | Path, since: int = 0) -> dict[str, dict[str, float]]:
    """Per request (by the x-request-id it was sent with): the tokens LMCache logged as `stored` (on a P/D sender:
    pushed) and `retrieved` (loaded into vLLM) in one instance's log, the milliseconds it logged for each
    (`stored_ms`, `retrieved_ms`) and their size in bytes (`stored_bytes`, `retrieved_bytes`: LMCache logs GiB to
    four decimals, so each line's is known to `LOGGED_SIZE_STEP`), from byte `since` on (`log_end` before a load).
    At once and per request, where the counters lag and add up."""
    found: dict[str, dict[str, float]] = {}
    with open(log_path, "rb") as log:
        log.seek(since)
        text = log.read().decode(errors="replace")
    for line in text.splitlines():
        for what, pattern in (("stored", _STORED), ("retrieved", _RETRIEVED)):
            if match := pattern.search(line):
                counts = found.setdefault(match["rid"], dict.fromkeys(
                    ("stored", "retrieved", "stored_ms", "retrieved_ms", "stored_bytes", "retrieved_bytes"), 0.0))
                counts[what] += int(match["n"])
                counts[f"{what}_ms"] += float(match["ms"] or 0.0)
                counts[f"{what}_bytes"] += float(match["gib"] or 0.0) * 2**30
    return found


def log_end(log_path: str | Path) -> int:
    """Where an instance's log ends now: `logged_tokens(path, since=...)` then reads only what comes after."""
    path = Path(log_path)
    return path.stat().st_size if path.exists() else 0


def pd_account(prompts: Mapping[str, int], sender_logs: Mapping[Path, int],
               receiver_logs: Mapping[Path, int]) -> dict[str, Any]:
    """What LMCache's P/D did for these requests (the completed ones the router sent through prefill -> decode:
    x-request-id -> prompt tokens), from its own log lines: how many it pushed from a sender, the tokens pushed and
    the time LMCache logged per push (`push_ms`: median and max); how many a receiver loaded, the tokens loaded,
    the time per load (`load_ms`), and how many it loaded in full (every prompt token but the last, which vLLM
    computes to sample from); the rest the decode instance recomputed, in part or whole. Each log is read from
    the offset it maps to (`log_end` before the load)."""

    def merged(logs: Mapping[Path, int], what: str) -> list[tuple[int, float]]:
        """(tokens, ms) per prompt, in `prompts`' order, summed over `logs`."""
        total = {rid: (0, 0.0) for rid in prompts}
        for path, since in logs.items():
            for rid, counts in logged_tokens(path, since).items():
                if rid in total:
                    tokens, ms = total[rid]
                    total[rid] = (tokens + int(counts[what]), ms + counts[f"{what}_ms"])
        return list(total.values())

    def times(done: list[tuple[int, float]]) -> dict[str, float | None]:
        ms = sorted(ms for tokens, ms in done if tokens)
        return {"median": statistics.median(ms) if ms else None, "max": ms[-1] if ms else None}

    pushed, loaded = merged(sender_logs, "stored"), merged(receiver_logs, "retrieved")
    full = sum(1 for (tokens, _), wanted in zip(loaded, prompts.values(), strict=True) if tokens >= wanted - 1)
    return {"disaggregated": len(prompts),
            "pushed": sum(1 for tokens, _ in pushed if tokens), "pushed_tokens": sum(t for t, _ in pushed),
            "push_ms": times(pushed),
            "loaded": sum(1 for tokens, _ in loaded if tokens), "loaded_tokens": sum(t for t, _ in loaded),
            "load_ms": times(loaded), "loaded_in_full": full, "recomputed": len(prompts) - full}
