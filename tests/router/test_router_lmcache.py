"""The router speaking LMCache's P/D protocol (kv_protocol `lmcache`) to stand-in servers running as real processes
on loopback: an LMCache *sender* stand-in (prefill) that refuses requests without a well-formed disagg_spec and
pushes the prompt's KV over TCP to the receiver ports it names, and two *receiver* stand-ins (decode) on different
loopback addresses with the same port lists, as decode pods have on a cluster. The tests check that each long
prompt's KV lands on exactly the decode replica that then decodes it, that short prompts go direct, and that a
failing prefill falls back."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from pdlab.config.router import RouterSpec, RouterUpstreams
from pdlab.deploy.process import ManagedProcess
from pdlab.router.process import router_command
from pdlab.settings import ADMIN_TOKEN_ENV, DECODE_REPLICA_HEADER, PATH_HEADER, PREFILL_REPLICA_HEADER
from tests.router_processes import MODEL, metric, running, url

PREFILL, DECODE_A, DECODE_B, ROUTER = 18161, 18162, 18163, 18164
FALLBACK_ROUTER, FAILING_PREFILL, FAILING_ROUTER, NIXL_ROUTER, NIXL_PREFILL = 18165, 18166, 18167, 18168, 18170
NOTHING_LISTENS = 18198  # in this suite's port range, never started
#: Every decode replica listens on the same LMCache ports (as every decode pod does); they differ by address.
INIT_PORTS, ALLOC_PORTS = [18171, 18172], [18181, 18182]
#: Loopback addresses (Linux routes all of 127/8 to lo): the module's two replicas, and the other tests' own.
HOST_A, HOST_B, HOST_FALLBACK, HOST_NIXL = "127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"
THRESHOLD = 32
TOKEN = "lmcache-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def at(host: str, port: int) -> str:
    return f"http://{host}:{port}"


def lmcache_standin(host: str, port: int, log_dir: Path, *flags: str
                    ) -> contextlib.AbstractContextManager[ManagedProcess]:
    argv = [sys.executable, "-m", "pdlab.benchmarks.standin", "--host", host, "--port", str(port), "--model", MODEL,
            "--name", f"s{port}", *flags]
    return running(argv, at(host, port) + "/health", log_dir / f"standin-{host}-{port}.log")


def sender(port: int, log_dir: Path, *flags: str) -> contextlib.AbstractContextManager[ManagedProcess]:
    """A prefill stand-in with two GPU ranks, each pushing to its own receiver port."""
    return lmcache_standin(HOST_A, port, log_dir, "--lmcache-role", "sender", "--tp", "2", *flags)


def receiver(host: str, port: int, log_dir: Path) -> contextlib.AbstractContextManager[ManagedProcess]:
    return lmcache_standin(host, port, log_dir, "--lmcache-role", "receiver",
                           "--lmcache-init-ports", ",".join(map(str, INIT_PORTS)),
                           "--lmcache-alloc-ports", ",".join(map(str, ALLOC_PORTS)))


def lmcache_router(port: int, log_dir: Path, model_dir: str, prefill: list[str], decode: list[str],
                   kv_protocol: str = "lmcache", **spec: object) -> contextlib.AbstractContextManager[ManagedProcess]:
    ports = {"lmcache_init_ports": INIT_PORTS, "lmcache_alloc_ports": ALLOC_PORTS} if kv_protocol == "lmcache" else {}
    argv = router_command(RouterSpec(port=port, threshold=THRESHOLD, kv_protocol=kv_protocol, **spec),
                          RouterUpstreams(prefill=prefill, decode=decode, model=MODEL, tokenizer=model_dir, **ports))
    return running(argv, url(port) + "/health", log_dir / f"router-{port}.log", env={ADMIN_TOKEN_ENV: TOKEN})


def records(base: str) -> dict[str, list[dict]]:
    return httpx.get(base + "/standin/records", timeout=5).json()


def by_request_id(base: str, request_id: str) -> list[dict]:
    return [r for r in records(base)["requests"] if r["request_id"] == request_id]


def long_prompt(i: int) -> str:
    # Distinct per request: a receiver matches pushed KV by prompt, as LMCache matches by token hashes.
    return f"request {i}: " + "the river ran slowly past the old mill " * 8



@pytest.fixture(scope="module")
def pd(tmp_path_factory, model_dir) -> str:
    """One LMCache sender, two receivers (127.0.0.1 and 127.0.0.2), the router in lmcache mode, roundrobin."""
    logs = tmp_path_factory.mktemp("router-lmcache")
    with sender(PREFILL, logs), receiver(HOST_A, DECODE_A, logs), receiver(HOST_B, DECODE_B, logs), \
            lmcache_router(ROUTER, logs, model_dir, [at(HOST_A, PREFILL)],
                           [at(HOST_A, DECODE_A), at(HOST_B, DECODE_B)]):
        yield url(ROUTER)


def sse_texts(response: httpx.Response) -> list[str]:
    events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e)["choices"][0]["text"] for e in events[:-1]]


def test_long_prompts_push_kv_to_the_decode_replica_that_decodes_them(pd):
    decodes = {at(HOST_A, DECODE_A): HOST_A, at(HOST_B, DECODE_B): HOST_B}
    used = []
    for i, stream in enumerate([False, True, False, True]):
        request_id = f"lmcache-long-{i}"
        body = {"model": MODEL, "prompt": long_prompt(i), "max_tokens": 4, "stream": stream}
        with httpx.stream("POST", pd + "/v1/completions", json=body, headers={"x-request-id": request_id},
                          timeout=10) as response:
            assert response.status_code == 200, response.read()
            if stream:
                assert sse_texts(response) == ["alpha ", "bravo ", "charlie ", "delta "]
            else:
                assert json.loads(response.read())["choices"][0]["text"] == "alpha bravo charlie delta"
        assert response.headers[PATH_HEADER] == "disaggregated"
        assert response.headers[PREFILL_REPLICA_HEADER] == at(HOST_A, PREFILL)
        decode = response.headers[DECODE_REPLICA_HEADER]
        used.append(decode)

        # Prefill got one token, no stream, and a disagg_spec naming the replica that then decoded.
        [prefilled] = by_request_id(at(HOST_A, PREFILL), request_id)
        assert prefilled["max_tokens"] == 1 and prefilled["stream"] is False and prefilled["kv"] == "sent"
        # The push is labelled with the request id and a suffix that keeps it unique if a client repeats its id.
        push_id = prefilled["kv_transfer_params"]["disagg_spec"]["req_id"]
        assert push_id.startswith(request_id + ".")
        assert prefilled["kv_transfer_params"] == {"disagg_spec": {
            "req_id": push_id, "receiver_host": urlsplit(decode).hostname,
            "receiver_init_port": INIT_PORTS, "receiver_alloc_port": ALLOC_PORTS}}

        # The KV arrived there, rank i on the i-th init and alloc port, before the decode request did; the decode
        # request is the client's own, with no kv_transfer_params.
        pushes = [p for p in records(decode)["pushes"] if p["req_id"] == push_id]
        assert sorted((p["rank"], p["channel"], p["port"]) for p in pushes) == [
            (0, "alloc", ALLOC_PORTS[0]), (0, "init", INIT_PORTS[0]),
            (1, "alloc", ALLOC_PORTS[1]), (1, "init", INIT_PORTS[1])]
        [decoded] = by_request_id(decode, request_id)
        assert decoded["kv"] == "pushed" and decoded["kv_transfer_params"] is None
        assert decoded["max_tokens"] == 4 and decoded["stream"] is stream

        # The other replica saw neither the KV nor the request.
        other = next(d for d in decodes if d != decode)
        assert by_request_id(other, request_id) == []
        assert not [p for p in records(other)["pushes"] if p["req_id"] == push_id]
    assert used == [at(HOST_A, DECODE_A), at(HOST_B, DECODE_B)] * 2  # roundrobin, one choice per request


def test_long_chat_prompt_is_disaggregated_the_same_way(pd):
    messages = [{"role": "user", "content": long_prompt(99)}]
    response = httpx.post(pd + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2},
                          headers={"x-request-id": "lmcache-chat"}, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers[PATH_HEADER] == "disaggregated"
    decode = response.headers[DECODE_REPLICA_HEADER]
    [prefilled] = by_request_id(at(HOST_A, PREFILL), "lmcache-chat")
    assert prefilled["kv_transfer_params"]["disagg_spec"]["receiver_host"] == urlsplit(decode).hostname
    assert by_request_id(decode, "lmcache-chat")[0]["kv"] == "pushed"


@pytest.mark.parametrize("stream", [False, True])
def test_short_prompt_goes_straight_to_decode(pd, stream):
    request_id = f"lmcache-short-{stream}"
    with httpx.stream("POST", pd + "/v1/completions", headers={"x-request-id": request_id}, timeout=10,
                      json={"model": MODEL, "prompt": "hello there", "max_tokens": 2, "stream": stream}) as response:
        assert response.status_code == 200
        if stream:
            assert sse_texts(response) == ["alpha ", "bravo "]
        else:
            response.read()
    assert response.headers[PATH_HEADER] == "direct"
    assert by_request_id(at(HOST_A, PREFILL), request_id) == []
    [decoded] = by_request_id(response.headers[DECODE_REPLICA_HEADER], request_id)
    assert decoded["kv"] == "local" and decoded["kv_transfer_params"] is None


def test_admin_config_shows_the_protocol_and_receivers_read_only(pd):
    with httpx.Client(base_url=pd, headers=ADMIN, timeout=5) as client:
        view = client.get("/admin/config").json()
        assert view["kv_protocol"] == "lmcache"
        assert view["lmcache_receivers"] == {
            at(host, port): {"receiver_host": host, "receiver_init_port": INIT_PORTS,
                             "receiver_alloc_port": ALLOC_PORTS}
            for host, port in ((HOST_A, DECODE_A), (HOST_B, DECODE_B))}
        refused = client.put("/admin/config", json={"kv_protocol": "nixl"})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "kv_protocol"
        assert refused.json()["error"]["code"] == "read_only_setting"
        assert client.put("/admin/config", json=view).json() == view  # a GET may be PUT back unchanged


def test_prefill_down_or_failing_falls_back_to_direct(tmp_path, model_dir):
    decode = at(HOST_FALLBACK, DECODE_A)
    with receiver(HOST_FALLBACK, DECODE_A, tmp_path), sender(FAILING_PREFILL, tmp_path, "--fail-every", "1"), \
            lmcache_router(FALLBACK_ROUTER, tmp_path, model_dir, [at(HOST_A, NOTHING_LISTENS)], [decode]), \
            lmcache_router(FAILING_ROUTER, tmp_path, model_dir, [at(HOST_A, FAILING_PREFILL)], [decode],
                           retries=0, breaker_failures=10):  # the policy alone (retries: test_router_resilience)
        for router_port, reason in ((FALLBACK_ROUTER, "prefill_down"), (FAILING_ROUTER, "prefill_error")):
            for stream in (False, True):
                request_id = f"lmcache-fallback-{router_port}-{stream}"
                response = httpx.post(url(router_port) + "/v1/completions", headers={"x-request-id": request_id},
                                      json={"model": MODEL, "prompt": long_prompt(router_port), "max_tokens": 2,
                                            "stream": stream}, timeout=10)
                assert response.status_code == 200, response.text
                assert response.headers[PATH_HEADER] == "direct"
                assert response.headers["x-pdlab-fallback"] == "prefill-unavailable"
                [decoded] = by_request_id(decode, request_id)
                assert decoded["kv"] == "local"  # nothing was pushed: decode prefilled it itself
            fallbacks = [metric(url(router_port), "pdlab_router_fallbacks_total", reason=why)
                         for why in (reason, "breaker_open")]
            # A prefill replica nothing listens on may be known down (its breaker opened by a health check)
            # before a request tries it.
            assert sum(fallbacks) == 2 and (reason == "prefill_down" or fallbacks == [2, 0]), fallbacks


def test_a_nixl_router_is_refused_by_an_lmcache_sender(tmp_path, model_dir):
    """The sender stand-in really checks the protocol: NIXL's kv_transfer_params get a 400, passed on."""
    with sender(NIXL_PREFILL, tmp_path), receiver(HOST_NIXL, DECODE_A, tmp_path), \
            lmcache_router(NIXL_ROUTER, tmp_path, model_dir, [at(HOST_A, NIXL_PREFILL)], [at(HOST_NIXL, DECODE_A)],
                           kv_protocol="nixl"):
        response = httpx.post(url(NIXL_ROUTER) + "/v1/completions", timeout=10,
                              json={"model": MODEL, "prompt": long_prompt(0), "max_tokens": 2})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "kv_transfer_params.disagg_spec"


