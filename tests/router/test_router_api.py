"""The router's HTTP API against stand-in OpenAI servers running as real processes on loopback: routing by
threshold, headers, request ids, the admin API, and every bad input refused with a 400 before any upstream call."""

from __future__ import annotations

import json

import httpx
import pytest

from pdlab.router.tokens import PromptTokenizer
from pdlab.settings import (
    ADMIN_TOKEN_ENV,
    DECODE_REPLICA_HEADER,
    PATH_HEADER,
    PREFILL_MS_HEADER,
    PREFILL_REPLICA_HEADER,
    PROMPT_TOKENS_HEADER,
)
from tests.router_processes import MODEL, metric, router, standin, url

PREFILL, DECODE, ROUTER = 18101, 18102, 18103
TOKEN = "test-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = "Disaggregated serving splits prefill from decode so long prompts do not stall short ones."



@pytest.fixture(scope="module")
def base(tmp_path_factory, model_dir) -> str:
    logs = tmp_path_factory.mktemp("router-api")
    with standin(PREFILL, logs), standin(DECODE, logs), \
            router(ROUTER, logs, model_dir, [PREFILL], [DECODE], env={ADMIN_TOKEN_ENV: TOKEN}):
        yield url(ROUTER)


@pytest.fixture
def client(base):
    with httpx.Client(base_url=base, timeout=10.0) as c:
        yield c
        c.put("/admin/config", json={"threshold": 4096, "fallback": "fallback", "prefill_strategy": "roundrobin",
                                     "decode_strategy": "roundrobin", "threshold_basis": "prompt"}, headers=ADMIN)


def set_config(client: httpx.Client, **settings) -> dict:
    response = client.put("/admin/config", json=settings, headers=ADMIN)
    assert response.status_code == 200, response.text
    return response.json()


def complete(client: httpx.Client, prompt=PROMPT, **extra) -> httpx.Response:
    return client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3, **extra})


def upstream_requests() -> float:
    return sum(metric(url(port), "standin_requests_total", kind=kind)
               for port in (PREFILL, DECODE) for kind in ("local", "remote_prefilled"))


def test_prompt_token_header_is_the_exact_count(client, model_dir):
    expected = PromptTokenizer(model_dir).completion(PROMPT).count
    response = complete(client)
    assert response.status_code == 200
    assert int(response.headers[PROMPT_TOKENS_HEADER]) == expected


@pytest.mark.parametrize(("offset", "path"), [(-1, "direct"), (0, "disaggregated"), (1, "disaggregated")])
def test_threshold_boundary(client, model_dir, offset, path):
    """Threshold T-1 / T / T+1 relative to the prompt's count N: tokens >= threshold disaggregates, i.e.
    T = N+1 -> direct, T = N -> disaggregated, T = N-1 -> disaggregated."""
    tokens = PromptTokenizer(model_dir).completion(PROMPT).count
    set_config(client, threshold=tokens - offset)
    response = complete(client)
    assert response.status_code == 200
    assert response.headers[PATH_HEADER] == path
    assert (PREFILL_REPLICA_HEADER in response.headers) == (path == "disaggregated")
    assert (PREFILL_MS_HEADER in response.headers) == (path == "disaggregated")
    if path == "disaggregated":
        assert 0 < float(response.headers[PREFILL_MS_HEADER]) < 10_000
    assert response.headers[DECODE_REPLICA_HEADER] == url(DECODE)


def test_disaggregated_request_carries_kv_params_to_decode(client):
    set_config(client, threshold=0)
    before_kv = metric(url(ROUTER), "pdlab_router_kv_transfer_params_total", present="yes")
    before_remote = metric(url(DECODE), "standin_requests_total", kind="remote_prefilled")
    response = complete(client)
    assert response.status_code == 200 and response.headers[PATH_HEADER] == "disaggregated"
    assert metric(url(ROUTER), "pdlab_router_kv_transfer_params_total", present="yes") == before_kv + 1
    # The decode stand-in saw the prefill's kv_transfer_params (it skips its own prefill then).
    assert metric(url(DECODE), "standin_requests_total", kind="remote_prefilled") == before_remote + 1


