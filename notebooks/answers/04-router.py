# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# Reference answers to notebook 04 (the router). They run after the notebook, in its kernel. Exercise 1 uses the
# live 1P1D deployment `dep` and puts its router's threshold back afterwards; the others ask the simulator, with the
# profile fitted to pdlab-small on CPU, what longer or busier runs than a notebook cell can afford would measure,
# and read the recorded runs of `labs/routing-strategies.yaml` and `labs/threshold-sweep.yaml`.

# %% [markdown]
# ## Exercise 1
# At threshold 0 the router sends every request through prefill -> decode, short ones too: each carries
# `x-pdlab-path: disaggregated`, and the prefill instance's count of prompt tokens now grows with every short
# prompt (at the lab's threshold it saw none of them). On an idle deployment a short request pays a little for it:
# an extra HTTP hop and a KV transfer, for a prefill the decode instance would have done in a few milliseconds.
# Under load it pays much more: one prefill instance now computes every prompt, so short requests queue behind
# the long ones there, which is the head-of-line blocking the split was meant to remove, moved to another
# instance.
#
# The recorded threshold sweep shows it on a replayed trace: the short requests' median TTFT was 13.0 s at
# threshold 0 against 1.7 s at threshold 2,048 <!-- cite data/results/threshold-sweep/20261201-010534/summary.json:
# scenarios."disaggregated@0".short.ttft_ms.p50 / 1000, -, scenarios."disaggregated@2048".short.ttft_ms.p50 / 1000,
# - -->.

# %%
import time

from pdlab.settings import PATH_HEADER

live = dep if dep.router is not None and dep.instances[0].process.alive() else \
    course.open_deployment("local-1p1d-router", MODEL)  # the notebook stopped the one it started