@pytest.mark.parametrize(("kv_transfer_params", "param"), [
    (None, "kv_transfer_params.disagg_spec"),
    ({"do_remote_decode": True}, "kv_transfer_params.disagg_spec"),
    ({"disagg_spec": {"receiver_host": "127.0.0.1", "receiver_init_port": [1], "receiver_alloc_port": [2]}},
     "kv_transfer_params.disagg_spec.req_id"),
    ({"disagg_spec": {"req_id": "r", "receiver_init_port": [1], "receiver_alloc_port": [2]}},
     "kv_transfer_params.disagg_spec.receiver_host"),
    ({"disagg_spec": {"req_id": "r", "receiver_host": "h", "receiver_init_port": 7300, "receiver_alloc_port": [2]}},
     "kv_transfer_params.disagg_spec.receiver_init_port"),
    ({"disagg_spec": {"req_id": "r", "receiver_host": "h", "receiver_init_port": [1, 2], "receiver_alloc_port": [3]}},
     "kv_transfer_params.disagg_spec.receiver_alloc_port"),
])
def test_sender_standin_refuses_a_malformed_disagg_spec(pd, kv_transfer_params, param):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "kv_transfer_params": kv_transfer_params}
    response = httpx.post(at(HOST_A, PREFILL) + "/v1/completions", json=body, timeout=5)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and param in error["message"]


