"""The router's HTTP app: OpenAI-compatible endpoints in front of a prefill pool and a decode pool.

Per request: read the body (bounded in size and time; the in-flight slot is taken only once it is in), check it,
count the prompt's tokens with the served model's tokenizer (long texts on a worker thread, far too long ones
refused by their length alone), choose the decode replica, decide the path (`strategies.decide`: by the whole
prompt or by its part that replica is not expected to have cached), run prefill on the P/D path, and relay the
answer. Every decision is explained (`x-pdlab-reason`, `pdlab_router_decisions_total{path, reason}`).

Failures are absorbed where the client cannot tell: an upstream call that cannot connect or answers 5xx before
anything reached the client is tried again (backoff with jitter, another replica when there is one); each replica
has a circuit breaker fed by failures and by an active health check; with no decode replica available, long
prompts are not prefilled in vain: the request is served on a prefill instance as if colocated (where the P/D
protocol allows it) or refused with 503 and Retry-After. A client that goes away cancels its upstream requests on
every path (the upstream connection is closed, so vLLM aborts).

The generation endpoints are plain ASGI (no framework layers between uvicorn and the handler: they were a large
share of the router's CPU per request); the other endpoints are a starlette app. Generation calls to the instances
go through the router's own HTTP/1.1 client over httptools (`pdlab.router.upstream`: a fifth of aiohttp's CPU per
request, profiled); health checks and metric scrapes through aiohttp. The P/D legs' parameters come from the
registered KV protocol (`pdlab.router.kv`); routing decisions are the pure functions of `pdlab.router.strategies`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import os
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import generate_latest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pdlab.config.base import ConfigError
from pdlab.config.router import RouterSettings, RouterSpec, RouterUpstreams
from pdlab.pdrequest import decode_body, prefill_body
from pdlab.router.kv import KVProtocolHandler, KVTransferFailed, Transfer, make_kv_protocol
from pdlab.router.metrics import BREAKER_VALUES, RouterMetrics
from pdlab.router.pool import BreakerState, Pool, Replica
from pdlab.router.strategies import (
    NEEDS_LOAD_METRICS,
    Decision,
    PrefixCacheModel,
    RequestFeatures,
    block_hashes,
    decide,
)
from pdlab.router.tokens import PromptError, PromptTokenizer, PromptTooLong
from pdlab.router.upstream import ConnectFailed, UpstreamClient, UpstreamError
from pdlab.router.upstream import Response as Upstream
from pdlab.router.validation import RequestError, check_request, dump_json, error_body, error_response, parse_json
from pdlab.settings import (
    ADMIN_TOKEN_ENV,
    DECODE_REPLICA_HEADER,
    HTTP_KEEP_ALIVE_S,
    KV_WAIT_MS_HEADER,
    PATH_HEADER,
    PREFILL_MS_HEADER,
    PREFILL_REPLICA_HEADER,
    PROMPT_TOKENS_HEADER,
    REASON_HEADER,
    REQUEST_ID_HEADER,
)
from pdlab.sse import StreamRecord

log = logging.getLogger("pdlab.router")

#: What a client is told to wait when the router is full or has no instance to serve it.
RETRY_AFTER_S = 1
#: Settings GET /admin/config shows that PUT cannot change: they must match how the instances were started.
READ_ONLY_SETTINGS = ("kv_protocol", "lmcache_receivers")
#: Largest admin request body.
ADMIN_BODY_BYTES = 64 * 1024
#: Default body limit: bytes per token of context, and the least it is.
BODY_BYTES_PER_TOKEN = 64
MIN_BODY_BYTES = 2**20
#: Longest wait between two attempts of an upstream call.
MAX_BACKOFF_S = 1.0
#: Seconds an upstream's answer may take to end after its `[DONE]` (else its connection is dropped, not reused).
DRAIN_S = 1.0
#: An SSE stream's last event: the chunk ending with it is sent as the response's last (one write fewer).
_DONE = b"data: [DONE]\n\n"
_JSON = b"application/json"
_SSE = b"text/event-stream"


class ClientGone(Exception):
    """The client went away before its request body was in."""


class Exchange:
    """One generation request's state: what the client sent, how the answer is going, and the ASGI `send`."""

    __slots__ = ("send", "request_id", "chat", "arrived", "raw", "reply_headers", "done", "client_gone", "path",
                 "reason", "decode_url", "status", "first_at", "upstream", "prompt_tokens")

    def __init__(self, send: Send, request_id: str, chat: bool, arrived: float):
        self.send = send
        self.request_id = request_id
        self.chat = chat
        self.arrived = arrived
        self.raw = b""
        self.reply_headers: dict[str, str] = {REQUEST_ID_HEADER: request_id}
        self.done = False
        """The last response message is on its way: a disconnect from now on is the normal end."""
        self.client_gone = False
        self.path = "none"
        self.reason = ""
        self.decode_url: str | None = None
        self.status = 0
        self.first_at: float | None = None
        self.upstream: Upstream | None = None
        self.prompt_tokens = 0

    def _headers(self, content_type: bytes, length: int | None, close: bool) -> list[tuple[bytes, bytes]]:
        headers = [(b"content-type", content_type)]
        if length is not None:
            headers.append((b"content-length", b"%d" % length))
        if close:
            headers.append((b"connection", b"close"))
        headers += [(k.encode(), v.encode()) for k, v in self.reply_headers.items()]
        return headers

    async def start(self, status: int, content_type: bytes, length: int | None = None, close: bool = False) -> None:
        self.status = status
        await self.send({"type": "http.response.start", "status": status,
                         "headers": self._headers(content_type, length, close)})

    async def body(self, data: bytes, more: bool) -> None:
        if not more:
            self.done = True  # before the await: the disconnect watcher must not cancel a finished exchange
        await self.send({"type": "http.response.body", "body": data, "more_body": more})

    async def respond(self, status: int, data: bytes, content_type: bytes = _JSON, close: bool = False) -> None:
        self.done = True
        await self.start(status, content_type, len(data), close)
        await self.body(data, more=False)

    async def error(self, error: RequestError, close: bool = False) -> None:
        await self.respond(error.status, json.dumps(error_body(error.status, error.message, error.param,
                                                               error.code)).encode(), close=close)


