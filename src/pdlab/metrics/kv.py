"""KV-transfer figures from a vLLM instance's Prometheus `/metrics` text (NixlConnector).

vLLM 0.32 (`vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py`) exports, per engine:
histograms `vllm:nixl_xfer_time_seconds` (transfer duration), `vllm:nixl_post_time_seconds` (time to post the
transfer), `vllm:nixl_bytes_transferred` (bytes per transfer), `vllm:nixl_num_descriptors`; counters
`vllm:nixl_num_failed_transfers`, `vllm:nixl_num_failed_notifications`, `vllm:nixl_num_kv_expired_reqs`,
`vllm:nixl_num_notifications_after_expiry`. They are recorded on the instance that pulls the KV (the decode
side), cumulative since start: scrape before and after a run and subtract. Beside them, every engine's
`vllm:num_preemptions` counter: requests whose KV was dropped because the cache ran out (recomputed later), and its
prefix-cache counters `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` (prompt tokens looked up in the prefix
cache, and found there), and `vllm:external_prefix_cache_queries` / `_hits`: the same for its KV connector (LMCache:
prompt tokens pushed to a decode instance and taken from there instead of computed).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdlab.lmcache.figures import VLLM_CONNECTOR_HITS, VLLM_CONNECTOR_QUERIES
from pdlab.settings import (
    KV_WAIT_MS_HEADER,
    PATH_HEADER,
    PREFILL_MS_HEADER,
    REASON_HEADER,
    REQUEST_ID_HEADER,
    VLLM_CPU_BLOCK_SIZE,
)

XFER_TIME = "vllm:nixl_xfer_time_seconds"
POST_TIME = "vllm:nixl_post_time_seconds"
BYTES = "vllm:nixl_bytes_transferred"
DESCRIPTORS = "vllm:nixl_num_descriptors"
FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers"
FAILED_NOTIFICATIONS = "vllm:nixl_num_failed_notifications"
KV_EXPIRED = "vllm:nixl_num_kv_expired_reqs"
PREEMPTIONS = "vllm:num_preemptions"
PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"


@dataclass(frozen=True)
class KVTransferStats:
    """Totals over all engines of one instance (or a difference of two scrapes)."""

    transfers: float = 0
    """Completed transfers (count of the transfer-time histogram)."""
    bytes: float = 0
    """Bytes moved, summed over transfers."""
    xfer_seconds: float = 0
    """Transfer time, summed over transfers."""
    post_seconds: float = 0
    """Time spent posting transfers, summed."""
    descriptors: float = 0
    """Descriptors, summed over transfers."""
    failed_transfers: float = 0
    failed_notifications: float = 0
    kv_expired: float = 0
    preemptions: float = 0
    """Requests preempted (their KV dropped for lack of cache, to be recomputed)."""
    prefix_queried_tokens: float = 0
    """Prompt tokens looked up in the prefix cache (instances with prefix caching on)."""
    prefix_hit_tokens: float = 0
    """Of those, tokens found there: their KV was reused, not computed."""
    connector_queried_tokens: float = 0
    """Prompt tokens vLLM asked its KV connector about (LMCache: pushed to a decode instance)."""
    connector_hit_tokens: float = 0
    """Of those, tokens vLLM took from the connector instead of computing them."""

    def __sub__(self, earlier: KVTransferStats) -> KVTransferStats:
        return KVTransferStats(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def __add__(self, other: KVTransferStats) -> KVTransferStats:
        return KVTransferStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def mean_bytes(self) -> float | None:
        return self.bytes / self.transfers if self.transfers else None

    @property
    def mean_xfer_ms(self) -> float | None:
        return self.xfer_seconds * 1000 / self.transfers if self.transfers else None

    @property
    def throughput_mb_s(self) -> float | None:
        """Bytes over transfer time (MB = 1e6 bytes): the link speed while transferring."""
        return self.bytes / self.xfer_seconds / 1e6 if self.xfer_seconds else None

    @property
    def prefix_hit_rate(self) -> float | None:
        """Share of looked-up prompt tokens found in the prefix cache."""
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else None

    @property
    def connector_hit_rate(self) -> float | None:
        """Share of the prompt tokens vLLM took from its KV connector (LMCache's CPU tier, or a push), where
        prompt tokens are those looked up in the prefix cache (instances with prefix caching on) or else those it
        asked the connector about."""
        prompt = self.prefix_queried_tokens or self.connector_queried_tokens
        return self.connector_hit_tokens / prompt if prompt else None

    def as_dict(self) -> dict:
        return {**asdict(self), "mean_bytes": self.mean_bytes, "mean_xfer_ms": self.mean_xfer_ms,
                "throughput_mb_s": self.throughput_mb_s, "prefix_hit_rate": self.prefix_hit_rate,
                "connector_hit_rate": self.connector_hit_rate}


def reuse_line(kv: dict) -> str | None:
    """Where a scenario's prompt tokens came from, in words, from its summary's `kv_transfer` block: vLLM's prefix
    cache, its KV connector (LMCache's CPU tier), or computed. None where it does not apply: no prefix cache
    (nothing was looked up), or NIXL pulls (prompt tokens counted on both instances of a pair)."""
    queried = kv.get("prefix_queried_tokens") or 0
    if not queried or kv.get("transfers"):
        return None
    cached, loaded = kv.get("prefix_hit_tokens") or 0, kv.get("connector_hit_tokens") or 0
    computed = queried - cached - loaded
    return (f"prompt tokens: {cached / queried:.0%} from vLLM's prefix cache, {loaded / queried:.0%} loaded from "
            f"LMCache (its KV connector), {computed / queried:.0%} computed ({queried:,.0f} in all)")


def lmcache_line(kv: dict) -> str | None:
    """What LMCache's P/D did in a scenario, in words, from its `kv_transfer` block's `lmcache` account
    (pdlab.lmcache.figures.pd_account); None where LMCache did not move the KV."""
    pd_ = kv.get("lmcache")
    if not pd_:
        return None

    def ms(block: dict) -> str:
        return "-" if block["median"] is None else f"{block['median']:.1f} ms"

    return (f"LMCache pushed the KV of {pd_['pushed']} of {pd_['disaggregated']} prompts sent through prefill -> "
            f"decode ({pd_['pushed_tokens']:,} tokens; {ms(pd_['push_ms'])} per push, median) right after their "
            f"prefill; the decode instance loaded {pd_['loaded_in_full']} of them in full ({ms(pd_['load_ms'])} per "
            f"load) and recomputed {pd_['recomputed']} (LMCache's log lines)")


def parse_kv_transfer(text: str) -> KVTransferStats:
    """Sum vLLM's NIXL metrics over every label set (engines, models) in a Prometheus text exposition.
    Metrics that are absent (no NixlConnector, or no transfer yet) count as zero."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return KVTransferStats(
        transfers=sums.get(f"{XFER_TIME}_count", 0.0),
        bytes=sums.get(f"{BYTES}_sum", 0.0),
        xfer_seconds=sums.get(f"{XFER_TIME}_sum", 0.0),
        post_seconds=sums.get(f"{POST_TIME}_sum", 0.0),
        descriptors=sums.get(f"{DESCRIPTORS}_sum", 0.0),
        failed_transfers=sums.get(f"{FAILED_TRANSFERS}_total", 0.0),
        failed_notifications=sums.get(f"{FAILED_NOTIFICATIONS}_total", 0.0),
        kv_expired=sums.get(f"{KV_EXPIRED}_total", 0.0),
        preemptions=sums.get(f"{PREEMPTIONS}_total", 0.0),
        prefix_queried_tokens=sums.get(f"{PREFIX_QUERIES}_total", 0.0),
        prefix_hit_tokens=sums.get(f"{PREFIX_HITS}_total", 0.0),
        connector_queried_tokens=sums.get(f"{VLLM_CONNECTOR_QUERIES}_total", 0.0),
        connector_hit_tokens=sums.get(f"{VLLM_CONNECTOR_HITS}_total", 0.0),
    )


def scrape_kv_transfer(base_url: str, timeout_s: float = 5.0) -> KVTransferStats:
    """GET `<base_url>/metrics` and parse the NIXL figures."""
    response = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout_s)
    response.raise_for_status()
    return parse_kv_transfer(response.text)


