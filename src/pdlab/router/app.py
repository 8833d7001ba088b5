"""The router's HTTP app: OpenAI-compatible endpoints in front of a prefill pool and a decode pool.

Per request: check the body, count the prompt's tokens with the served model's tokenizer, pick the path
(`decide_path`), pick replicas (each pool's strategy), run prefill (P/D path) and relay the decode leg's answer.
The P/D legs speak the `kv_protocol` in force: `nixl` (prefill first; decode gets the kv_transfer_params prefill
returned) or `lmcache` (decode replica chosen first and named in prefill's disagg_spec; decode gets the plain
request).
All I/O is async: aiohttp to upstream (its C HTTP parser and simple connection pool cost a fraction of httpx's
per call, which dominated the router's overhead), starlette + uvicorn towards clients. Routing decisions are the
pure functions of `pdlab.router.strategies`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pdlab.config.base import ConfigError, validate
from pdlab.config.router import KVProtocol, LMCacheReceiverPorts, RouterSettings, RouterSpec
from pdlab.pdrequest import decode_body, lmcache_kv_params, prefill_body
from pdlab.router.metrics import RouterMetrics
from pdlab.router.pool import Pool, Replica
from pdlab.router.strategies import NEEDS_LOAD_METRICS, RequestFeatures, block_hashes, decide_path
from pdlab.router.tokens import PromptError, PromptTokenizer
from pdlab.router.validation import RequestError, check_prompt_length, check_request, error_body, error_response
from pdlab.settings import (
    ADMIN_TOKEN_ENV,
    DECODE_REPLICA_HEADER,
    HTTP_KEEP_ALIVE_S,
    PATH_HEADER,
    PREFILL_MS_HEADER,
    PREFILL_REPLICA_HEADER,
    PROMPT_TOKENS_HEADER,
    REQUEST_ID_HEADER,
)

log = logging.getLogger("pdlab.router")

#: Seconds between scrapes of vLLM's load gauges, when a strategy in force uses them.
SCRAPE_INTERVAL_S = 1.0
#: What a client is told to wait when the router is full.
RETRY_AFTER_S = 1
#: Settings GET /admin/config shows that PUT cannot change: they must match how the instances were started.
READ_ONLY_SETTINGS = ("kv_protocol", "lmcache_receivers")


@dataclass(frozen=True)
class Upstreams:
    """What the router fronts: the pools' URLs and the served model."""

    prefill_urls: list[str]
    decode_urls: list[str]
    served_model: str
    tokenizer_dir: str
    max_model_len: int | None = None
    """Context length; None reads `max_position_embeddings` from the model directory's config.json."""
    block_size: int = 16
    """Tokens per KV block, for the block hashes of the prefix/KV-aware strategies."""
    lmcache_receiver: LMCacheReceiverPorts | None = None
    """The decode replicas' LMCache receiver ports (kv_protocol `lmcache`); each replica's receiver host is the
    host of its URL."""


@dataclass(frozen=True)
class Receiver:
    """Where LMCache's sender pushes a prompt's KV for one decode replica (the disagg_spec's fields)."""

    host: str
    init_ports: list[int]
    alloc_ports: list[int]

    def as_dict(self) -> dict[str, Any]:
        return {"receiver_host": self.host, "receiver_init_port": self.init_ports,
                "receiver_alloc_port": self.alloc_ports}