class Router:
    """Request handling state: settings in force, pools, the upstream client, counters. An ASGI app."""

    def __init__(self, spec: RouterSpec, upstreams: RouterUpstreams):
        self.spec = spec
        self.upstreams = upstreams
        self.settings = spec.settings()
        self.kv: KVProtocolHandler = make_kv_protocol(spec.kv_protocol or "nixl", upstreams)
        self.metrics = RouterMetrics()
        self.prefix_cache = PrefixCacheModel(spec.prefix_cache_blocks)
        self.prefill_pool = Pool("prefill", upstreams.prefill, self.settings.prefill_strategy,
                                 spec.breaker_failures, spec.breaker_open_s, self._breaker_changed)
        self.decode_pool = Pool("decode", upstreams.decode, self.settings.decode_strategy,
                                spec.breaker_failures, spec.breaker_open_s, self._breaker_changed)
        for pool in (self.prefill_pool, self.decode_pool):
            for replica in pool.replicas:
                self.metrics.breaker_state.labels(pool.role, replica.url).set(0)
        self.tokenizer = PromptTokenizer(upstreams.tokenizer)
        self.max_model_len = upstreams.max_model_len or _model_context(upstreams.tokenizer)
        self.max_body_bytes = spec.max_body_bytes or max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * self.max_model_len)
        self.admin_token = spec.admin_secret() or os.environ.get(ADMIN_TOKEN_ENV) or None
        self.metrics.threshold.set(self.settings.threshold)
        self.in_flight = 0
        self.metrics.in_flight.set_function(lambda: self.in_flight)  # read when scraped, not kept per request
        self.client: UpstreamClient | None = None
        self._ids = itertools.count()
        self._id_prefix = f"pdlab-{os.urandom(6).hex()}-"
        self._upstream_headers = {"content-type": "application/json"}
        self.http = self._other_endpoints()

    # --- ASGI entry ----------------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            if path == "/v1/completions":
                return await self._generate(scope, receive, send, chat=False)
            if path == "/v1/chat/completions":
                return await self._generate(scope, receive, send, chat=True)
        await self.http(scope, receive, send)

    # --- lifecycle -------------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, _: Starlette) -> AsyncIterator[None]:
        # No total timeout (a long generation is fine); bounded connect, and bounded silence between bytes.
        self.client = UpstreamClient(connect_timeout_s=min(5.0, self.spec.upstream_timeout_s),
                                     read_timeout_s=self.spec.upstream_timeout_s, keepalive_s=HTTP_KEEP_ALIVE_S)
        await self.kv.start()
        watcher = asyncio.create_task(self._watch_upstreams())
        try:
            yield
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await self.kv.close()
            self.client.close()
            self.client = None

    async def _watch_upstreams(self) -> None:
        """Active health checks of every replica (feeding the breakers), and vLLM's load gauges when a strategy
        in force uses them. Its own connections: checks never queue behind requests."""
        interval = self.spec.health_interval_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=min(2.0, interval * 2))) as client:
            while True:
                await asyncio.gather(self.prefill_pool.check_health(client), self.decode_pool.check_health(client))
                for pool in (self.prefill_pool, self.decode_pool):
                    if pool.strategy_name in NEEDS_LOAD_METRICS:
                        await pool.scrape(client)
                await asyncio.sleep(interval)

    def _breaker_changed(self, replica: Replica, state: BreakerState) -> None:
        role = "decode" if replica in self.decode_pool.replicas else "prefill"
        self.metrics.breaker_state.labels(role, replica.url).set(BREAKER_VALUES[state])
        if state == "open":
            self.metrics.breaker_opened.labels(role, replica.url).inc()
            self.prefix_cache.forget(replica.url)  # a replica that went down may come back with an empty cache
            log.warning(json.dumps({"event": "breaker_open", "pool": role, "replica": replica.url}))
        elif state == "closed":
            log.warning(json.dumps({"event": "breaker_closed", "pool": role, "replica": replica.url}))

    # --- generation --------------------------------------------------------------------------------------------

    async def _generate(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        arrived = time.perf_counter()
        headers = dict(scope["headers"])
        given_id = headers.get(b"x-request-id")
        ex = Exchange(send, given_id.decode(errors="replace") if given_id else self._id_prefix + f"{next(self._ids)}",
                      chat, arrived)
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        assert task is not None
        try:
            ex.raw = await self._read_body(receive, headers.get(b"content-length"), loop, task)
        except RequestError as error:
            self.metrics.count(self.metrics.rejected, "bad_body")
            return await ex.error(error, close=True)  # the rest of a refused body is not read: close
        except ClientGone:
            return
        if self.in_flight >= self.spec.max_in_flight:
            self.metrics.count(self.metrics.rejected, "overloaded")
            ex.reply_headers["Retry-After"] = str(RETRY_AFTER_S)
            return await ex.error(RequestError(503, f"the router has {self.in_flight} requests in flight "
                                               f"(max_in_flight={self.spec.max_in_flight}); retry shortly", None,
                                               "overloaded"))
        self.in_flight += 1
        watcher = loop.create_task(self._watch_client(receive, ex, task))
        try:
            await self._serve(ex, headers)
        except asyncio.CancelledError:
            if not ex.client_gone:
                raise  # the server is shutting down
            task.uncancel()
            self.metrics.client_disconnects.inc()
        finally:
            ex.done = True
            watcher.cancel()
            if ex.reason:
                self.metrics.count(self.metrics.decisions, ex.path, ex.reason)
                if ex.path != "none":
                    self.metrics.count(self.metrics.requests, "/v1/chat/completions" if ex.chat else
                                       "/v1/completions", ex.path)
            if ex.upstream is not None:
                ex.upstream.close()  # not read to its end (the client left, or the stream failed): drop it
            self.in_flight -= 1
            if log.isEnabledFor(logging.INFO):
                self._log(ex)

    async def _read_body(self, receive: Receive, declared: bytes | None, loop: asyncio.AbstractEventLoop,
                         task: asyncio.Task) -> bytes:
        """The request body, refused (413) as soon as it is known to exceed the limit, and (408) when it takes
        longer than `body_timeout_s` to arrive (a timer cancels the reading: asyncio.timeout costs more per
        request)."""
        limit = self.max_body_bytes
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                raise RequestError(400, "malformed Content-Length", None, "invalid_body") from None
            if length > limit:
                raise _too_large(limit)
        chunks: list[bytes] = []
        size = 0
        expired: list[bool] = []

        def expire() -> None:
            expired.append(True)
            task.cancel()

        timer = loop.call_later(self.spec.body_timeout_s, expire)
        try:
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    raise ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                if not message.get("more_body", False):
                    if not chunks:
                        return chunk
                    chunks.append(chunk)
                    return b"".join(chunks)
                chunks.append(chunk)
        except asyncio.CancelledError:
            if not expired or task.uncancel():
                raise  # not (only) the timer: the server is stopping
            raise RequestError(408, f"the request body did not arrive within {self.spec.body_timeout_s:g} s",
                               None, "body_timeout") from None
        finally:
            timer.cancel()

    async def _watch_client(self, receive: Receive, ex: Exchange, task: asyncio.Task) -> None:
        """Cancel the request's handling (and so its upstream calls) when the client disconnects early."""
        while (await receive())["type"] != "http.disconnect":
            pass
        if not ex.done:
            ex.client_gone = True
            task.cancel()

    async def _serve(self, ex: Exchange, headers: dict[bytes, bytes]) -> None:
        settings = self.settings  # one consistent snapshot per request, even if PUT /admin/config lands now
        try:
            body = parse_json(ex.raw)
            checked = check_request(body, ex.chat, self.upstreams.model, self.max_model_len)
            try:
                prompt = await (self.tokenizer.chat_async(body["messages"], body.get("chat_template_kwargs"),
                                                          self.max_model_len) if ex.chat
                                else self.tokenizer.completion_async(body["prompt"], self.max_model_len))
            except PromptTooLong as error:
                raise RequestError(400, str(error), error.param, "context_length_exceeded") from None
            except PromptError as error:
                raise RequestError(400, str(error), error.param, "invalid_prompt") from None
        except RequestError as error:
            self.metrics.count(self.metrics.rejected, "bad_request")
            return await ex.error(error)
        ex.prompt_tokens = prompt.count
        self.metrics.prompt_tokens.observe(prompt.count)
        ex.reply_headers[PROMPT_TOKENS_HEADER] = str(prompt.count)
        session = headers.get(self.spec.session_header.encode())
        session_key = session.decode(errors="replace") if session is not None else body.get("user")
        needs_hashes = (settings.threshold_basis == "uncached" or self.prefill_pool.needs_block_hashes
                        or self.decode_pool.needs_block_hashes)
        features = RequestFeatures(
            prompt_tokens=prompt.count,
            block_hashes=block_hashes(prompt.token_ids, self.upstreams.block_size) if needs_hashes else (),
            session_key=str(session_key) if session_key is not None else None,
        )
        endpoint = "/v1/chat/completions" if ex.chat else "/v1/completions"
        upstream_headers = {**self._upstream_headers, REQUEST_ID_HEADER: ex.request_id}
        if auth := headers.get(b"authorization"):
            upstream_headers["authorization"] = auth.decode(errors="replace")
        call = _Call(endpoint, upstream_headers, checked.stream, features, body)

        decode = self.decode_pool.choose(features)
        if decode is None:
            return await self._decode_pool_empty(ex, call, settings, "decode_empty")
        self.metrics.chose(self.decode_pool, decode.url)
        cached = 0
        if settings.threshold_basis == "uncached":
            cached = self.prefix_cache.cached_blocks(decode.url, features.block_hashes) * self.upstreams.block_size
        decision = decide(prompt.count, cached, settings.threshold, settings.threshold_basis)
        if decision.path == "disaggregated" and not self.prefill_pool.replicas:
            decision = Decision("direct", "no_prefill_pool", decision.counted_tokens)
        payload = ex.raw  # the direct path forwards the client's bytes as they came
        if decision.path == "disaggregated":
            outcome = await self._disaggregate(ex, call, body, decode, settings)
            if outcome is None:
                return  # answered (an error passed on, or the policy is to fail)
            if isinstance(outcome, str):  # fell back to direct
                decision = Decision("direct", outcome, decision.counted_tokens)
                ex.reply_headers["x-pdlab-fallback"] = "prefill-unavailable"
            elif outcome:
                payload = dump_json(decode_body(body, outcome))
        await self._answer(ex, call, decision, decode, payload, settings)

    async def _disaggregate(self, ex: Exchange, call: _Call, body: dict[str, Any], decode: Replica,
                            settings: RouterSettings) -> dict[str, Any] | str | None:
        """Run prefill for `decode`. Returns the decode leg's kv_transfer_params ({} for none), or the reason to
        serve the request directly instead (a fallback), or None when the client has been answered already."""
        if not self.prefill_pool.available():
            reason = "breaker_open"
        else:
            # The decode replica is as good as busy with this request already: least-loaded choices see that.
            decode.in_flight += 1
            try:
                outcome = await self._prefill_leg(ex, call, body, decode)
            finally:
                decode.in_flight -= 1
            if not isinstance(outcome, str):
                return outcome
            reason = outcome
        if settings.fallback == "fail":
            down = reason in ("prefill_down", "breaker_open")
            what = "the prefill pool is down" if down else "the prefill instance failed"
            self._decided(ex, Decision("none", reason, ex.prompt_tokens))
            await ex.error(RequestError(503 if down else 502, f"{what} and the router's fallback policy is 'fail'",
                                        None, "prefill_down" if down else "prefill_error"))
            return None
        self.metrics.count(self.metrics.fallbacks, reason)
        return reason

    async def _prefill_leg(self, ex: Exchange, call: _Call, body: dict[str, Any], decode: Replica
                           ) -> dict[str, Any] | str | None:
        """Prefill on a prefill replica for the chosen decode replica, with retries. Returns the decode leg's
        kv_transfer_params ({} for none); `prefill_down` / `prefill_error` when the pool failed; None when the
        client has been answered (the prefill instance refused the request itself: a 4xx decode would give
        too)."""
        assert self.client is not None
        started = time.perf_counter()
        transfer = self.kv.open_transfer(ex.request_id, decode.url)
        try:
            return await self._prefill_attempts(ex, call, body, transfer, started)
        finally:
            transfer.close()

    async def _prefill_attempts(self, ex: Exchange, call: _Call, body: dict[str, Any], transfer: Transfer,
                                started: float) -> dict[str, Any] | str | None:
        assert self.client is not None
        try:
            payload = dump_json(prefill_body(body, transfer.prefill_params))
        except RecursionError:
            await ex.error(RequestError(400, "the JSON body is nested too deeply", None, "invalid_json"))
            return None
        tried: set[str] = set()
        reason = "prefill_down"
        failed = ""
        for attempt in range(self.spec.retries + 1):
            replica = self.prefill_pool.choose(call.features, exclude=tried) or (
                self.prefill_pool.choose(call.features) if tried else None)
            if replica is None:
                break
            if attempt:
                self.metrics.count(self.metrics.retries, "prefill", failed)
                await self._backoff(attempt)
            tried.add(replica.url)
            self.metrics.chose(self.prefill_pool, replica.url)
            replica.in_flight += 1
            try:
                response = await self.client.post(replica.endpoint(call.endpoint), payload, call.headers)
                try:
                    content = await response.read()
                finally:
                    response.release()
                status = response.status
            except (UpstreamError, TimeoutError) as error:
                kind = _error_kind(error)
                self.metrics.count(self.metrics.upstream_errors, "prefill", kind)
                replica.breaker.failure(at_once=kind == "connect")
                log.warning(json.dumps({"event": "prefill_failed", "replica": replica.url, "kind": kind,
                                        "error": f"{type(error).__name__}: {error}"[:300]}))
                if kind == "timeout":
                    return "prefill_error"  # waited the whole timeout once already: do not wait again
                if kind != "connect":
                    reason = "prefill_error"
                failed = kind
                continue
            finally:
                replica.in_flight -= 1
            if 400 <= status < 500:  # the request itself is wrong: the decode instance would refuse it too
                replica.breaker.success()
                self.metrics.count(self.metrics.upstream_errors, "prefill", f"http_{status}")
                await ex.respond(status, _error_content(status, content))
                return None
            if status != 200:
                replica.breaker.failure()
                reason = "prefill_error"
                failed = f"http_{status}"
                self.metrics.count(self.metrics.upstream_errors, "prefill", failed)
                log.warning(json.dumps({"event": "prefill_failed", "replica": replica.url, "kind": f"http_{status}",
                                        "error": content[:300].decode(errors="replace")}))
                continue
            try:
                answer = parse_json(content, strict=False).get("kv_transfer_params")
            except (RequestError, AttributeError):
                replica.breaker.failure()
                self.metrics.count(self.metrics.upstream_errors, "prefill", "bad_json")
                reason = "prefill_error"
                failed = "bad_json"
                continue
            replica.breaker.success()
            self.metrics.prefill_seconds.observe(time.perf_counter() - started)
            if self.kv.prefill_answer_carries_params:
                self.metrics.count(self.metrics.kv_transfer_params, "yes" if answer else "no")
            ex.reply_headers[PREFILL_REPLICA_HEADER] = replica.url
            ex.reply_headers[PREFILL_MS_HEADER] = f"{(time.perf_counter() - ex.arrived) * 1e3:.1f}"
            try:
                waited = await transfer.landed()
            except KVTransferFailed as error:
                self.metrics.count(self.metrics.upstream_errors, "prefill", "kv_transfer")
                await ex.error(RequestError(504, str(error), None, "kv_transfer_failed"))
                return None
            if waited is not None:
                ex.reply_headers[KV_WAIT_MS_HEADER] = f"{waited * 1e3:.1f}"
            return self.kv.decode_params(answer) or {}
        return reason

    def _may_serve_from_prefill(self, settings: RouterSettings) -> bool:
        return (settings.serve_from_prefill is not False and self.kv.prefill_serves_plain
                and bool(self.prefill_pool.replicas))

    async def _decode_pool_empty(self, ex: Exchange, call: _Call, settings: RouterSettings, reason: str) -> None:
        """No decode replica can take the request: serve it on a prefill instance as if colocated, where allowed,
        or refuse it with 503 and Retry-After (nothing was prefilled in vain)."""
        if self._may_serve_from_prefill(settings) and self.prefill_pool.available():
            replica = self.prefill_pool.choose(call.features)
            if replica is not None:
                self.metrics.chose(self.prefill_pool, replica.url)
                return await self._answer(ex, call, Decision("prefill", reason, ex.prompt_tokens), replica, ex.raw,
                                          settings, pool=self.prefill_pool)
        self._decided(ex, Decision("none", reason, ex.prompt_tokens))
        ex.reply_headers["Retry-After"] = str(RETRY_AFTER_S)
        why = "" if self._may_serve_from_prefill(settings) else (
            " (serving from prefill instances is off" + ("" if self.kv.prefill_serves_plain else
                                                          f": never under kv_protocol {self.kv.name}") + ")")
        await ex.error(RequestError(503, f"no decode instance is available{why}; retry shortly", None, reason))

    def _decided(self, ex: Exchange, decision: Decision) -> None:
        """Record the path and why (a request re-decided, e.g. served from prefill after its decode replica died,
        counts its last decision only: `_generate` counts it when the request ends)."""
        ex.path, ex.reason = decision.path, decision.reason
        ex.reply_headers[PATH_HEADER] = decision.path
        ex.reply_headers[REASON_HEADER] = decision.reason

    async def _answer(self, ex: Exchange, call: _Call, decision: Decision, replica: Replica, payload: bytes,
                      settings: RouterSettings, pool: Pool | None = None) -> None:
        """Send the request that produces the client's answer to `replica` (a decode replica, or a prefill one
        serving as colocated) and relay it; with retries on other replicas of the pool while nothing has reached
        the client. Under P/D, a retry after the request reached a decode instance sends the client's own request
        (that instance may have consumed the KV handle): the next replica prefills it itself."""
        assert self.client is not None
        pool = pool or self.decode_pool
        stage = pool.role
        tried: set[str] = set()
        last_error: RequestError | None = None
        last_reply: tuple[int, bytes] | None = None
        all_refused = True
        failed = ""
        self._decided(ex, decision)
        for attempt in range(self.spec.retries + 1):
            if attempt:
                replica = pool.choose(call.features, exclude=tried) or pool.choose(call.features)  # type: ignore[assignment]
                if replica is None:
                    break
                self.metrics.chose(pool, replica.url)
                self.metrics.count(self.metrics.retries, stage, failed)
                await self._backoff(attempt)
            tried.add(replica.url)
            ex.reply_headers[DECODE_REPLICA_HEADER] = replica.url
            ex.decode_url = replica.url
            replica.in_flight += 1
            try:
                retry_kind = await self._call_once(ex, call, replica, payload, decision)
            finally:
                replica.in_flight -= 1
            if retry_kind is None:
                if call.features.block_hashes and pool is self.decode_pool:
                    self.prefix_cache.add(replica.url, call.features.block_hashes)
                return
            kind, error, reply = retry_kind
            failed = kind
            last_error, last_reply = error, reply
            if kind != "connect":
                all_refused = False
                if payload is not ex.raw and stage == "decode":
                    payload = ex.raw
        if (stage == "decode" and all_refused and not self.decode_pool.available()
                and self._may_serve_from_prefill(settings) and self.prefill_pool.available()):
            # The decode pool died under this request: serve it on a prefill instance as if colocated.
            ex.reply_headers.pop("x-pdlab-fallback", None)
            return await self._decode_pool_empty(ex, call, settings, "decode_down")
        if last_reply is not None:
            return await ex.respond(last_reply[0], last_reply[1])
        if all_refused:
            ex.reply_headers["Retry-After"] = str(RETRY_AFTER_S)
            why = last_error.message if last_error else ""
            last_error = RequestError(503, f"no {stage} instance reachable ({why})", None, f"{stage}_down")
        assert last_error is not None
        await ex.error(last_error)

    async def _call_once(self, ex: Exchange, call: _Call, replica: Replica, payload: bytes, decision: Decision
                         ) -> tuple[str, RequestError, tuple[int, bytes] | None] | None:
        """One attempt: None when the client got its answer (or a failure mid-stream was reported to it);
        else (what failed, the error to give if this was the last attempt, an upstream 5xx to pass on)."""
        assert self.client is not None
        stage = "decode" if replica in self.decode_pool.replicas else "prefill"
        try:
            upstream = await self.client.post(replica.endpoint(call.endpoint), payload, call.headers)
        except (UpstreamError, TimeoutError) as error:
            kind = _error_kind(error)
            self.metrics.count(self.metrics.upstream_errors, stage, kind)
            replica.breaker.failure(at_once=kind == "connect")
            failure = RequestError(504 if kind == "timeout" else 502, f"{stage} instance {replica.url}: "
                                   f"{type(error).__name__}: {error}", None, kind)
            if kind == "timeout":
                await ex.error(failure)
                return None
            return kind, failure, None
        ex.upstream = upstream
        if upstream.status != 200 or not call.stream:
            try:
                content = await upstream.read()
            except (UpstreamError, TimeoutError) as error:
                kind = _error_kind(error)
                self.metrics.count(self.metrics.upstream_errors, stage, kind)
                replica.breaker.failure()
                failure = RequestError(504 if kind == "timeout" else 502, f"{stage} instance {replica.url} failed "
                                       f"mid-response: {type(error).__name__}: {error}", None, kind)
                if kind == "timeout":
                    await ex.error(failure)
                    return None
                return "transport", failure, None
            finally:
                upstream.release()
                ex.upstream = None
            if upstream.status >= 500:
                replica.breaker.failure()
                self.metrics.count(self.metrics.upstream_errors, stage, f"http_{upstream.status}")
                return f"http_{upstream.status}", RequestError(502, ""), (upstream.status,
                                                                           _error_content(upstream.status, content))
            replica.breaker.success()
            if upstream.status != 200:
                self.metrics.count(self.metrics.upstream_errors, stage, f"http_{upstream.status}")
            else:
                self.metrics.child(self.metrics.ttft, decision.path).observe(time.perf_counter() - ex.arrived)
            await ex.respond(upstream.status, content,
                             upstream.headers.get("content-type", "application/json").encode())
            return None
        replica.breaker.success()
        await self._relay(ex, call, upstream, replica, decision.path)
        return None

    async def _relay(self, ex: Exchange, call: _Call, upstream: Upstream, replica: Replica,
                     path: str) -> None:
        """Pass the upstream's SSE events through. If the upstream dies mid-stream, continue the stream on another
        instance (`_continue`) where one can take it; else end with an error event and `[DONE]`, so the client
        sees a clean end instead of a hang or a silently truncated stream."""
        await ex.start(200, _SSE)
        relayed: list[bytes] = []  # the whole events the client has: what a continuation starts from
        for resumes in range(self.spec.retries + 1):
            error = await self._pipe(ex, upstream, path, relayed)
            if error is None:
                return
            kind = _error_kind(error)
            self.metrics.count(self.metrics.upstream_errors, "decode", f"midstream_{kind}")
            replica.breaker.failure(at_once=kind != "timeout")  # a dead upstream: keep others off it at once
            log.warning(json.dumps({"event": "decode_died", "request_id": ex.request_id, "replica": replica.url,
                                    "error": f"{type(error).__name__}: {error}"[:300]}))
            upstream.close()
            ex.upstream = None
            continued = None if resumes == self.spec.retries else await self._continue(ex, call, replica, relayed)
            if continued is None:
                event = error_body(502, f"decode instance {replica.url} failed mid-stream: {type(error).__name__}: "
                                   f"{error}", None, f"upstream_{kind}")
                await ex.body(f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode(), more=False)
                return
            upstream, replica = continued

    async def _pipe(self, ex: Exchange, upstream: Upstream, path: str, relayed: list[bytes]
                    ) -> BaseException | None:
        """Relay one upstream's events (whole events only: a partial one waits for its end); None when the stream
        ended (the response is complete), else the error that broke it."""
        pending = b""
        try:
            while chunk := await upstream.readany():
                if pending or not chunk.endswith(b"\n\n"):
                    chunk = pending + chunk
                    cut = chunk.rfind(b"\n\n") + 2
                    chunk, pending = chunk[:cut], chunk[cut:]
                    if not chunk:
                        continue
                if ex.first_at is None:
                    ex.first_at = time.perf_counter()
                    self.metrics.child(self.metrics.ttft, path).observe(ex.first_at - ex.arrived)
                relayed.append(chunk)
                if chunk.endswith(_DONE):
                    # Nothing follows [DONE]: send it as the last chunk (one write fewer). The upstream's end is
                    # here already or about to be: its connection goes back to the pool when it comes.
                    await ex.body(chunk, more=False)
                    upstream.release(end_within_s=DRAIN_S)
                    ex.upstream = None
                    return None
                await ex.body(chunk, more=True)
        except (UpstreamError, TimeoutError) as error:
            return error
        await ex.body(pending, more=False)
        upstream.release()
        ex.upstream = None
        return None

    async def _continue(self, ex: Exchange, call: _Call, failed: Replica, relayed: list[bytes]
                        ) -> tuple[Upstream, Replica] | None:
        """Continue a stream cut short on another instance: the request again, with the text the client already
        has appended to its prompt (completions) or as an assistant message to continue (chat), and the remaining
        `max_tokens`. Another decode replica, else a prefill instance where serving from prefill is allowed."""
        assert self.client is not None
        payload = _continuation(call.body, ex.chat, b"".join(relayed))
        if payload is None:
            return None
        replica = self.decode_pool.choose(call.features, exclude={failed.url})
        if replica is None and self._may_serve_from_prefill(self.settings):
            replica = self.prefill_pool.choose(call.features)
        if replica is None:
            return None
        try:
            upstream = await self.client.post(replica.endpoint(call.endpoint), payload, call.headers)
        except (UpstreamError, TimeoutError) as error:
            replica.breaker.failure(at_once=_error_kind(error) == "connect")
            return None
        if upstream.status != 200:
            upstream.release()
            replica.breaker.failure()
            return None
        replica.breaker.success()
        ex.upstream = upstream
        ex.decode_url = replica.url
        self.metrics.count(self.metrics.retries, "decode", "midstream")
        log.warning(json.dumps({"event": "stream_continued", "request_id": ex.request_id, "replica": replica.url}))
        return upstream, replica

    async def _backoff(self, attempt: int) -> None:
        """Exponential backoff with full jitter before attempt `attempt` (1, 2, ...)."""
        await asyncio.sleep(random.uniform(0, min(MAX_BACKOFF_S, self.spec.retry_backoff_s * 2 ** attempt)))

    def _log(self, ex: Exchange) -> None:
        now = time.perf_counter()
        log.info(json.dumps({"event": "request", "request_id": ex.request_id, "path": ex.path, "reason": ex.reason,
                             "prompt_tokens": ex.prompt_tokens, "decode": ex.decode_url, "status": ex.status,
                             "client_gone": ex.client_gone,
                             "ttft_ms": round((ex.first_at - ex.arrived) * 1e3, 3) if ex.first_at else None,
                             "total_ms": round((now - ex.arrived) * 1e3, 3)}))

    # --- other endpoints -----------------------------------------------------------------------------------------

    def _other_endpoints(self) -> Starlette:
        async def not_found(_: Request, error: Exception) -> Response:
            status = getattr(error, "status_code", 500)
            detail = getattr(error, "detail", None) or "internal error"
            return error_response(RequestError(status, f"{detail}", None, "not_found" if status == 404 else
                                               "method_not_allowed" if status == 405 else None))

        async def server_error(_: Request, error: Exception) -> Response:
            log.error(json.dumps({"event": "error", "error": f"{type(error).__name__}: {error}"[:500]}))
            return error_response(RequestError(500, "internal router error", None, "internal_error"))

        async def generation_method(_: Request) -> Response:  # POST is served before starlette sees it
            raise HTTPException(405)

        return Starlette(
            routes=[
                Route("/v1/completions", generation_method, methods=["POST"]),
                Route("/v1/chat/completions", generation_method, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
                Route("/admin/config", self.get_config, methods=["GET"]),
                Route("/admin/config", self.put_config, methods=["PUT"]),
            ],
            exception_handlers={HTTPException: not_found, Exception: server_error},
            lifespan=self.lifespan,
        )

    async def models(self, _: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.upstreams.model, "object": "model",
                                                          "owned_by": "pdlab", "max_model_len": self.max_model_len}]})

    async def health(self, _: Request) -> Response:
        """200 while the router can serve (`ok`: every replica's breaker closed; `degraded`: some open), 503 when
        no instance can take a request (`unavailable`); each pool's replicas with their breaker state."""
        pools = (self.prefill_pool, self.decode_pool)
        can_serve = self.decode_pool.available() or (
            self._may_serve_from_prefill(self.settings) and self.prefill_pool.available())
        all_closed = all(r.breaker.state == "closed" for pool in pools for r in pool.replicas)
        status = "ok" if all_closed else "degraded" if can_serve else "unavailable"
        return JSONResponse({"status": status, "pools": {pool.role: pool.describe() for pool in pools},
                             "in_flight": self.in_flight}, status_code=200 if can_serve else 503)

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
        return {**self.settings.model_dump(), "kv_protocol": self.kv.name, **self.kv.describe()}

    async def get_config(self, request: Request) -> Response:
        if refusal := self._admin_refusal(request):
            return refusal
        return JSONResponse(self._config_view())

    async def put_config(self, request: Request) -> Response:
        """Replace some or all settings; they apply to requests arriving from now on. Values are checked strictly
        (`"100"` or `true` is not a threshold) and within bounds."""
        if refusal := self._admin_refusal(request):
            return refusal
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > ADMIN_BODY_BYTES:
                return error_response(_too_large(ADMIN_BODY_BYTES), {"connection": "close"})
        try:
            update = parse_json(raw)
        except RequestError as error:
            return error_response(error)
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
            settings = self._strict_settings({**self.settings.model_dump(), **update})
        except ConfigError as error:
            where, _ = error.problems[0]
            return error_response(RequestError(400, str(error), where, "invalid_setting"))
        self.prefill_pool.set_strategy(settings.prefill_strategy)
        self.decode_pool.set_strategy(settings.decode_strategy)
        self.settings = settings
        self.metrics.threshold.set(settings.threshold)
        log.info(json.dumps({"event": "config", **settings.model_dump()}))
        return JSONResponse(self._config_view())

    def _strict_settings(self, data: dict[str, Any]) -> RouterSettings:
        try:
            settings = RouterSettings.model_validate(data, strict=True)
        except ValidationError as error:
            raise ConfigError.from_validation("router settings", error) from None
        except RecursionError:
            raise ConfigError("router settings", [("(body)", "nested too deeply")]) from None
        if settings.serve_from_prefill and not self.kv.prefill_serves_plain:
            raise ConfigError("router settings", [("serve_from_prefill", f"never under kv_protocol {self.kv.name} "
                                                   "(its prefill instance's engine dies on a plain request)")])
        return settings