def test_a_lone_surrogate_outside_the_prompt_goes_through_both_legs(client):
    """The router re-encodes a P/D request's body for each leg: what its JSON parser lets in, it can write."""
    set_config(client, threshold=0)
    body = b'{"model": "pdlab-tiny", "prompt": "hi", "max_tokens": 2, "user": "a \\ud800 b"}'
    response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert response.headers[PATH_HEADER] == "disaggregated"


@pytest.mark.parametrize("threshold", [0, 10**6])
def test_streaming_chat_both_paths(client, threshold):
    set_config(client, threshold=threshold)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert len(events) == 5
    assert json.loads(events[0].removeprefix("data: "))["object"] == "chat.completion.chunk"
    assert response.headers[PATH_HEADER] == ("disaggregated" if threshold == 0 else "direct")


def test_request_id_is_propagated(client):
    set_config(client, threshold=0)
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
                           headers={"x-request-id": "req-123"})
    assert response.headers["x-request-id"] == "req-123"
    assert response.json()["id"] == "req-123"  # the stand-in answers with the X-Request-Id it received
    generated = complete(client).headers["x-request-id"]
    assert generated.startswith("pdlab-")


def test_models_health_metrics(client):
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 8192
    assert client.get("/health").status_code == 200
    complete(client)
    text = client.get("/metrics").text
    assert 'pdlab_router_requests_total{endpoint="/v1/completions",path="direct"}' in text
    assert "pdlab_router_choices_total" in text and "pdlab_router_ttft_seconds" in text


BAD_INPUTS = [
    ("malformed json", b"{not json", None, "invalid_json"),
    ("not an object", b"[1, 2]", None, "invalid_body"),
    ("missing model", {"prompt": "hi"}, "model", "missing_field"),
    ("unknown model", {"model": "gpt-9", "prompt": "hi"}, "model", "model_not_found"),
    ("missing prompt", {"model": MODEL}, "prompt", "missing_field"),
    ("negative max_tokens", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, "max_tokens", "invalid_value"),
    ("string max_tokens", {"model": MODEL, "prompt": "hi", "max_tokens": "5"}, "max_tokens", "invalid_type"),
    ("max_tokens over context", {"model": MODEL, "prompt": "hi", "max_tokens": 9000}, "max_tokens",
     "context_length_exceeded"),
    ("prompt over context", {"model": MODEL, "prompt": "word " * 9000}, "prompt", "context_length_exceeded"),
    ("bad stream flag", {"model": MODEL, "prompt": "hi", "stream": "yes"}, "stream", "invalid_type"),
    ("batch prompt", {"model": MODEL, "prompt": ["a", "b"]}, "prompt", "invalid_prompt"),
    # Client input that used to reach a 500: a body nested deeper than Python's parser recurses, a lone surrogate
    # (the tokenizer cannot take it), chat_template_kwargs of the wrong shape (below, with the chat inputs).
    ("nested 100,000 deep", b'{"model": "pdlab-tiny", "prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000
     + b"}", None, "invalid_json"),
    ("lone surrogate", b'{"model": "pdlab-tiny", "prompt": "a \\ud800 b"}', "prompt", "invalid_prompt"),
    ("NaN", b'{"model": "pdlab-tiny", "prompt": "hi", "temperature": NaN}', None, "invalid_json"),
    ("prompt far over context", {"model": MODEL, "prompt": "x" * 300_000}, "prompt", "context_length_exceeded"),
]


@pytest.mark.parametrize(("name", "body", "param", "code"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_refused_before_any_upstream_call(client, name, body, param, code):
    set_config(client, threshold=0)  # a good request would call both stand-ins
    before = upstream_requests()
    if isinstance(body, bytes):
        response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    else:
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] == code
    assert error["message"]
    assert upstream_requests() == before


@pytest.mark.parametrize(("body", "param"), [
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"content": "no role"}]}, "messages.0"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x " * 9000}]}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -5},
     "max_completion_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": ["a"]},
     "chat_template_kwargs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": 1}},
     "chat_template_kwargs"),
])
def test_bad_chat_input(client, body, param):
    before = upstream_requests()
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert upstream_requests() == before