def prompt_tokens(url):
    """vLLM's counter of the prompt tokens an instance has prefilled."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_total"))


def short_requests(n=3):
    """`n` short streaming completions through the router, one after another: their paths and TTFTs (ms)."""
    paths, ttfts = [], []
    for i in range(n):
        body = {"model": live.served_model, "prompt": f"Question {i}: what colour is the sky?", "max_tokens": 4,
                "stream": True}
        start = time.perf_counter()
        with httpx.stream("POST", f"{live.router_url}/v1/completions", json=body, timeout=60) as response:
            response.raise_for_status()
            paths.append(response.headers[PATH_HEADER])
            for line in response.iter_lines():
                if line.startswith("data: {") and len(ttfts) < len(paths):
                    ttfts.append((time.perf_counter() - start) * 1e3)
    return paths, ttfts


prefill_url = live.urls("prefill")[0]
lab_threshold = set_router(live)["threshold"]
seen = {}
try:
    for threshold in (lab_threshold, 0):
        set_router(live, threshold=threshold)
        before = prompt_tokens(prefill_url)
        paths, ttfts = short_requests()
        seen[threshold] = {"paths": paths, "TTFT ms": [round(t) for t in ttfts],
                           "prompt tokens prefilled by the prefill instance": prompt_tokens(prefill_url) - before}
finally:
    set_router(live, threshold=lab_threshold)
    if live is not dep:
        live.stop()
for threshold, what in seen.items():
    print(f"threshold {threshold}: {what}")
assert set(seen[lab_threshold]["paths"]) == {"direct"} and set(seen[0]["paths"]) == {"disaggregated"}, seen
assert seen[lab_threshold]["prompt tokens prefilled by the prefill instance"] == 0, seen
assert seen[0]["prompt tokens prefilled by the prefill instance"] > 0, seen
assert live is not dep or set_router(dep)["threshold"] == lab_threshold

# %% [markdown]
# ## Exercise 2
# A live run cannot go far enough here, so the answer asks the simulator, replaying the panel's mix (64-token chats,
# 4,000-token documents, the same long share) on the lab's 1P1D at ever higher rates. The first thing to give is
# not the short streams but the prefill instance: it prefills every long prompt on its own, so from a few requests
# a second the long prompts' TTFT grows with every one added (a queue), while the streams stay smooth. The short
# requests stall again only at a rate many times higher, and then the decode instance is the bottleneck: it
# prefills every short prompt itself and steps every stream, and with that many streams its steps grow until the
# gaps count as stalls. Disaggregation moved the long prefills off the decode instance; it cannot make either
# instance faster, and the pool that runs out first is the one to grow.

# %%
import pandas as pd

from pdlab.calibration.lab import lab_profile
from pdlab.calibration.validate import CPU_ENGINE_DEFAULTS
from pdlab.config.sim import SimSpec, SimWorkload
from pdlab.sim.scenario import simulate

profile = lab_profile()[0]
twin_of = course.lab_deployment("local-1p1d-router", "pdlab-small")  # the profile is pdlab-small's
rates = [RATE * k for k in (1, 4, 16, 64)]
busier = {}
for rate in rates:
    poisson = {"rate_rps": rate, "num_requests": 200, "long_fraction": workload.long_fraction, "seed": 0,
               "short_prompt_tokens": workload.short_tokens, "long_prompt_tokens": workload.long_tokens,
               "short_output_tokens": workload.short_output_tokens, "long_output_tokens": workload.long_output_tokens}
    twin = SimSpec.for_deployment(twin_of, SimWorkload(poisson=poisson), profile=profile,
                                  link={"name": "local-loopback"}, engine_defaults=CPU_ENGINE_DEFAULTS)
    busier[rate], _ = simulate(twin)
print(pd.DataFrame({f"{rate:g} req/s": {
    "disaggregated": s["paths"]["disaggregated"], "long TTFT p50 (ms)": s["long"]["ttft_ms"]["p50"],
    "short TTFT p50 (ms)": s["short"]["ttft_ms"]["p50"], "short ITL p50 (ms)": s["short"]["itl_ms"]["p50"],
    "short ITL max (ms)": s["short"]["itl_ms"]["max"],
    f"stalls > {s['stalls']['threshold_ms']:g} ms": s["stalls"]["count"]}
    for rate, s in busier.items()}).round(1).to_string())
first, second, third, last = (busier[rate] for rate in rates)
assert second["long"]["ttft_ms"]["p50"] > 2 * first["long"]["ttft_ms"]["p50"]  # the prefill queue
assert first["stalls"]["count"] == second["stalls"]["count"] == third["stalls"]["count"] == 0 < last["stalls"]["count"]
assert last["short"]["itl_ms"]["p50"] > 2 * first["short"]["itl_ms"]["p50"]  # the decode instance's steps

# %% [markdown]
# ## Exercise 3
# `kvaware` keeps documents on one replica like `prefixaware`: it sends a prompt to the replica whose modelled cache
# holds its leading blocks, and on two replicas this lightly loaded their loads never differ by more than 4
# requests, so it never falls back to the least loaded one. `leastloaded` does not: it looks only at how many
# requests each replica has in flight, never at the prompt, so with the loads equal (or nearly) it alternates
# much like round-robin, and every document ends up on both replicas. The simulator below replays the panel's
# trace on the lab's two replicas and counts, for each document, the replicas its questions went to.
#
# Measured on two replicas (`labs/routing-strategies.yaml`, roomy caches, 50 s of the same trace), the median TTFT
# was 142 ms prefix-aware and 126 ms KV-aware, against 693 ms round-robin and 727 ms least-loaded <!-- cite
# labs/routing-strategies.yaml: workload.duration_s;
# data/results/routing-strategies/20261130-142639/summary.json: scenarios.prefixaware.short.ttft_ms.p50,
# scenarios.kvaware.short.ttft_ms.p50, scenarios.roundrobin.short.ttft_ms.p50,
# scenarios.leastloaded.short.ttft_ms.p50 -->.

# %%
from collections import defaultdict

from pdlab.calibration.lab import lab_requests
from pdlab.config import load_lab
from pdlab.settings import repo_root

strategy_lab = load_lab(repo_root() / "labs" / "routing-strategies.yaml")  # the panel's trace, as pdlab run sends it
stretch = lab_requests(strategy_lab, model_dir=dep.model_dir, duration_s=400, profile=profile)


def replay(deployment, strategy):
    """The trace on a simulated twin of `deployment` with `strategy`: the summary, and each document's replicas."""
    twin = SimSpec.for_deployment(deployment, SimWorkload(requests=stretch), profile=profile,
                                  link={"name": "local-loopback"}, engine_defaults=CPU_ENGINE_DEFAULTS)
    twin = twin.model_copy(update={"router": twin.router.model_copy(update={"decode_strategy": strategy})})
    summary, sim = simulate(twin)
    replicas_of = defaultdict(set)
    for request in sim.requests:  # a document is its prompt's first KV block
        replicas_of[request.arrival.prefix_hashes[0]].add(request.decode_instance)
    return summary, sorted(len(names) for names in replicas_of.values())


