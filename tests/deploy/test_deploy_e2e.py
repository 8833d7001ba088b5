"""End to end, real processes: a 1P1D vLLM deployment moves a real KV cache with NIXL."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdlab.pdrequest import pd_completion
from tests.conftest import run_pdlab

pytestmark = pytest.mark.e2e

def words(count: int) -> str:
    from pdlab.settings import data_dir

    pool = (data_dir() / "corpus" / "serving-notes.txt").read_text().split()
    return " ".join(pool[i % len(pool)] for i in range(count))


def pd_urls(dep) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    return dep.urls("prefill")[0], dep.urls("decode")[0]


def metric_sum(base_url: str, name: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total


def colocated_completion(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()


def test_pd_greedy_output_matches_colocated_and_kv_moves(live_1p1d):
    """A multi-block prompt prefilled on one instance and decoded on the other gives the same greedy tokens as
    one instance doing both: the decode instance never saw the prompt, so the KV cache must have moved."""
    dep = live_1p1d
    prompt = words(600)  # several 128-token KV blocks
    bytes_before = metric_sum(dep.urls('decode')[0], "vllm:nixl_bytes_transferred_sum")
    reference = colocated_completion(dep.urls('prefill')[0], dep.served_model, prompt, max_tokens=24)
    assert reference["usage"]["prompt_tokens"] > 3 * 128

    result = pd_completion(*pd_urls(dep), dep.served_model, prompt, max_tokens=24, stream=False)
    assert result.kv_transfer_params and result.kv_transfer_params.get("remote_block_ids")
    assert result.completion_tokens == 24
    assert result.text == reference["choices"][0]["text"]

    streamed = pd_completion(*pd_urls(dep), dep.served_model, prompt, max_tokens=24, stream=True)
    assert streamed.text == reference["choices"][0]["text"]
    assert len(streamed.token_times_s) == streamed.completion_tokens == 24

    moved = metric_sum(dep.urls('decode')[0], "vllm:nixl_bytes_transferred_sum") - bytes_before
    assert moved > 0, "the decode instance reports no NIXL bytes transferred"


def test_an_idle_pd_deployment_leaves_the_cores_free(live_1p1d):
    """pdlab's NixlConnector starts no NIXL progress thread: between requests the P/D instances use almost no CPU
    (vLLM's own connector keeps a core per instance busy: 9.9 CPU-seconds each in 10 s on a 2-core machine)."""
    import time

    import psutil

    trees = [psutil.Process(inst.pid) for inst in live_1p1d.instances]
    procs = [p for tree in trees for p in (tree, *tree.children(recursive=True))]

    def cpu_s() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in procs if p.is_running())

    pd_completion(*pd_urls(live_1p1d), live_1p1d.served_model, words(300), max_tokens=4, stream=False)
    time.sleep(1.0)  # the request's last step and the transfer's notification are done
    before, began = cpu_s(), time.monotonic()
    time.sleep(3.0)
    used = cpu_s() - before
    assert used < 0.25 * (time.monotonic() - began), f"idle P/D instances used {used:.2f} CPU-s in 3 s"


def test_the_deployments_ipc_sockets_live_in_a_directory_of_its_own(live_1p1d):
    """vLLM's IPC sockets go to the deployment's own directory (VLLM_RPC_BASE_PATH), which `pdlab down` removes
    (tests/conftest.py's live_1p1d checks that), not to /tmp."""
    from pdlab.deploy.guard import ipc_dir

    sockets = ipc_dir(live_1p1d.run_dir)
    assert sockets.is_dir() and any(path.is_socket() for path in sockets.iterdir()), sorted(sockets.iterdir())


def test_prompt_below_one_kv_block_still_completes(live_1p1d):
    dep = live_1p1d
    result = pd_completion(*pd_urls(dep), dep.served_model, "the river ran", max_tokens=8,
                           stream=False)
    assert result.completion_tokens == 8
    assert result.prompt_tokens is not None and result.prompt_tokens < 128
    reference = colocated_completion(dep.urls('prefill')[0], dep.served_model, "the river ran", max_tokens=8)
    assert result.text == reference["choices"][0]["text"]


def test_status_reports_the_deployment_healthy(live_1p1d):
    rows = [r for r in json.loads(run_pdlab("status", "--json").stdout) if r["deployment"] == live_1p1d.spec.name]
    assert {r["role"] for r in rows} >= {"prefill", "decode"}
    assert all(r["alive"] and r["healthy"] for r in rows)


def test_bench_transfer_times_real_kv_reads_beside_idle_and_busy_instances(live_1p1d, tmp_path):
    """`pdlab bench transfer` on the session deployment: every condition's probe takes the P/D path and moves its
    KV with NIXL (vLLM's own transfer metrics change), and the result is written with its environment."""
    out = tmp_path / "transfer.json"
    done = run_pdlab("bench", "transfer", "--deployment", live_1p1d.spec.name, "--prompt-tokens", "400",
                     "--busy-tokens", "1500", "--repeats", "1", "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert [t["condition"] for t in result["trials"]] == ["idle", "prefill-busy", "decode-prefilling",
                                                         "decode-streaming", "prefill-busy-alone",
                                                         "prefill-busy-together"]
    for trial in result["trials"]:
        assert trial["transfers"] >= 1 and trial["bytes"] > 0 and trial["xfer_ms"] > 0, trial
        assert trial["ttft_s"] > 0
    # the hand-driven conditions post their reads themselves: each probe's KV moved, each got its first token
    alone, together = result["trials"][-2:]
    assert (alone["reads"], together["reads"]) == (1, 3)
    assert together["transfers"] == 3 and together["bytes"] == 3 * alone["bytes"], together
    assert len(together["first_tokens_ms"]) == 3 and together["spread_ms"] >= 0
    # (here the busy prompt is short, so it may well have been answered before the reads were posted)
    assert together["before_busy_answer"] == (max(together["first_tokens_ms"]) < together["busy_answer_ms"])
    # pdlab's NixlConnector starts no progress thread: there is no idle-class sender thread to watch (a deployment
    # with `connector.progress_thread: true` has one, and the bench records its slices)
    for trial in (alone, together):
        assert "sender_bursts_ms" not in trial and "after_slice_ms" not in trial, trial
    assert set(result["summary"]) == {t["condition"] for t in result["trials"]}
    assert "git" in result["environment"]
    below = run_pdlab("bench", "transfer", "--deployment", live_1p1d.spec.name, "--prompt-tokens", "10")
    assert below.returncode == 2 and "below the router threshold" in below.stdout