@dataclass(frozen=True)
class TransferTrace:
    """One request through prefill -> decode, timed from the client and from what moved its KV cache: the parts of
    its time to first token. With NIXL (`trace_pd_request`) the decode instance pulls the KV after the prefill
    answered, and vLLM times the read; with LMCache (`trace_lmcache_request`) the prefill instance pushes it, and
    the router waits for the push's report before it sends the decode request."""

    prompt_tokens: int
    prefill_s: float
    """Until the prefill instance answered (its queue and the prompt's prefill)."""
    decode_first_token_s: float
    """From the prefill's answer until the first token (wait, transfer, first decode step)."""
    transfer_s: float
    """The KV's move. NIXL: the read as vLLM timed it on the decode instance (`vllm:nixl_xfer_time_seconds`).
    LMCache: the prefill's answer until the push was reported landed (the router's `x-pdlab-kv-wait-ms`): the part
    of the push that did not overlap the prefill."""
    bytes: float
    """KV bytes moved. NIXL: the read's (`vllm:nixl_bytes_transferred`). LMCache: the push's, as its log line
    gives them (GiB to four decimals: `pdlab.lmcache.figures.LOGGED_SIZE_STEP`)."""
    step_s: float
    """One decode step of this request: the median gap between its later tokens."""
    blocks: int
    """Units of KV moved: vLLM's blocks the prefill instance handed over (NIXL, `remote_block_ids`), or LMCache's
    chunks pushed (the last one of either partly filled, and moved whole)."""
    block_tokens: int = VLLM_CPU_BLOCK_SIZE
    """Tokens per unit: vLLM's block size (NIXL), LMCache's `chunk_size` (LMCache)."""
    connector: str = "nixl"
    """What moved the KV: `nixl` (pulled) or `lmcache` (pushed)."""

    @property
    def unit(self) -> str:
        """What `blocks` counts: `block` (vLLM's, NIXL) or `chunk` (LMCache's)."""
        return "chunk" if self.connector == "lmcache" else "block"

    @property
    def wait_s(self) -> float:
        """The rest of the time after the prefill's answer: the HTTP hop, scheduling, and with NIXL the handshake,
        posting the read and any wait for a busy sender (a prefill instance computing serves reads only between
        steps); with LMCache, loading the pushed KV into vLLM's cache."""
        return max(0.0, self.decode_first_token_s - self.transfer_s - self.step_s)

    @property
    def throughput_mb_s(self) -> float | None:
        return self.bytes / self.transfer_s / 1e6 if self.transfer_s else None