small_caches = course.lab_deployment("local-replicas", "pdlab-small")
spread_of = {}
for strategy in ("roundrobin", "prefixaware", "kvaware", "leastloaded"):
    summary, spread_of[strategy] = replay(small_caches, strategy)
    print(f"{strategy}: each document on {spread_of[strategy]} replica(s); {summary['prefix_cache']['hit_rate']:.0%} "
          f"of prompt tokens from the prefix caches, TTFT p50 {summary['short']['ttft_ms']['p50']:,.0f} ms")
assert max(spread_of["prefixaware"]) == max(spread_of["kvaware"]) == 1
assert min(spread_of["leastloaded"]) == min(spread_of["roundrobin"]) == 2

# %% [markdown]
# ## Exercise 4
# With caches large enough for all six documents, round-robin catches up over a long stretch: each replica computes
# each document once, then finds it in its cache every time it comes back, so its hit rate approaches
# prefix-aware's and the median TTFT becomes the same. With the lab's small caches it never does: each replica
# churns through all six documents in a cache that holds about three. (The measured run in exercise 3 had roomy
# caches too, but in 50 s <!-- cite labs/routing-strategies.yaml: -, workload.duration_s --> round-robin was still
# paying its first computations.) So prefix-aware routing pays when
# the prompts' shared prefixes do not fit one replica's cache but fit across the replicas, as in notebook 07's panel
# (400 documents over 8 GPUs), and when the stretch is short next to how often the set of documents changes. A
# round-robin cluster computes every document once per replica and needs every cache to hold them all; prefix-aware
# routing computes it once and needs the caches to hold them between them.

# %%
large = course.lab_deployment("local-replicas", "pdlab-small")
large = large.model_copy(update={"instances": [
    inst.model_copy(update={"engine": inst.engine.model_copy(update={"kv_cache_blocks": None})})
    for inst in large.instances]})
caches = {}
for label, deployment in (("small caches", small_caches), ("large caches", large)):
    for strategy in ("roundrobin", "prefixaware"):
        caches[(label, strategy)], _ = replay(deployment, strategy)
print(pd.DataFrame({f"{label}, {strategy}": {"prefix-cache hits": s["prefix_cache"]["hit_rate"],
                                             "TTFT p50 (ms)": s["short"]["ttft_ms"]["p50"],
                                             "KV cache (tokens)": s["kv_cache_tokens_per_instance"]}
                    for (label, strategy), s in caches.items()}).T.round(3).to_string())
gap = {label: caches[(label, "prefixaware")]["prefix_cache"]["hit_rate"]
       - caches[(label, "roundrobin")]["prefix_cache"]["hit_rate"] for label in ("small caches", "large caches")}
assert gap["large caches"] < 0.1 < gap["small caches"], gap
assert caches[("small caches", "roundrobin")]["short"]["ttft_ms"]["p50"] > \
    2 * caches[("small caches", "prefixaware")]["short"]["ttft_ms"]["p50"]
