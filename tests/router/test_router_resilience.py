"""Faults lose nothing, and every decision is explained: cancellation on client disconnect (both legs, stream or
not), retries before the first byte, circuit breakers fed by failures and health checks, the decode pool empty,
P/D decided on uncached tokens. Stand-in OpenAI servers and routers as real processes on loopback."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from pdlab.settings import ADMIN_TOKEN_ENV, DECODE_REPLICA_HEADER, PATH_HEADER, REASON_HEADER
from tests.router_processes import MODEL, metric, router, standin, url

TOKEN = "resilience-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
NOTHING_LISTENS = 18198
BODY = {"model": MODEL, "prompt": "a prompt long enough to count", "max_tokens": 3}
#: Fast breakers and health checks, so a test sees them act within a second or two.
QUICK = {"health_interval_s": 0.2, "breaker_open_s": 0.5}


def wait_for(predicate, timeout_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def records(port: int) -> list[dict]:
    return httpx.get(url(port) + "/standin/records", timeout=5).json()["requests"]


def breaker(base: str, pool: str, port: int) -> str:
    health = httpx.get(base + "/health", timeout=5).json()
    return next(r["breaker"] for r in health["pools"][pool] if r["url"] == url(port))


def leave_early(base: str, body: dict, after_s: float) -> None:
    """Send `body` and go away after `after_s` seconds (a client that disconnects, stream or not)."""
    async def go() -> None:
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.post("/v1/completions", json=body), after_s)

    asyncio.run(go())


# --- cancellation --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_cancels_each_leg(tmp_path, model_dir, stream):
    """Direct, prefill leg and decode leg, stream or not: the upstream request in progress is aborted, the slot
    is freed, and nothing more is sent upstream."""
    slow_prefill, slow_decode, fast_prefill, fast_decode = 18211, 18212, 18213, 18214
    with standin(slow_prefill, tmp_path, "--prefill-us-per-token", "1000000"), \
            standin(slow_decode, tmp_path, "--token-ms", "500"), \
            standin(fast_prefill, tmp_path), standin(fast_decode, tmp_path), \
            router(18215, tmp_path, model_dir, [slow_prefill], [fast_decode], threshold=0), \
            router(18216, tmp_path, model_dir, [fast_prefill], [slow_decode], threshold=0), \
            router(18217, tmp_path, model_dir, [], [slow_decode]):
        body = {**BODY, "max_tokens": 40, "stream": stream}
        # The prefill leg: a prefill of several seconds, abandoned after 1 s; decode never hears of it.
        leave_early(url(18215), body, 1.0)
        assert wait_for(lambda: metric(url(slow_prefill), "standin_aborted_total", stream="false") == 1)
        assert not records(fast_decode)
        # The decode leg (after a prefill), and the direct path.
        for base, aborted_before in ((url(18216), 0), (url(18217), 1)):
            leave_early(base, body, 1.0)
            assert wait_for(lambda aborted_before=aborted_before: metric(
                url(slow_decode), "standin_aborted_total", stream=str(stream).lower()) == aborted_before + 1)
        for port in (18215, 18216, 18217):
            assert wait_for(lambda port=port: metric(url(port), "pdlab_router_in_flight") == 0)
            assert metric(url(port), "pdlab_router_client_disconnects_total") == 1


# --- retries and circuit breakers ----------------------------------------------------------------------------------

def test_retries_before_the_first_byte_hide_5xx_and_refused_connections(tmp_path, model_dir):
    """Every other answer of one decode replica is a 500, and another replica refuses connections: every request
    still succeeds, each failure tried again elsewhere (with backoff), counted by leg and kind."""
    flaky_prefill, flaky_decode = 18221, 18222
    with standin(flaky_prefill, tmp_path, "--fail-every", "2"), standin(flaky_decode, tmp_path, "--fail-every", "2"), \
            router(18223, tmp_path, model_dir, [flaky_prefill], [flaky_decode, NOTHING_LISTENS], threshold=0,
                   env={ADMIN_TOKEN_ENV: TOKEN}, breaker_failures=100, **QUICK):
        base = url(18223)
        for stream in (False, True, False, True):
            response = httpx.post(base + "/v1/completions", json={**BODY, "stream": stream}, timeout=10)
            assert response.status_code == 200, response.text
            assert response.headers[PATH_HEADER] == "disaggregated"  # prefill's 500s were retried, no fallback
        assert metric(base, "pdlab_router_retries_total", stage="prefill", kind="http_500") >= 1
        assert metric(base, "pdlab_router_retries_total", stage="decode", kind="http_500") >= 1
        assert metric(base, "pdlab_router_fallbacks_total", reason="prefill_error") == 0


def test_breakers_open_on_failures_and_close_on_health(tmp_path, model_dir):
    """Two decode replicas; one fails its health checks, then comes back: while it is out, requests go to the other
    (none lost), `/health` says `degraded` and shows it open; a passing health check closes it again."""
    a, b = 18231, 18232
    with standin(a, tmp_path), standin(b, tmp_path), \
            router(18233, tmp_path, model_dir, [], [a, b], **QUICK):
        base = url(18233)
        httpx.put(url(a) + "/standin/health", json={"ok": False}, timeout=5).raise_for_status()
        assert wait_for(lambda: breaker(base, "decode", a) == "open")
        health = httpx.get(base + "/health", timeout=5)
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        served = {httpx.post(base + "/v1/completions", json=BODY, timeout=10).headers[DECODE_REPLICA_HEADER]
                  for _ in range(6)}
        assert served == {url(b)}
        httpx.put(url(a) + "/standin/health", json={"ok": True}, timeout=5).raise_for_status()
        assert wait_for(lambda: breaker(base, "decode", a) == "closed")
        assert httpx.get(base + "/health", timeout=5).json()["status"] == "ok"
        assert metric(base, "pdlab_router_breaker_opened_total", pool="decode", replica=url(a)) == 1


def test_a_replica_killed_under_load_loses_nothing(tmp_path, model_dir):
    """A decode replica SIGKILLed while requests run on it: those that had no answer yet are tried again on the
    other replica (nothing reached their clients), and once its breaker is open it gets no more."""
    a, b = 18234, 18235
    with standin(b, tmp_path), router(18236, tmp_path, model_dir, [], [a, b], **QUICK):
        base = url(18236)
        with standin(a, tmp_path, "--token-ms", "20") as victim:
            assert wait_for(lambda: breaker(base, "decode", a) == "closed")

            async def load() -> list[int]:
                async with httpx.AsyncClient(base_url=base, timeout=20) as client:
                    async def one(i: int) -> int:
                        await asyncio.sleep(i * 0.025)
                        response = await client.post("/v1/completions", json={**BODY, "max_tokens": 8})
                        return response.status_code

                    async def kill() -> None:
                        await asyncio.sleep(0.6)
                        await asyncio.to_thread(victim.kill)

                    statuses, _ = await asyncio.gather(asyncio.gather(*(one(i) for i in range(60))), kill())
                    return list(statuses)

            statuses = asyncio.run(load())
        assert statuses == [200] * 60
        assert metric(base, "pdlab_router_retries_total", stage="decode", kind="transport") + metric(
            base, "pdlab_router_retries_total", stage="decode", kind="connect") >= 1
        assert breaker(base, "decode", a) == "open"


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_cut_short_is_continued_on_another_replica(tmp_path, model_dir, chat):
    """A decode replica dies after three tokens of an eight-token stream: the client's stream goes on from the
    other replica (the text so far appended to the prompt, or as an assistant message to continue), with the
    remaining five tokens, and ends normally."""
    dying, healthy = 18237, 18238
    with standin(dying, tmp_path, "--die-after-tokens", "3"), standin(healthy, tmp_path), \
            router(18239, tmp_path, model_dir, [], [dying, healthy], **QUICK):
        endpoint, body = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go on"}]}) if chat \
            else ("/v1/completions", {"prompt": "go on"})
        body = {"model": MODEL, "max_tokens": 8, "stream": True, **body}
        with httpx.stream("POST", url(18239) + endpoint, json=body, timeout=10,
                          headers={"x-request-id": f"continued-{chat}"}) as response:
            assert response.status_code == 200 and response.headers[DECODE_REPLICA_HEADER] == url(dying)
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
        pieces = [choice.get("text") or choice.get("delta", {}).get("content")
                  for e in events[:-1] for choice in json.loads(e)["choices"]]
        assert len(pieces) == 8, pieces
        [continued] = [r for r in records(healthy) if r["request_id"] == f"continued-{chat}"]
        assert continued["max_tokens"] == 5 and continued["stream"] is True
        assert metric(url(18239), "pdlab_router_retries_total", stage="decode", kind="midstream") == 1


# --- the decode pool empty -----------------------------------------------------------------------------------------

def test_decode_pool_down_serves_from_prefill_or_refuses_with_retry_after(tmp_path, model_dir):
    """No decode replica alive: long prompts are not prefilled in vain. By default (NIXL) the prefill instance serves
    the request as if colocated; with serve_from_prefill off, 503 with Retry-After and no upstream call; `/health`
    reports it."""
    prefill = 18241
    with standin(prefill, tmp_path), \
            router(18242, tmp_path, model_dir, [prefill], [NOTHING_LISTENS], threshold=0,
                   env={ADMIN_TOKEN_ENV: TOKEN}, **QUICK):
        base = url(18242)
        assert wait_for(lambda: breaker(base, "decode", NOTHING_LISTENS) == "open")
        health = httpx.get(base + "/health", timeout=5)
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        for stream in (False, True):
            response = httpx.post(base + "/v1/completions", json={**BODY, "stream": stream}, timeout=10)
            assert response.status_code == 200, response.text
            assert response.headers[PATH_HEADER] == "prefill" and response.headers[REASON_HEADER] == "decode_empty"
        # The prefill instance got the client's own requests (no kv_transfer_params): nothing prefilled in vain.
        assert [r["kv_transfer_params"] for r in records(prefill)] == [None, None]
        assert metric(base, "pdlab_router_decisions_total", path="prefill", reason="decode_empty") == 2

        httpx.put(base + "/admin/config", json={"serve_from_prefill": False}, headers=ADMIN,
                  timeout=5).raise_for_status()
        refused = httpx.post(base + "/v1/completions", json=BODY, timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "decode_empty"
        assert len(records(prefill)) == 2  # no upstream call at all
        unavailable = httpx.get(base + "/health", timeout=5)
        assert unavailable.status_code == 503 and unavailable.json()["status"] == "unavailable"


def test_never_a_plain_request_to_an_lmcache_sender(tmp_path, model_dir):
    """Under LMCache, a prefill (sender) instance's engine dies on a request without a disagg_spec: with no decode
    replica, the router answers 503 instead of serving from prefill, and refuses to be told otherwise."""
    sender = 18243
    with standin(sender, tmp_path, "--lmcache-role", "sender"), \
            router(18244, tmp_path, model_dir, [sender], [NOTHING_LISTENS], threshold=0, kv_protocol="lmcache",
                   env={ADMIN_TOKEN_ENV: TOKEN}, ready="/v1/models",
                   upstreams={"lmcache_init_ports": [18245], "lmcache_alloc_ports": [18246]}, **QUICK):
        base = url(18244)
        assert wait_for(lambda: breaker(base, "decode", NOTHING_LISTENS) == "open")
        for threshold in (0, 100_000):  # a long and a short prompt
            httpx.put(base + "/admin/config", json={"threshold": threshold}, headers=ADMIN, timeout=5)
            refused = httpx.post(base + "/v1/completions", json=BODY, timeout=10)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert records(sender) == []
        forced = httpx.put(base + "/admin/config", json={"serve_from_prefill": True}, headers=ADMIN, timeout=5)
        assert forced.status_code == 400 and forced.json()["error"]["param"] == "serve_from_prefill"


# --- P/D on uncached tokens -----------------------------------------------------------------------------------------

def test_uncached_basis_sends_a_cached_conversation_direct(tmp_path, model_dir):
    """A long first turn is disaggregated; its follow-up (the same prefix, a few tokens more) is long too, but the
    decode replica holds its prefix: under `uncached` it goes direct (`cached_prefix`), under `prompt` it is
    disaggregated again."""
    prefill, decode = 18251, 18252
    first = "the conversation so far " * 40  # about 200 tokens
    follow_up = first + "and one more question"
    with standin(prefill, tmp_path), standin(decode, tmp_path), \
            router(18253, tmp_path, model_dir, [prefill], [decode], threshold=100, threshold_basis="uncached",
                   env={ADMIN_TOKEN_ENV: TOKEN}):
        base = url(18253)

        def send(prompt: str) -> httpx.Response:
            response = httpx.post(base + "/v1/completions", json={**BODY, "prompt": prompt}, timeout=10)
            assert response.status_code == 200, response.text
            return response

        opening = send(first)
        assert (opening.headers[PATH_HEADER], opening.headers[REASON_HEADER]) == ("disaggregated", "over_threshold")
        cached = send(follow_up)
        assert (cached.headers[PATH_HEADER], cached.headers[REASON_HEADER]) == ("direct", "cached_prefix")
        httpx.put(base + "/admin/config", json={"threshold_basis": "prompt"}, headers=ADMIN, timeout=5)
        assert send(follow_up + " again").headers[PATH_HEADER] == "disaggregated"
        assert metric(base, "pdlab_router_decisions_total", path="direct", reason="cached_prefix") == 1
        assert metric(base, "pdlab_router_decisions_total", path="disaggregated", reason="over_threshold") == 2