def handed_over_blocks(kv_transfer_params: dict | None) -> int:
    """KV blocks a prefill instance's answer hands over: its `remote_block_ids`, which vLLM 0.32 lists per KV cache
    group (one list per group; one group for these models)."""
    ids = (kv_transfer_params or {}).get("remote_block_ids") or []
    return sum(len(group) if isinstance(group, list) else 1 for group in ids)


async def trace_pd_request(prefill_url: str, decode_url: str, model: str, prompt: str,
                           max_tokens: int = 8) -> TransferTrace:
    """Send one request through prefill -> decode by hand (`pdlab.pdrequest`), scraping the decode instance's NIXL
    figures before and after, and return its parts. Run requests one at a time: the scrape difference is the
    traced request's only if nothing else moves KV to that decode instance meanwhile."""
    import asyncio
    import itertools
    import statistics

    from pdlab.pdrequest import pd_completion_async

    before = await asyncio.to_thread(scrape_kv_transfer, decode_url)
    answer = await pd_completion_async(prefill_url, decode_url, model, prompt, max_tokens=max(3, max_tokens))
    moved = await asyncio.to_thread(scrape_kv_transfer, decode_url) - before
    times = answer.token_times_s
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    return TransferTrace(
        prompt_tokens=answer.prompt_tokens or 0, prefill_s=answer.prefill_s,
        decode_first_token_s=answer.ttft_s - answer.prefill_s, transfer_s=moved.xfer_seconds, bytes=moved.bytes,
        step_s=statistics.median(gaps) if gaps else 0.0,
        blocks=handed_over_blocks(answer.kv_transfer_params))


