"""Replica choice through the live router (two decode stand-ins), the process argv, and a prompt stop."""

from __future__ import annotations

import sys
import time

import httpx

from pdlab.config.router import RouterSpec
from pdlab.router.process import router_command
from pdlab.settings import ADMIN_TOKEN_ENV, DECODE_REPLICA_HEADER
from tests.router_processes import MODEL, metric, router, standin, url

TOKEN = "pools-token"
BODY = {"model": MODEL, "prompt": "short", "max_tokens": 2}



def test_strategies_choose_decode_replicas_live(tmp_path, model_dir):
    with standin(18131, tmp_path), standin(18132, tmp_path), \
            router(18133, tmp_path, model_dir, [], [18131, 18132], env={ADMIN_TOKEN_ENV: TOKEN}):
        base = url(18133)

        def decode_of(**kwargs) -> str:
            response = httpx.post(base + "/v1/completions", timeout=10, **kwargs)
            assert response.status_code == 200
            return response.headers[DECODE_REPLICA_HEADER]

        chosen = [decode_of(json=BODY) for _ in range(4)]
        assert chosen == [url(18131), url(18132), url(18131), url(18132)]  # roundrobin

        httpx.put(base + "/admin/config", json={"decode_strategy": "session"},
                  headers={"Authorization": f"Bearer {TOKEN}"}).raise_for_status()
        by_header = {decode_of(json=BODY, headers={"x-session-id": "alice"}) for _ in range(4)}
        by_user = {decode_of(json={**BODY, "user": "alice"}) for _ in range(4)}
        assert len(by_header) == 1 and by_header == by_user  # same key, same replica, header or `user`
        keys = {decode_of(json={**BODY, "user": f"user-{i}"}) for i in range(20)}
        assert keys == {url(18131), url(18132)}  # different sessions spread


def test_router_command_argv():
    argv = router_command(RouterSpec(port=18999, threshold=7, decode_strategy="kvaware"), ["http://p:1"],
                          ["http://d:1", "http://d:2"], "m", "/models/m", 2048, 32)
    assert argv[:4] == [sys.executable, "-m", "pdlab.router", "serve"]
    joined = " ".join(argv)
    assert "--threshold 7" in joined and "--decode-strategy kvaware" in joined and "--block-size 32" in joined
    assert "--decode http://d:1 --decode http://d:2" in joined and "--max-model-len 2048" in joined
    assert "--admin-token" not in argv  # from the environment unless the spec sets one
    with_token = router_command(RouterSpec(admin_token="s3cret"), [], ["http://d:1"], "m", "/m", None, 16)
    assert with_token[with_token.index("--admin-token") + 1] == "s3cret"
    assert "--max-model-len" not in with_token and "--prefill" not in with_token


def test_router_stops_promptly_with_a_stream_open(tmp_path, model_dir):
    with standin(18134, tmp_path, "--token-ms", "1000"), router(18135, tmp_path, model_dir, [], [18134]) as proc:
        with httpx.stream("POST", url(18135) + "/v1/completions", json={**BODY, "max_tokens": 30, "stream": True},
                          timeout=30) as response:
            reader = response.iter_raw()  # kept: a dropped iterator would close the stream
            next(reader)  # the stream is open and flowing
            assert metric(url(18134), "vllm:num_requests_running", model_name=MODEL) == 1
            started = time.monotonic()
            proc.popen.terminate()
            proc.popen.wait(timeout=15)
        assert time.monotonic() - started < 10


def test_leastloaded_sees_load_that_bypasses_the_router(tmp_path, model_dir):
    """Requests sent to a replica directly (not through the router) show up in its scraped vLLM gauges."""
    with standin(18136, tmp_path, "--token-ms", "100"), standin(18137, tmp_path, "--token-ms", "100"), \
            router(18138, tmp_path, model_dir, [], [18136, 18137], decode_strategy="leastloaded"):
        busy = [httpx.stream("POST", url(18136) + "/v1/completions", timeout=30,
                             json={**BODY, "max_tokens": 60, "stream": True}) for _ in range(3)]
        streams = [b.__enter__() for b in busy]
        try:
            readers = [s.iter_raw() for s in streams]  # keep them: a dropped iterator closes its stream
            for reader in readers:
                next(reader)
            time.sleep(1.5)  # more than one scrape interval
            chosen = {httpx.post(url(18138) + "/v1/completions", json=BODY, timeout=10).headers[DECODE_REPLICA_HEADER]
                      for _ in range(4)}
            assert chosen == {url(18137)}
        finally:
            for b in busy:
                b.__exit__(None, None, None)
