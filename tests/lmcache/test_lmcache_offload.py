"""LMCache as an offload tier, on real processes: the `lmcache_cpu` scenario of labs/lmcache-offload.yaml (a colocated
instance with LMCache's CPU tier), cut to one instance of the tiny model with ports of its own, vLLM's own prefix
cache off so that only LMCache can answer a repeated prefix, started with `pdlab up` and stopped with `pdlab down`.

What LMCache did is read from its log lines (per request) and from vLLM's count of prompt tokens it took from its
KV connector, not inferred; what vLLM computed from the loaded KV is compared with what it computed from nothing."""

from __future__ import annotations

import pytest
import yaml

from pdlab.deploy import Deployment
from pdlab.lmcache import figures
from pdlab.load.prompts import PromptBuilder
from tests.conftest import REPO, TEST_MODEL, pdlab_down, run_pdlab
from tests.lmcache.test_lmcache_pd import answer
from tests.lmcache.test_lmcache_pd import complete as pd_complete

pytestmark = pytest.mark.e2e

NAME = "pytest-lmcache-offload"
PORT = 8156
CHUNK = 256


def lab_file(folder) -> str:
    """The lab's LMCache scenario as one deployment: one instance, the tiny model, ports of its own, no prefix
    cache of vLLM's own."""
    lab = yaml.safe_load((REPO / "labs" / "lmcache-offload.yaml").read_text())
    dep = lab["scenarios"]["lmcache_cpu"]
    assert dep["connector"]["kind"] == "lmcache" and all(i["role"] == "colocated" for i in dep["instances"])
    instance = dict(dep["instances"][0], port=PORT, nixl_side_channel_port=PORT + 1)
    instance["engine"] = dict(instance["engine"], enable_prefix_caching=False)
    dep = dict(dep, name=NAME, model=dict(dep["model"], name=TEST_MODEL), instances=[instance])
    dep["connector"] = dict(dep["connector"], lmcache=dict(dep["connector"]["lmcache"], api_port=18190))
    dep.pop("router")
    path = folder / f"{NAME}.yaml"
    path.write_text(yaml.safe_dump({"name": NAME, "deployment": dep}))
    return str(path)


def complete(url: str, prompt: str, request_id: str) -> tuple[list[int], list[float]]:
    """A greedy completion's token ids and logprobs (the P/D test's request, shorter)."""
    return answer(pd_complete(url, prompt, request_id, max_tokens=12))


def test_lmcache_cpu_tier_serves_a_repeated_prefix_as_vllm_computes_it(tmp_path):
    up = run_pdlab("up", lab_file(tmp_path))
    assert up.returncode == 0, f"pdlab up failed:\n{up.stdout}\n{up.stderr}"
    try:
        dep = Deployment.attach(NAME)
        url, log = dep.urls("colocated")[0], dep.instance("colocated-0").log_path
        prompts = PromptBuilder(dep.model_dir)
        turn = prompts.prompt(1000, "offload-turn")  # three whole 256-token chunks and a part

        taken = figures.connector_hit_tokens(url)
        first = complete(url, turn, "turn-1")
        assert figures.connector_hit_tokens(url) == taken  # nothing of it was in LMCache yet
        assert figures.logged_tokens(log)["turn-1"]["stored"] >= 3 * CHUNK  # ... and now its whole chunks are

        # The same prompt again: vLLM takes its whole chunks from LMCache's CPU tier, and computes the same answer.
        again = complete(url, turn, "turn-1-again")
        loaded = figures.connector_hit_tokens(url) - taken
        assert loaded == 3 * CHUNK, loaded
        assert figures.logged_tokens(log)["turn-1-again"]["retrieved"] == 3 * CHUNK
        assert again[0] == first[0]
        assert max(abs(a - b) for a, b in zip(again[1], first[1], strict=True)) < 1e-3

        # A follow-up turn (the conversation so far, then more) loads the same chunks; a prompt of the same length
        # that shares nothing with it loads none (the negative control: hits come from equal prefixes only).
        complete(url, turn + prompts.prompt(300, "offload-follow-up"), "turn-2")
        assert figures.connector_hit_tokens(url) - taken == 2 * 3 * CHUNK
        complete(url, prompts.prompt(1000, "offload-other"), "other")
        assert figures.connector_hit_tokens(url) - taken == 2 * 3 * CHUNK
        assert figures.logged_tokens(log).get("other", {}).get("retrieved", 0) == 0
    finally:
        pdlab_down(NAME, f"--port {PORT}")