async def trace_lmcache_request(router_url: str, model: str, prompt: str, *, sender_log: str | Path,
                                receiver_log: str | Path, chunk_tokens: int, max_tokens: int = 8,
                                request_id: str | None = None) -> TransferTrace:
    """Send one request through the router of an LMCache P/D deployment (`connector.kind: lmcache`) and return its
    parts: the router prefills it on the prefill instance, which pushes the prompt's KV to the decode instance the
    router named and reports the push; the router then sends the decode request. The times come from the router's
    headers (`x-pdlab-prefill-ms`, `x-pdlab-kv-wait-ms`) and the stream; what moved from LMCache's own log lines on
    the sender (`sender_log`; `receiver_log` must show the load, or the decode instance recomputed the prompt).
    The router must send the prompt through prefill -> decode (its threshold at most the prompt's tokens)."""
    import asyncio
    import itertools
    import math
    import statistics
    import time
    import uuid

    from pdlab.lmcache.figures import log_end, logged_tokens
    from pdlab.sse import STREAM_OPTIONS, StreamRecord

    rid = request_id or f"trace-{uuid.uuid4().hex[:12]}"
    since = {path: log_end(path) for path in (sender_log, receiver_log)}
    body = {"model": model, "prompt": prompt, "max_tokens": max(3, max_tokens), "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": STREAM_OPTIONS}
    record = StreamRecord()
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        async with client.stream("POST", router_url.rstrip("/") + "/v1/completions", json=body,
                                 headers={REQUEST_ID_HEADER: rid}) as response:
            if response.status_code != 200:
                raise RuntimeError(f"the router answered {response.status_code}: {(await response.aread())[:300]!r}")
            headers = response.headers
            async for chunk in response.aiter_raw():
                record.feed_bytes(chunk, time.perf_counter() - start)
    if record.error or not record.token_times:
        raise RuntimeError(f"request {rid}: the stream ended with no tokens ({record.error or 'no error given'})")
    if headers.get(PATH_HEADER) != "disaggregated":
        raise ValueError(f"the router served this {record.usage_prompt_tokens}-token prompt "
                         f"{headers.get(PATH_HEADER)} ({headers.get(REASON_HEADER)}), not through prefill -> decode: "
                         "set router.threshold at or below the prompt's tokens")
    pushed = (await asyncio.to_thread(logged_tokens, sender_log, since[sender_log])).get(rid, {})
    loaded = (await asyncio.to_thread(logged_tokens, receiver_log, since[receiver_log])).get(rid, {})
    if not pushed.get("stored") or not loaded.get("retrieved"):
        raise RuntimeError(f"request {rid}: LMCache logged {pushed.get('stored', 0):.0f} tokens pushed and "
                           f"{loaded.get('retrieved', 0):.0f} loaded: the decode instance recomputed the prompt")
    prefill_s = float(headers[PREFILL_MS_HEADER]) / 1e3
    gaps = [later - earlier for earlier, later in itertools.pairwise(record.token_times)]
    return TransferTrace(
        prompt_tokens=record.usage_prompt_tokens or 0, prefill_s=prefill_s,
        decode_first_token_s=record.token_times[0] - prefill_s,
        transfer_s=float(headers.get(KV_WAIT_MS_HEADER, 0.0)) / 1e3, bytes=pushed["stored_bytes"],
        step_s=statistics.median(gaps) if gaps else 0.0,
        blocks=math.ceil(pushed["stored"] / chunk_tokens), block_tokens=chunk_tokens, connector="lmcache")


async def trace_request(deployment: Any, prompt: str, max_tokens: int = 8) -> TransferTrace:
    """One request through a running 1P1D deployment's prefill -> decode path, traced by what moves its KV:
    `trace_lmcache_request` through its router when LMCache pushes it (`connector.kind: lmcache`; a request without
    LMCache's `disagg_spec` must never reach its prefill instance), `trace_pd_request` by hand otherwise (NIXL)."""
    spec = deployment.spec
    prefill, decode = (next(i for i in deployment.instances if i.spec.role == role) for role in ("prefill", "decode"))
    if spec.connector.kind == "lmcache":
        if not deployment.router_url:
            raise ValueError("an LMCache P/D deployment is traced through its router: give the spec a `router`")
        return await trace_lmcache_request(deployment.router_url, deployment.served_model, prompt,
                                           sender_log=prefill.log_path, receiver_log=decode.log_path,
                                           chunk_tokens=spec.connector.lmcache.chunk_size, max_tokens=max_tokens)
    return await trace_pd_request(prefill.url, decode.url, deployment.served_model, prompt, max_tokens=max_tokens)