class Router:
    """Request handling state: settings in force, pools, the upstream client, counters."""

    def __init__(self, spec: RouterSpec, upstreams: Upstreams):
        if not upstreams.decode_urls:
            raise ValueError("the router needs at least one decode (or colocated) instance")
        self.spec = spec
        self.upstreams = upstreams
        self.settings = RouterSettings(**{k: getattr(spec, k) for k in RouterSettings.model_fields})
        self.prefill_pool = Pool("prefill", upstreams.prefill_urls, self.settings.prefill_strategy)
        self.decode_pool = Pool("decode", upstreams.decode_urls, self.settings.decode_strategy)
        self.tokenizer = PromptTokenizer(upstreams.tokenizer_dir)
        self.max_model_len = upstreams.max_model_len or _model_context(upstreams.tokenizer_dir)
        self.admin_token = spec.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None
        self.kv_protocol: KVProtocol = spec.kv_protocol or "nixl"
        self.receivers = self._receivers(upstreams) if self.kv_protocol == "lmcache" else {}
        self.metrics = RouterMetrics()
        self.metrics.threshold.set(self.settings.threshold)
        self.in_flight = 0
        self.client: aiohttp.ClientSession | None = None

    def _receivers(self, upstreams: Upstreams) -> dict[str, Receiver]:
        """Each decode replica's LMCache receiver, by replica URL: the URL's host (the receiver listens on every
        address of the replica) and the ports every replica shares."""
        ports = upstreams.lmcache_receiver
        if ports is None:
            raise ValueError("kv_protocol `lmcache` needs the decode replicas' LMCache receiver ports "
                             "(--lmcache-init-ports and --lmcache-alloc-ports: their pd_peer_init_port and "
                             "pd_peer_alloc_port lists)")
        receivers = {}
        for replica in self.decode_pool.replicas:
            host = urlsplit(replica.url).hostname
            if not host:
                raise ValueError(f"decode URL {replica.url!r} has no host to name as LMCache receiver")
            receivers[replica.url] = Receiver(host, list(ports.init_ports), list(ports.alloc_ports))
        return receivers

    # --- lifecycle -------------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, _: Starlette) -> AsyncIterator[None]:
        # No total timeout (a long generation is fine); bounded connect, and bounded silence between bytes.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(5.0, self.spec.upstream_timeout_s),
                                        sock_read=self.spec.upstream_timeout_s)
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=HTTP_KEEP_ALIVE_S)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=False,
                                         cookie_jar=aiohttp.DummyCookieJar()) as client:  # upstreams set no cookies
            self.client = client
            scraper = asyncio.create_task(self._scrape_forever())
            try:
                yield
            finally:
                scraper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await scraper
                self.client = None

    async def _scrape_forever(self) -> None:
        # Its own connections: scrapes never queue behind requests.
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as client:
            while True:
                for pool in (self.prefill_pool, self.decode_pool):
                    if pool.strategy_name in NEEDS_LOAD_METRICS:
                        await pool.scrape(client)
                await asyncio.sleep(SCRAPE_INTERVAL_S)

    # --- generation --------------------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        arrived = time.perf_counter()
        request_id = request.headers.get(REQUEST_ID_HEADER) or f"pdlab-{uuid.uuid4().hex}"
        reply_headers = {REQUEST_ID_HEADER: request_id}
        if self.in_flight >= self.spec.max_in_flight:
            self.metrics.rejected.labels("overloaded").inc()
            reply_headers["Retry-After"] = str(RETRY_AFTER_S)
            return error_response(RequestError(503, f"the router has {self.in_flight} requests in flight "
                                               f"(max_in_flight={self.spec.max_in_flight}); retry shortly",
                                               None, "overloaded"), reply_headers)
        self.in_flight += 1
        self.metrics.in_flight.inc()
        handed_over = False  # a streaming response takes over the in-flight slot and releases it when done
        try:
            settings = self.settings  # one consistent snapshot per request, even if PUT /admin/config lands now
            try:
                raw = await request.body()
                try:
                    body = json.loads(raw)
                except ValueError as error:
                    raise RequestError(400, f"malformed JSON body: {error}", None, "invalid_json") from None
                checked = check_request(body, chat, self.upstreams.served_model, self.max_model_len)
                try:
                    prompt = (self.tokenizer.chat(body["messages"], body.get("chat_template_kwargs")) if chat
                              else self.tokenizer.completion(body["prompt"]))
                except PromptError as error:
                    raise RequestError(400, str(error), error.param, "invalid_prompt") from None
                check_prompt_length(prompt.count, self.max_model_len, chat)
            except RequestError as error:
                self.metrics.rejected.labels("bad_request").inc()
                return error_response(error, reply_headers)
            self.metrics.prompt_tokens.observe(prompt.count)
            reply_headers[PROMPT_TOKENS_HEADER] = str(prompt.count)
            session = request.headers.get(self.spec.session_header) or body.get("user")
            needs_hashes = self.prefill_pool.needs_block_hashes or self.decode_pool.needs_block_hashes
            features = RequestFeatures(
                prompt_tokens=prompt.count,
                block_hashes=block_hashes(prompt.token_ids, self.upstreams.block_size) if needs_hashes else (),
                session_key=str(session) if session is not None else None,
            )
            endpoint = "/v1/chat/completions" if chat else "/v1/completions"
            upstream_headers = {REQUEST_ID_HEADER: request_id}
            if auth := request.headers.get("authorization"):
                upstream_headers["authorization"] = auth

            path = decide_path(prompt.count, settings.threshold) if self.prefill_pool.replicas else "direct"
            kv_params = None
            decode_replica: Replica | None = None
            if path == "disaggregated":
                prefill_kv = None
                if self.kv_protocol == "lmcache":
                    # LMCache's prefill pushes the KV to a receiver named in its request, so the decode replica
                    # is chosen before prefill runs, and the decode leg goes to that replica.
                    decode_replica = self.decode_pool.choose(features)
                    assert decode_replica is not None  # the pool is never empty and nothing is excluded yet
                    self.metrics.chose(self.decode_pool, decode_replica.url)
                    receiver = self.receivers[decode_replica.url]
                    prefill_kv = lmcache_kv_params(request_id, receiver.host, receiver.init_ports,
                                                   receiver.alloc_ports)
                if decode_replica is not None:
                    # It is as good as busy with this request already: least-loaded choices meanwhile see that.
                    decode_replica.in_flight += 1
                try:
                    outcome = await self._prefill_leg(features, endpoint, body, upstream_headers, settings.fallback,
                                                      prefill_kv)
                finally:
                    if decode_replica is not None:
                        decode_replica.in_flight -= 1
                if isinstance(outcome, Response):
                    outcome.headers.update(reply_headers)
                    return outcome
                prefill_url, kv_params = outcome
                if self.kv_protocol == "lmcache":
                    # The KV is already on its way to decode_replica, found there by its token hashes: the decode
                    # request is the client's own (prefill's answer carries no transfer handle to pass on).
                    kv_params = None
                if prefill_url is None:
                    path = "direct"  # fell back
                    reply_headers["x-pdlab-fallback"] = "prefill-unavailable"
                else:
                    reply_headers[PREFILL_REPLICA_HEADER] = prefill_url
                    reply_headers[PREFILL_MS_HEADER] = f"{(time.perf_counter() - arrived) * 1e3:.1f}"
            reply_headers[PATH_HEADER] = path
            self.metrics.requests.labels(endpoint, path).inc()
            # The direct path (and LMCache's decode leg) forwards the client's bytes as they came; NIXL's P/D adds
            # the prefill's kv_transfer_params.
            payload = json.dumps(decode_body(body, kv_params)).encode() if kv_params is not None else raw
            response = await self._decode_leg(features, endpoint, payload, checked.stream, upstream_headers,
                                              reply_headers, path, arrived, request_id, decode_replica)
            handed_over = isinstance(response, RelayResponse)
            return response
        finally:
            if not handed_over:
                self._release()

    def _release(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.dec()

    async def _prefill_leg(self, features: RequestFeatures, endpoint: str, body: dict[str, Any],
                           headers: dict[str, str], fallback: str, kv_transfer_params: dict[str, Any] | None = None
                           ) -> tuple[str | None, dict[str, Any] | None] | Response:
        """Prefill on a prefill replica, with `kv_transfer_params` (None: NIXL's). Returns (replica url, the
        answer's kv_transfer_params); (None, None) when the pool failed and the policy is to fall back; an error
        Response when the policy is to fail or the prefill instance refused the request itself (a 4xx the decode
        instance would refuse too)."""
        assert self.client is not None
        tried: set[str] = set()
        reason = "prefill_down"
        payload = json.dumps(prefill_body(body, kv_transfer_params)).encode()
        while (replica := self.prefill_pool.choose(features, exclude=tried)) is not None:
            tried.add(replica.url)
            self.metrics.chose(self.prefill_pool, replica.url)
            started = time.perf_counter()
            replica.in_flight += 1
            try:
                async with self.client.post(replica.url + endpoint, data=payload,
                                            headers={**headers, "content-type": "application/json"}) as response:
                    content = await response.read()
                    status = response.status
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                kind = _error_kind(error)
                self.metrics.upstream_errors.labels("prefill", kind).inc()
                log.warning(json.dumps({"event": "prefill_failed", "replica": replica.url, "kind": kind,
                                        "error": f"{type(error).__name__}: {error}"[:300]}))
                if isinstance(error, aiohttp.ClientConnectorError):
                    Pool.mark_down(replica)
                    continue  # nothing was sent: another prefill replica may take it
                reason = "prefill_error"
                break
            finally:
                replica.in_flight -= 1
            if 400 <= status < 500:  # the request itself is wrong: the decode instance would refuse it too
                self.metrics.upstream_errors.labels("prefill", f"http_{status}").inc()
                return _upstream_error_response(status, content)
            if status != 200:
                self.metrics.upstream_errors.labels("prefill", f"http_{status}").inc()
                log.warning(json.dumps({"event": "prefill_failed", "replica": replica.url, "kind": f"http_{status}",
                                        "error": content[:300].decode(errors="replace")}))
                reason = "prefill_error"
                break
            self.metrics.prefill_seconds.observe(time.perf_counter() - started)
            try:
                params = json.loads(content).get("kv_transfer_params")
            except (ValueError, AttributeError):
                self.metrics.upstream_errors.labels("prefill", "bad_json").inc()
                reason = "prefill_error"
                break
            if self.kv_protocol == "nixl":  # LMCache's answer has none by design: nothing to count
                self.metrics.kv_transfer_params.labels("yes" if params else "no").inc()
            return replica.url, params
        if fallback == "fail":
            message = "the prefill pool is down" if reason == "prefill_down" else "the prefill instance failed"
            return error_response(RequestError(503 if reason == "prefill_down" else 502,
                                               f"{message} and the router's fallback policy is 'fail'", None,
                                               reason))
        self.metrics.fallbacks.labels(reason).inc()
        return None, None

    async def _decode_leg(self, features: RequestFeatures, endpoint: str, payload: bytes, stream: bool,
                          headers: dict[str, str], reply_headers: dict[str, str], path: str, arrived: float,
                          request_id: str, chosen: Replica | None = None) -> Response:
        """Decode on `chosen` (already picked, and counted, by the caller) or on the pool strategy's choice; a
        replica that refuses the connection is skipped for the next choice. (Under LMCache that next replica has
        not received the KV: it prefills the prompt itself, slower but correct.)"""
        assert self.client is not None
        tried: set[str] = set()
        last_error = ""
        headers = {**headers, "content-type": "application/json"}
        while (replica := chosen or self.decode_pool.choose(features, exclude=tried)) is not None:
            if chosen is None:
                self.metrics.chose(self.decode_pool, replica.url)
            chosen = None
            tried.add(replica.url)
            reply_headers[DECODE_REPLICA_HEADER] = replica.url
            replica.in_flight += 1
            try:
                upstream = await self.client.post(replica.url + endpoint, data=payload, headers=headers)
            except aiohttp.ClientConnectorError as error:
                replica.in_flight -= 1
                self.metrics.upstream_errors.labels("decode", "connect").inc()
                Pool.mark_down(replica)
                last_error = f"cannot connect to decode instance {replica.url}: {error}"
                continue  # nothing was sent: another decode replica may take it
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                replica.in_flight -= 1
                kind = _error_kind(error)
                self.metrics.upstream_errors.labels("decode", kind).inc()
                return error_response(RequestError(504 if kind == "timeout" else 502, f"decode instance "
                                                   f"{replica.url}: {type(error).__name__}: {error}", None, kind),
                                      reply_headers)
            if upstream.status != 200 or not stream:
                try:
                    content = await upstream.read()
                except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                    kind = _error_kind(error)
                    self.metrics.upstream_errors.labels("decode", kind).inc()
                    return error_response(RequestError(504 if kind == "timeout" else 502,
                                                       f"decode instance {replica.url} failed mid-response: "
                                                       f"{type(error).__name__}: {error}", None, kind), reply_headers)
                finally:
                    upstream.release()
                    replica.in_flight -= 1
                if upstream.status != 200:
                    self.metrics.upstream_errors.labels("decode", f"http_{upstream.status}").inc()
                else:
                    self.metrics.ttft.labels(path).observe(time.perf_counter() - arrived)
                self._log(request_id, path, features, replica, upstream.status, arrived, None)
                return Response(content, status_code=upstream.status, headers=reply_headers,
                                media_type=upstream.headers.get("content-type", "application/json"))
            stream_state = RelayedStream(upstream, replica, path, arrived, request_id, features)
            return RelayResponse(self._relay(stream_state), stream_state, self._finish, reply_headers)
        return error_response(RequestError(503, f"no decode instance reachable ({last_error})", None,
                                           "decode_down"), reply_headers)

    async def _relay(self, stream: RelayedStream) -> AsyncIterator[bytes]:
        """Pass the decode instance's SSE bytes through; if it dies mid-stream, end with an error event and
        `[DONE]` so the client sees a clean end instead of a hang or a truncated stream."""
        try:
            async for chunk in stream.upstream.content.iter_any():
                if stream.first_at is None:
                    stream.first_at = time.perf_counter()
                    self.metrics.ttft.labels(stream.path).observe(stream.first_at - stream.arrived)
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            if stream.client_gone.is_set():  # we closed the upstream ourselves: nobody is listening any more
                return
            kind = _error_kind(error)
            url = stream.replica.url
            self.metrics.upstream_errors.labels("decode", f"midstream_{kind}").inc()
            log.warning(json.dumps({"event": "decode_died", "request_id": stream.request_id, "replica": url,
                                    "error": f"{type(error).__name__}: {error}"[:300]}))
            event = error_body(502, f"decode instance {url} failed mid-stream: {type(error).__name__}: {error}",
                               None, f"upstream_{kind}")
            yield f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()

    def _finish(self, stream: RelayedStream) -> None:
        """Release everything a relayed stream held, once, however it ended (even if it never started)."""
        if stream.finished:
            return
        stream.finished = True
        stream.upstream.release()
        stream.replica.in_flight -= 1
        self._release()
        if stream.client_gone.is_set():
            self.metrics.client_disconnects.inc()
        self._log(stream.request_id, stream.path, stream.features, stream.replica, stream.upstream.status,
                  stream.arrived, stream.first_at)

    def _log(self, request_id: str, path: str, features: RequestFeatures, decode: Replica, status: int,
             arrived: float, first_at: float | None) -> None:
        if log.isEnabledFor(logging.INFO):
            now = time.perf_counter()
            log.info(json.dumps({"event": "request", "request_id": request_id, "path": path,
                                 "prompt_tokens": features.prompt_tokens, "decode": decode.url, "status": status,
                                 "ttft_ms": round((first_at - arrived) * 1e3, 3) if first_at else None,
                                 "total_ms": round((now - arrived) * 1e3, 3)}))

    # --- other endpoints -----------------------------------------------------------------------------------------

    async def models(self, _: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.upstreams.served_model, "object": "model",
                                                          "owned_by": "pdlab", "max_model_len": self.max_model_len}]})

    async def health(self, _: Request) -> Response:
        return JSONResponse({"status": "ok", "prefill": [r.url for r in self.prefill_pool.replicas],
                             "decode": [r.url for r in self.decode_pool.replicas], "in_flight": self.in_flight})

    async def prometheus(self, _: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type="text/plain; version=0.0.4")

    def _admin_refusal(self, request: Request) -> Response | None:
        if self.admin_token is None:
            return error_response(RequestError(
                403, f"the admin API is disabled: set the router's admin_token in the lab spec or ${ADMIN_TOKEN_ENV} "
                "in the router's environment, then send it as 'Authorization: Bearer TOKEN'", None, "admin_disabled"))
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.admin_token.encode()):
            return error_response(RequestError(401, "missing or wrong bearer token for the admin API", None,
                                               "unauthorized"), {"WWW-Authenticate": "Bearer"})
        return None

    def _config_view(self) -> dict[str, Any]:
        """The live settings plus the read-only facts of how P/D requests are made."""
        view: dict[str, Any] = {**self.settings.model_dump(), "kv_protocol": self.kv_protocol}
        if self.kv_protocol == "lmcache":
            view["lmcache_receivers"] = {url: receiver.as_dict() for url, receiver in self.receivers.items()}
        return view

    async def get_config(self, request: Request) -> Response:
        if refusal := self._admin_refusal(request):
            return refusal
        return JSONResponse(self._config_view())

    async def put_config(self, request: Request) -> Response:
        """Replace some or all settings; they apply to requests arriving from now on."""
        if refusal := self._admin_refusal(request):
            return refusal
        try:
            update = json.loads(await request.body())
        except ValueError as error:
            return error_response(RequestError(400, f"malformed JSON body: {error}", None, "invalid_json"))
        if not isinstance(update, dict):
            return error_response(RequestError(400, "the body must be a JSON object of settings", None,
                                               "invalid_body"))
        # A GET's answer may be PUT back as it came; the P/D protocol and receivers are fixed at start (they must
        # match how the instances' KV connectors were started), so they may only be repeated, never changed.
        current = self._config_view()
        for key in READ_ONLY_SETTINGS:
            if key in update and update.pop(key) != current.get(key):
                return error_response(RequestError(400, f"{key} is fixed when the router starts (it must match the "
                                                   "instances' KV connector); restart the router to change it",
                                                   key, "read_only_setting"))
        try:
            settings = validate(RouterSettings, {**self.settings.model_dump(), **update}, source="router settings")
        except ConfigError as error:
            where, why = error.problems[0]
            return error_response(RequestError(400, str(error), where, "invalid_setting"))
        self.prefill_pool.set_strategy(settings.prefill_strategy)
        self.decode_pool.set_strategy(settings.decode_strategy)
        self.settings = settings
        self.metrics.threshold.set(settings.threshold)
        log.info(json.dumps({"event": "config", **settings.model_dump()}))
        return JSONResponse(self._config_view())