def test_router_command_carries_the_protocol_and_ports():
    upstreams = RouterUpstreams(prefill=["http://p:1"], decode=["http://d:1"], model="m", tokenizer="/m",
                                lmcache_init_ports=[7300, 7301], lmcache_alloc_ports=[7400, 7401])
    joined = " ".join(router_command(RouterSpec(kv_protocol="lmcache"), upstreams))
    assert "--lmcache-init-ports 7300 --lmcache-init-ports 7301" in joined
    assert "--lmcache-alloc-ports 7400 --lmcache-alloc-ports 7401" in joined and "--kv-protocol lmcache" in joined
    # Unset follows the router's default (nixl): no protocol flag at all.
    plain = RouterUpstreams(decode=["http://d:1"], model="m", tokenizer="/m")
    assert "--kv-protocol" not in router_command(RouterSpec(), plain)


@pytest.mark.parametrize(("flags", "named"), [
    (["--kv-protocol", "lmcache"], "--lmcache-init-ports"),
    (["--kv-protocol", "lmcache", "--lmcache-init-ports", "7300", "--lmcache-alloc-ports", "7400,7401"],
     "--lmcache-alloc-ports"),
    (["--kv-protocol", "lmcache", "--lmcache-init-ports", "73x", "--lmcache-alloc-ports", "7400"],
     "--lmcache-init-ports"),
    (["--kv-protocol", "mooncake"], "kv-protocol"),
])
def test_router_cli_refuses_incomplete_lmcache_options(model_dir, flags, named):
    result = subprocess.run([sys.executable, "-m", "pdlab.router", "serve", "--decode", "http://127.0.0.1:1",
                             "--model", MODEL, "--tokenizer", model_dir, "--port", "18169", *flags],
                            capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 2, result.stderr
    assert named in result.stderr