class _Call:
    """What every upstream call of one request shares."""

    __slots__ = ("endpoint", "headers", "stream", "features", "body")

    def __init__(self, endpoint: str, headers: dict[str, str], stream: bool, features: RequestFeatures,
                 body: dict[str, Any]):
        self.endpoint, self.headers, self.stream, self.features, self.body = endpoint, headers, stream, features, body


def _continuation(body: dict[str, Any], chat: bool, relayed: bytes) -> bytes | None:
    """The request that continues a stream whose client already has the events `relayed`; None when it cannot be
    continued (several choices, echo, a prompt of token ids) or had ended."""
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1) or body.get("echo"):
        return None
    record = StreamRecord()
    record.feed_bytes(relayed, 0.0)
    if record.done or record.finish_reason is not None or record.error is not None:
        return None
    generated = len(record.token_times)
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    for name in ("max_tokens", "max_completion_tokens"):
        if isinstance(out.get(name), int):
            out[name] = max(1, out[name] - generated)
    if isinstance(out.get("min_tokens"), int):
        out["min_tokens"] = max(0, out["min_tokens"] - generated)
    if not record.text:
        return dump_json(out)
    if chat:
        out["messages"] = [*body["messages"], {"role": "assistant", "content": record.text}]
        out["continue_final_message"], out["add_generation_prompt"] = True, False
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return None
        out["prompt"] = prompt + record.text
    return dump_json(out)


def _too_large(limit: int) -> RequestError:
    return RequestError(413, f"the request body is larger than the router accepts ({limit} bytes; "
                        "router.max_body_bytes)", None, "body_too_large")


def _error_kind(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "timeout"
    if isinstance(error, ConnectFailed):
        return "connect"
    return "transport"


def _error_content(status: int, content: bytes) -> bytes:
    """An upstream's own error answer, passed on (wrapped in an error object if it is not one)."""
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    if isinstance(body, dict) and "error" in body:
        return content
    return json.dumps(error_body(status, content[:1000].decode(errors="replace"))).encode()


def _model_context(model_dir: str) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config["max_position_embeddings"])


def build_app(spec: RouterSpec, upstreams: RouterUpstreams) -> Router:
    """The router as an ASGI app (uvicorn runs it; its lifespan starts the upstream client and health checks)."""
    return Router(spec, upstreams)