@dataclass
class RelayedStream:
    """One relayed SSE stream: what the relay generator, the response sending it, and the clean-up share."""

    upstream: aiohttp.ClientResponse
    replica: Replica
    path: str
    arrived: float
    request_id: str
    features: RequestFeatures
    client_gone: asyncio.Event = field(default_factory=asyncio.Event)
    first_at: float | None = None
    finished: bool = False


class RelayResponse(Response):
    """A streamed pass-through of an upstream SSE answer. Unlike starlette's StreamingResponse it watches for the
    client's disconnect with one plain asyncio task instead of an anyio task group (half the router's CPU per
    streamed request went there); on disconnect it closes the upstream connection, so vLLM aborts the request."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], stream: RelayedStream,
                 finish: Callable[[RelayedStream], None], headers: dict[str, str]):
        self.chunks = chunks
        self.stream = stream
        self.finish = finish
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.stream.client_gone.set()
            self.stream.upstream.close()  # ends the relay loop below

        watcher = asyncio.create_task(watch_disconnect())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            await self.chunks.aclose()  # type: ignore[attr-defined]  (an async generator)
            self.finish(self.stream)


def _error_kind(error: BaseException) -> str:
    if isinstance(error, asyncio.TimeoutError):  # aiohttp's timeouts are TimeoutErrors too
        return "timeout"
    if isinstance(error, aiohttp.ClientConnectorError):
        return "connect"
    return "transport"


def _upstream_error_response(status: int, content: bytes) -> Response:
    """An upstream's own error answer, passed on (wrapped in an error object if it is not one)."""
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    if isinstance(body, dict) and "error" in body:
        return JSONResponse(body, status_code=status)
    return JSONResponse(error_body(status, content[:1000].decode(errors="replace")), status_code=status)


def _model_context(model_dir: str) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config["max_position_embeddings"])


def build_app(spec: RouterSpec, upstreams: Upstreams) -> Starlette:
    router = Router(spec, upstreams)
    app = Starlette(
        routes=[
            Route("/v1/completions", router.completions, methods=["POST"]),
            Route("/v1/chat/completions", router.chat_completions, methods=["POST"]),
            Route("/v1/models", router.models),
            Route("/health", router.health),
            Route("/metrics", router.prometheus),
            Route("/admin/config", router.get_config, methods=["GET"]),
            Route("/admin/config", router.put_config, methods=["PUT"]),
        ],
        lifespan=router.lifespan,
    )
    app.state.router = router
    return app
