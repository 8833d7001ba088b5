"""End to end with real vLLM 1P1D behind the router: the threshold decides each request's path, the header says
which, both paths give the same greedy tokens, and a live threshold change routes the very next request."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from pdlab.load.prompts import PromptBuilder
from pdlab.settings import PATH_HEADER, PROMPT_TOKENS_HEADER
from tests.conftest import ROUTER_THRESHOLD

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def builder(live_1p1d) -> PromptBuilder:
    return PromptBuilder(live_1p1d.model_dir)


@pytest.fixture
def router(live_1p1d) -> Iterator[tuple[str, dict[str, str]]]:
    """The router's URL and admin headers; the threshold is restored after each test."""
    headers = {"Authorization": f"Bearer {live_1p1d.admin_token}"}
    yield live_1p1d.router_url, headers
    httpx.put(live_1p1d.router_url + "/admin/config", json={"threshold": ROUTER_THRESHOLD}, headers=headers,
              timeout=10).raise_for_status()


def complete(url: str, model: str, prompt: str, max_tokens: int = 12, stream: bool = False) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": stream}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response


def streamed_text(response: httpx.Response) -> str:
    pieces = []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[6:])
            assert "error" not in event, event
            pieces += [choice["text"] for choice in event.get("choices", [])]
    return "".join(pieces)


@pytest.mark.parametrize("offset", [-1, 0, 1])
def test_threshold_boundary_takes_the_path_the_header_says(live_1p1d, router, builder, offset):
    url, _ = router
    tokens = ROUTER_THRESHOLD + offset
    response = complete(url, live_1p1d.served_model, builder.prompt(tokens, key=f"boundary{offset}"))
    assert int(response.headers[PROMPT_TOKENS_HEADER]) == tokens == response.json()["usage"]["prompt_tokens"]
    assert response.headers[PATH_HEADER] == ("disaggregated" if offset >= 0 else "direct")


def test_both_paths_give_the_same_greedy_tokens(live_1p1d, router, builder):
    url, admin = router
    prompt = builder.prompt(ROUTER_THRESHOLD * 3, key="same-tokens")
    disaggregated = complete(url, live_1p1d.served_model, prompt, max_tokens=20)
    assert disaggregated.headers[PATH_HEADER] == "disaggregated"

    httpx.put(url + "/admin/config", json={"threshold": 100_000}, headers=admin, timeout=10).raise_for_status()
    direct = complete(url, live_1p1d.served_model, prompt, max_tokens=20)
    assert direct.headers[PATH_HEADER] == "direct"
    assert direct.json()["choices"][0]["text"] == disaggregated.json()["choices"][0]["text"]

    httpx.put(url + "/admin/config", json={"threshold": 0}, headers=admin, timeout=10).raise_for_status()
    streamed = complete(url, live_1p1d.served_model, prompt, max_tokens=20, stream=True)
    assert streamed.headers[PATH_HEADER] == "disaggregated"
    assert streamed_text(streamed) == direct.json()["choices"][0]["text"]


def test_admin_threshold_change_routes_the_next_request(live_1p1d, router, builder):
    url, admin = router
    prompt = builder.prompt(ROUTER_THRESHOLD // 2, key="admin-change")
    assert complete(url, live_1p1d.served_model, prompt).headers[PATH_HEADER] == "direct"
    changed = httpx.put(url + "/admin/config", json={"threshold": 0}, headers=admin, timeout=10)
    assert changed.status_code == 200 and changed.json()["threshold"] == 0
    assert httpx.get(url + "/admin/config", headers=admin, timeout=10).json()["threshold"] == 0
    assert complete(url, live_1p1d.served_model, prompt).headers[PATH_HEADER] == "disaggregated"
    refused = httpx.put(url + "/admin/config", json={"threshold": 5}, timeout=10)
    assert refused.status_code in (401, 403) and "error" in refused.json()
