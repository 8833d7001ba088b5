"""LMCache's P/D behind the router, on real processes: labs/local-1p1d-lmcache.yaml with the tiny model and ports of
its own, started with `pdlab up` and stopped with `pdlab down` as docs/lmcache.md shows it (`pdlab up` itself
checks, while warming up, that a prompt's KV is pushed, reported and loaded: it fails otherwise).

One test, one deployment (start-up is the slow part): what vLLM computes from pushed KV is checked against what
the decode instance computes alone, and what LMCache did is read from LMCache's own log lines and from vLLM's count
of prompt tokens it took from LMCache, not inferred. The cases left to stand-ins (tests/router/test_router_lmcache.py:
several decode replicas, fallbacks, hostile disagg_spec) are the router's, not LMCache's."""

from __future__ import annotations

import httpx
import pytest
import yaml

from pdlab.deploy import Deployment
from pdlab.lmcache import figures
from pdlab.load.prompts import PromptBuilder
from pdlab.settings import DECODE_REPLICA_HEADER, KV_WAIT_MS_HEADER, PATH_HEADER, REQUEST_ID_HEADER
from tests.conftest import REPO, TEST_MODEL, pdlab_down, run_pdlab

# Extended (`pytest -m extended`): make test has no room for a third LMCache deployment. What it checks is checked
# there by notebook 03 (LMCache P/D behind the router, greedy tokens as one instance writes them, every traced
# prompt pushed and loaded) and by the demo lab's LMCache scenario under `pdlab run` (tests/test_docs_commands.py);
# what only this test does is start it with `pdlab up` as docs/lmcache.md types it, and compare logprobs.
pytestmark = [pytest.mark.e2e, pytest.mark.extended]

NAME = "pytest-lmcache"
PREFILL, DECODE, ROUTER = 8140, 8141, 8149
THRESHOLD = 256


def lab_file(folder) -> str:
    """labs/local-1p1d-lmcache.yaml with the tiny model and ports of its own (clear of the other tests')."""
    lab = yaml.safe_load((REPO / "labs" / "local-1p1d-lmcache.yaml").read_text())
    dep = lab["deployment"]
    lab["name"] = dep["name"] = NAME
    dep["model"]["name"] = TEST_MODEL
    dep["router"].update({"port": ROUTER, "threshold": THRESHOLD})
    dep["connector"]["lmcache"].update({"peer_init_port": 18300, "peer_alloc_port": 18400, "notify_port": 18500,
                                       "api_port": 18110, "push_timeout_s": 10})
    prefill, decode = dep["instances"]
    prefill.update({"port": PREFILL, "nixl_side_channel_port": 8142})
    decode.update({"port": DECODE, "nixl_side_channel_port": 8143})
    path = folder / f"{NAME}.yaml"
    path.write_text(yaml.safe_dump(lab))
    return str(path)


def complete(url: str, prompt: str, request_id: str, max_tokens: int = 16) -> httpx.Response:
    body = {"model": TEST_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 1, "return_token_ids": True}
    response = httpx.post(url + "/v1/completions", json=body, headers={REQUEST_ID_HEADER: request_id}, timeout=120)
    assert response.status_code == 200, response.text
    return response


def answer(response: httpx.Response) -> tuple[list[int], list[float]]:
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def test_lmcache_pd_behind_the_router_decodes_pushed_kv_as_one_instance_computes_it(tmp_path):
    up = run_pdlab("up", lab_file(tmp_path))
    assert up.returncode == 0, f"pdlab up failed:\n{up.stdout}\n{up.stderr}"
    try:
        dep = Deployment.attach(NAME)
        decode_url = dep.urls("decode")[0]
        prompt = PromptBuilder(dep.model_dir).prompt(1000, "lmcache-pd")  # four 256-token chunks and a part

        # The reference: the decode instance computes the prompt alone (nothing of it is in LMCache yet).
        taken = figures.connector_hit_tokens(decode_url)
        alone = complete(decode_url, prompt, "pd-reference")
        assert figures.connector_hit_tokens(decode_url) == taken

        # Through the router: prefilled on prefill-0, pushed by LMCache to decode-0, reported, then decoded there.
        routed = complete(dep.router_url, prompt, "pd-routed")
        assert routed.headers[PATH_HEADER] == "disaggregated"
        assert routed.headers[DECODE_REPLICA_HEADER] == decode_url
        assert float(routed.headers[KV_WAIT_MS_HEADER]) >= 0  # the router waited for the push report
        (tokens, logprobs), (ref_tokens, ref_logprobs) = answer(routed), answer(alone)
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)) < 1e-3
        # vLLM took the whole prompt but its last token from LMCache (it computes that one to sample from it).
        assert figures.connector_hit_tokens(decode_url) - taken == 999
        # LMCache's own account: the sender pushed all 1,000 tokens, the receiver loaded them.
        pushed = figures.logged_tokens(dep.instance("prefill-0").log_path)["pd-routed"]
        loaded = figures.logged_tokens(dep.instance("decode-0").log_path)["pd-routed"]
        assert pushed["stored"] == 1000 and loaded["retrieved"] == 1000
        assert pushed["stored_ms"] > 0 and loaded["retrieved_ms"] > 0  # the time LMCache logs for each (its format)

        # A short prompt goes straight to the decode instance.
        short = complete(dep.router_url, PromptBuilder(dep.model_dir).prompt(50, "lmcache-short"), "pd-short", 4)
        assert short.headers[PATH_HEADER] == "direct"
    finally:
        pdlab_down(NAME, "--port 814")
