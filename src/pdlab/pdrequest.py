"""One request through the P/D path: prefill on one vLLM instance, decode on another, KV cache moved between
them by the KV connector (vLLM's `kv_transfer_params` protocol).

1. Send the request to the prefill instance with `max_tokens=1`, `stream=false` and
   `kv_transfer_params={"do_remote_decode": true, ...}`: it computes the prompt's KV cache and keeps it for pickup.
2. Copy the `kv_transfer_params` of its response, unchanged, into the same request sent to the decode instance:
   the decode instance pulls the KV blocks (NIXL) and generates the answer as if it had read the prompt itself.

LMCache's P/D (LMCacheConnectorV1, the cluster tier) runs the other way round: prefill *pushes* the KV to a decode
replica named in advance. The prefill request carries `kv_transfer_params={"disagg_spec": ...}` (see
`lmcache_kv_params`); the decode request is the client's request unchanged, and the decode instance finds the
pushed chunks by their token hashes. The router speaks both (`kv_protocol`).

The router builds on these functions; notebooks and the demo use the synchronous `pd_completion`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdlab.sse import STREAM_OPTIONS, StreamRecord

#: What the prefill request carries: "keep this KV cache for a remote decoder".
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class UpstreamError(RuntimeError):
    """An instance answered with an error or not at all; `stage` says which leg (`prefill` or `decode`)."""

    def __init__(self, stage: str, message: str, status_code: int = 502, body: Any = None):
        super().__init__(f"{stage}: {message}")
        self.stage = stage
        self.status_code = status_code
        self.body = body


def lmcache_kv_params(req_id: str, receiver_host: str, init_ports: list[int], alloc_ports: list[int]
                      ) -> dict[str, Any]:
    """The prefill request's `kv_transfer_params` under LMCache's P/D protocol: push this prompt's KV to the decode
    replica at `receiver_host`, prefill rank i to `init_ports[i]`/`alloc_ports[i]` (its `pd_peer_init_port` and
    `pd_peer_alloc_port` lists). LMCache 0.5 requires all four keys; `req_id` only labels the transfer (it is what
    LMCache's proxy notification would carry), so the decode request needs neither it nor any kv_transfer_params."""
    return {"disagg_spec": {"req_id": req_id, "receiver_host": receiver_host,
                            "receiver_init_port": list(init_ports), "receiver_alloc_port": list(alloc_ports)}}


def prefill_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any]:
    """The request the prefill instance gets: one token, no streaming, asking to keep the KV for decode (NIXL's
    `PREFILL_KV_PARAMS` unless other `kv_transfer_params` are given, e.g. LMCache's `lmcache_kv_params`)."""
    out = dict(body)  # only top-level keys change; nested values are shared, never mutated (a deep copy costs)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS if kv_transfer_params is None else kv_transfer_params)
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The request the decode instance gets: the original, plus the prefill's kv_transfer_params unchanged."""
    out = dict(body)
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = kv_transfer_params
    return out


async def prefill(
    client: httpx.AsyncClient,
    prefill_url: str,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run the prefill leg; returns the prefill instance's whole JSON response (its `kv_transfer_params` inside)."""
    try:
        response = await client.post(prefill_url.rstrip("/") + path, json=prefill_body(body), headers=headers)
    except httpx.HTTPError as error:
        raise UpstreamError("prefill", f"{type(error).__name__}: {error}") from error
    if response.status_code != 200:
        raise UpstreamError("prefill", f"HTTP {response.status_code}: {response.text[:500]}",
                            status_code=response.status_code, body=_json_or_text(response))
    return response.json()


async def stream_decode(
    client: httpx.AsyncClient,
    decode_url: str,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> AsyncIterator[bytes]:
    """Stream the decode leg's raw response bytes (SSE when `body["stream"]`)."""
    request = client.build_request("POST", decode_url.rstrip("/") + path, json=body, headers=headers)
    try:
        response = await client.send(request, stream=True)
    except httpx.HTTPError as error:
        raise UpstreamError("decode", f"{type(error).__name__}: {error}") from error
    try:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            raise UpstreamError("decode", f"HTTP {response.status_code}: {text[:500]}",
                                status_code=response.status_code, body=text)
        async for chunk in response.aiter_raw():
            yield chunk
    finally:
        await response.aclose()


def _json_or_text(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


@dataclass
class PDCompletion:
    """What one P/D request did, for printing and checks."""

    text: str
    token_ids: list[int] | None
    prompt_tokens: int | None
    completion_tokens: int | None
    kv_transfer_params: dict[str, Any] | None
    prefill_s: float
    ttft_s: float
    e2e_s: float
    token_times_s: list[float] = field(default_factory=list)


async def pd_completion_async(
    prefill_url: str,
    decode_url: str,
    model: str,
    prompt: str,
    max_tokens: int = 16,
    stream: bool = True,
    timeout_s: float = 600.0,
    extra: dict[str, Any] | None = None,
) -> PDCompletion:
    """A greedy `/v1/completions` request via prefill → decode, timed from the client's side."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": stream, "ignore_eos": True, **(extra or {})}
    if stream:
        body["stream_options"] = STREAM_OPTIONS
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        start = time.perf_counter()
        prefilled = await prefill(client, prefill_url, "/v1/completions", body)
        prefill_s = time.perf_counter() - start
        params = prefilled.get("kv_transfer_params")
        token_times: list[float] = []
        usage: dict[str, Any] = {}
        if stream:
            record = StreamRecord()
            async for chunk in stream_decode(client, decode_url, "/v1/completions", decode_body(body, params)):
                record.feed_bytes(chunk, time.perf_counter() - start)
            if record.error:
                raise UpstreamError("decode", record.error)
            usage = {"prompt_tokens": record.usage_prompt_tokens, "completion_tokens": record.usage_completion_tokens}
            text, token_ids, token_times = record.text, None, record.token_times
        else:
            raw = b"".join([c async for c in stream_decode(client, decode_url, "/v1/completions",
                                                           decode_body(body, params))])
            payload = json.loads(raw)
            usage = payload.get("usage") or {}
            choice = payload["choices"][0]
            text, token_ids = choice["text"], choice.get("token_ids")
            token_times.append(time.perf_counter() - start)
        end = time.perf_counter() - start
    return PDCompletion(
        text=text,
        token_ids=token_ids,
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        kv_transfer_params=params,
        prefill_s=prefill_s,
        ttft_s=token_times[0] if token_times else end,
        e2e_s=end,
        token_times_s=token_times,
    )


def pd_completion(*args: Any, **kwargs: Any) -> PDCompletion:
    """Synchronous `pd_completion_async`, for scripts. In Jupyter (a running loop), await the async one."""
    import asyncio

    return asyncio.run(pd_completion_async(*args, **kwargs))
