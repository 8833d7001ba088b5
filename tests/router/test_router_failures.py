"""Failure behaviour with stand-in OpenAI servers as real processes on loopback: prefill down or erroring, a
decode instance dying mid-stream, upstream timeouts, and backpressure."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from pdlab.settings import ADMIN_TOKEN_ENV, PATH_HEADER
from tests.router_processes import MODEL, metric, router, standin, url

TOKEN = "failure-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
NOTHING_LISTENS = 18198  # in this suite's port range, never started
BODY = {"model": MODEL, "prompt": "a long enough prompt", "max_tokens": 3}



def test_prefill_down_falls_back_to_direct_decode_or_fails_by_policy(tmp_path, model_dir):
    with standin(18111, tmp_path), router(18112, tmp_path, model_dir, [NOTHING_LISTENS], [18111], threshold=0,
                                          env={ADMIN_TOKEN_ENV: TOKEN}):
        base = url(18112)
        for stream in (False, True):
            response = httpx.post(base + "/v1/completions", json={**BODY, "stream": stream}, timeout=10)
            assert response.status_code == 200, response.text
            assert response.headers[PATH_HEADER] == "direct"
            assert response.headers["x-pdlab-fallback"] == "prefill-unavailable"
        # Tried and refused (`prefill_down`), or known down already by a health check (`breaker_open`).
        down = ("prefill_down", "breaker_open")
        assert sum(metric(base, "pdlab_router_fallbacks_total", reason=why) for why in down) == 2
        assert httpx.get(base + "/health", timeout=5).json()["pools"]["prefill"][0]["breaker"] == "open"

        httpx.put(base + "/admin/config", json={"fallback": "fail"}, headers=ADMIN).raise_for_status()
        response = httpx.post(base + "/v1/completions", json=BODY, timeout=10)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "prefill_down"
        assert sum(metric(base, "pdlab_router_fallbacks_total", reason=why) for why in down) == 2


def test_prefill_erroring_falls_back(tmp_path, model_dir):
    with standin(18113, tmp_path, "--fail-every", "1"), standin(18114, tmp_path), \
            router(18115, tmp_path, model_dir, [18113], [18114], threshold=0, env={ADMIN_TOKEN_ENV: TOKEN},
                   retries=0, breaker_failures=10):  # the policies alone (retries and breakers: test_router_resilience)
        base = url(18115)
        response = httpx.post(base + "/v1/completions", json=BODY, timeout=10)
        assert response.status_code == 200 and response.headers[PATH_HEADER] == "direct"
        assert metric(base, "pdlab_router_fallbacks_total", reason="prefill_error") == 1
        assert metric(base, "pdlab_router_upstream_errors_total", stage="prefill", kind="http_500") == 1

        httpx.put(base + "/admin/config", json={"fallback": "fail"}, headers=ADMIN).raise_for_status()
        response = httpx.post(base + "/v1/completions", json=BODY, timeout=10)
        assert response.status_code == 502 and response.json()["error"]["code"] == "prefill_error"


def test_decode_dies_mid_stream_ends_with_an_error_event(tmp_path, model_dir):
    with standin(18116, tmp_path, "--die-after-tokens", "2") as decode, \
            router(18117, tmp_path, model_dir, [], [18116]):
        body = {**BODY, "max_tokens": 10, "stream": True}
        with httpx.stream("POST", url(18117) + "/v1/completions", json=body, timeout=10) as response:
            assert response.status_code == 200
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
        assert decode.popen.wait(timeout=10) == 3  # the stand-in really died
        assert events[-1] == "[DONE]"
        tokens = [json.loads(e) for e in events[:-2]]
        assert [t["choices"][0]["text"] for t in tokens] == ["alpha ", "bravo "]
        error = json.loads(events[-2])["error"]
        assert error["type"] == "upstream_error" and "mid-stream" in error["message"]
        assert metric(url(18117), "pdlab_router_upstream_errors_total", stage="decode",
                      kind="midstream_transport") == 1
        # The in-flight slot was released, and with no decode instance left a new request fails fast.
        assert metric(url(18117), "pdlab_router_in_flight") == 0
        response = httpx.post(url(18117) + "/v1/completions", json=BODY, timeout=10)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        # found dead by this request (`decode_down`) or by a health check before it (`decode_empty`)
        assert response.json()["error"]["code"] in ("decode_down", "decode_empty")


def test_upstream_timeout_gives_504(tmp_path, model_dir):
    with standin(18118, tmp_path, "--token-ms", "3000"), \
            router(18119, tmp_path, model_dir, [], [18118], upstream_timeout_s=0.5):
        response = httpx.post(url(18119) + "/v1/completions", json={**BODY, "max_tokens": 2}, timeout=10)
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "timeout"
        body = {**BODY, "max_tokens": 3, "stream": True}
        with httpx.stream("POST", url(18119) + "/v1/completions", json=body, timeout=10) as streamed:
            events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and '"upstream_timeout"' in events[-2]


def test_backpressure_503_with_retry_after(tmp_path, model_dir):
    with standin(18120, tmp_path, "--token-ms", "300"), \
            router(18121, tmp_path, model_dir, [], [18120], max_in_flight=2):
        base = url(18121)

        async def scenario() -> tuple[list[int], httpx.Response]:
            async with httpx.AsyncClient(base_url=base, timeout=20) as client:
                slow = [asyncio.create_task(client.post("/v1/completions", json={**BODY, "max_tokens": 5}))
                        for _ in range(2)]
                while metric(base, "pdlab_router_in_flight") < 2:
                    await asyncio.sleep(0.05)
                refused = await client.post("/v1/completions", json=BODY)
                return [r.status_code for r in await asyncio.gather(*slow)], refused

        statuses, refused = asyncio.run(scenario())
        assert statuses == [200, 200]
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "overloaded"
        assert metric(base, "pdlab_router_rejected_total", reason="overloaded") == 1
        assert httpx.post(base + "/v1/completions", json={**BODY, "max_tokens": 1}, timeout=10).status_code == 200


def test_client_disconnect_aborts_the_upstream_stream(tmp_path, model_dir):
    with standin(18122, tmp_path, "--token-ms", "200"), router(18123, tmp_path, model_dir, [], [18122]):
        base = url(18123)
        with httpx.stream("POST", base + "/v1/completions", json={**BODY, "max_tokens": 100, "stream": True},
                          timeout=10) as response:
            chunks = response.iter_raw()  # kept: a dropped iterator would close the stream
            next(chunks)
            assert metric(url(18122), "vllm:num_requests_running", model_name=MODEL) == 1
        # Leaving the block closed the connection after one token of a 20-second answer.
        deadline = time.monotonic() + 5
        while metric(base, "pdlab_router_client_disconnects_total") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(base, "pdlab_router_client_disconnects_total") == 1
        assert metric(base, "pdlab_router_in_flight") == 0
        while metric(url(18122), "vllm:num_requests_running", model_name=MODEL) > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(url(18122), "vllm:num_requests_running", model_name=MODEL) == 0  # upstream aborted too
        assert metric(base, "pdlab_router_upstream_errors_total", stage="decode", kind="midstream_transport") == 0