# --- admin API ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                                     {"Authorization": TOKEN}])
def test_admin_requires_the_bearer_token(client, headers):
    for method in ("GET", "PUT"):
        response = client.request(method, "/admin/config", json={"threshold": 1}, headers=headers)
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "unauthorized"
    assert client.get("/admin/config", headers=ADMIN).json()["threshold"] == 4096  # unchanged


def test_admin_get_and_put_apply_at_once(client):
    assert client.get("/admin/config", headers=ADMIN).json() == {
        "threshold": 4096, "threshold_basis": "prompt", "prefill_strategy": "roundrobin",
        "decode_strategy": "roundrobin", "fallback": "fallback", "serve_from_prefill": None, "kv_protocol": "nixl"}
    assert complete(client).headers[PATH_HEADER] == "direct"
    updated = set_config(client, threshold=0, decode_strategy="leastloaded")
    assert updated["threshold"] == 0 and updated["decode_strategy"] == "leastloaded"
    assert updated["prefill_strategy"] == "roundrobin"  # untouched fields keep their value
    assert complete(client).headers[PATH_HEADER] == "disaggregated"
    assert metric(url(ROUTER), "pdlab_router_threshold_tokens") == 0


@pytest.mark.parametrize(("update", "field"), [
    ({"threshold": -1}, "threshold"), ({"threshold": "many"}, "threshold"),
    ({"prefill_strategy": "random"}, "prefill_strategy"), ({"fallback": "maybe"}, "fallback"),
    ({"thresold": 10}, "thresold"),
    # Strictly typed and bounded: no coercion of strings or booleans, no absurd values.
    ({"threshold": "100"}, "threshold"), ({"threshold": True}, "threshold"), ({"threshold": 10**30}, "threshold"),
    ({"threshold": 1.5}, "threshold"), ({"serve_from_prefill": "yes"}, "serve_from_prefill"),
    ({"threshold_basis": "cached"}, "threshold_basis"),
])
def test_admin_put_validates_and_names_the_field(client, update, field):
    response = client.put("/admin/config", json=update, headers=ADMIN)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]
    assert client.get("/admin/config", headers=ADMIN).json()["threshold"] == 4096


def test_admin_put_malformed_body(client):
    assert client.put("/admin/config", content=b"{", headers=ADMIN).status_code == 400
    assert client.put("/admin/config", json=[1], headers=ADMIN).status_code == 400
    deep = client.put("/admin/config", content=b'{"threshold": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
                      headers=ADMIN)
    assert deep.status_code == 400 and deep.json()["error"]["code"] == "invalid_json"
    big = client.put("/admin/config", content=b'{"threshold": 1, "x": "' + b"y" * 100_000 + b'"}', headers=ADMIN)
    assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"


@pytest.mark.parametrize(("method", "path", "status"), [("GET", "/nowhere", 404), ("POST", "/v1/embeddings", 404),
                                                         ("GET", "/v1/completions", 405),
                                                         ("DELETE", "/admin/config", 405)])
def test_unknown_paths_and_methods_get_openai_errors(client, method, path, status):
    response = client.request(method, path)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_admin_disabled_without_a_token(tmp_path, model_dir):
    """No token in the spec or the environment: the admin API refuses and says how to set one."""
    env = {ADMIN_TOKEN_ENV: ""}
    with router(18104, tmp_path, model_dir, [], [18199], env=env, ready="/v1/models"):
        response = httpx.get(url(18104) + "/admin/config", headers={"Authorization": "Bearer anything"})
    assert response.status_code == 403
    message = response.json()["error"]["message"]
    assert ADMIN_TOKEN_ENV in message and "admin_token" in message
