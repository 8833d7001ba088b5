"""Replica choice through the live router (two decode stand-ins), the process argv, and a prompt stop."""

from __future__ import annotations

import sys
import time

import httpx

from pdlab.config.router import RouterSpec, RouterUpstreams
from pdlab.router.process import router_command, router_env
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
    upstreams = RouterUpstreams(prefill=["http://p:1"], decode=["http://d:1", "http://d:2"], model="m",
                                tokenizer="/models/m", max_model_len=2048, block_size=32)
    argv = router_command(RouterSpec(port=18999, threshold=7, decode_strategy="kvaware"), upstreams)
    assert argv[:4] == [sys.executable, "-m", "pdlab.router", "serve"]
    joined = " ".join(argv)
    assert "--threshold 7" in joined and "--decode-strategy kvaware" in joined and "--block-size 32" in joined
    assert "--decode http://d:1 --decode http://d:2" in joined and "--max-model-len 2048" in joined
    # The admin token never goes on a command line: the router reads it from its environment.
    with_token = RouterSpec(admin_token="s3cret")
    plain = RouterUpstreams(decode=["http://d:1"], model="m", tokenizer="/m")
    assert "s3cret" not in " ".join(router_command(with_token, plain))
    assert router_env(with_token, {})[ADMIN_TOKEN_ENV] == "s3cret"
    assert "--max-model-len" not in router_command(with_token, plain) and "--prefill" not in router_command(
        with_token, plain)


def test_every_spec_field_is_a_serve_option_and_round_trips():
    """`pdlab router serve`'s options are RouterSpec's and RouterUpstreams' fields (the secret excepted): a spec
    written as a command line and parsed by the command comes back equal."""
    import typer

    from pdlab.config.options import cli_fields, option_name, spec_from_options
    from pdlab.router.cli import app as router_app

    serve = typer.main.get_command(router_app).commands["serve"]
    options = {opt for param in serve.params for opt in param.opts}
    for cls in (RouterSpec, RouterUpstreams):
        for name in cli_fields(cls):
            assert option_name(name) in options, name
    assert "--admin-token" not in options
    spec = RouterSpec(port=18999, threshold=7, threshold_basis="uncached", decode_strategy="kvaware",
                      serve_from_prefill=False, retries=0, upstream_timeout_s=12.5, max_body_bytes=4096)
    upstreams = RouterUpstreams(prefill=["http://p:1"], decode=["http://d:1", "http://d:2"], model="m",
                                tokenizer="/models/m", max_model_len=2048, block_size=32)
    params = serve.make_context("serve", router_command(spec, upstreams)[4:]).params
    assert spec_from_options(RouterSpec, params) == spec
    assert spec_from_options(RouterUpstreams, params) == upstreams


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
