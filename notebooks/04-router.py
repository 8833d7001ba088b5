# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · The router: threshold and replica strategy, live
#
# **Learning objectives.** After this notebook you can
# - say what the router decides for each request: the *path* (a prompt of at least `threshold` tokens goes
#   prefill -> decode, a shorter one straight to a decode instance) and the *replica* in each pool (the strategy);
# - change the live router's settings through its admin API and see the next requests follow them;
# - move the threshold on a P/D deployment and read what it does to the short requests' stalls and to the long
#   prompts' time to first token (TTFT: from sending a request to its first token);
# - move the replica strategy on two replicas with prefix caching and read it in the prefix-cache hit rate and TTFT.
#
# The router counts a prompt's tokens with the model's tokenizer and compares them with the threshold. Then the
# pool's strategy picks a replica:
# - `roundrobin`: take turns;
# - `session`: the same session key (a header or the request's `user` field) always to the same replica;
# - `prefixaware`: where the longest leading part of the prompt was sent before (compared by hashes of its
#   128-token KV blocks), so that replica's prefix cache can reuse it; with no match, the least loaded replica;
# - `kvaware`: the replica whose cache most likely still holds the prompt's leading blocks, modelled from the
#   router's own history as a least-recently-used list of block hashes per replica, unless the replicas' loads
#   differ by more than 4 requests: then the least loaded one (SGLang's cache-aware rule);
# - `leastloaded`: the fewest requests in flight (or vLLM's running + waiting, when that is higher).
#
# Both panels below run their load in the background: the progress bar moves, **Cancel** stops a run (its numbers
# are dropped), and a control moved during a run is measured right after it.

# %% tags=["parameters"]
from pdlab import course

MODEL = course.choose("pdlab-small", "pdlab-tiny")  # the served model (ignored when $PDLAB_ATTACH names one)
RATE = course.choose(1.5, 1.5)  # requests per second in each threshold run
DURATION_S = course.choose(30, 12)  # seconds of load per threshold run
LONG_FRACTION = course.choose(0.2, 0.3)  # share of 4,000-token prompts
MAX_THRESHOLD = 8192  # the slider's right end: above every prompt, so everything goes direct
TRACE_S = course.choose(40, 12)  # seconds of the shared-prefix trace per strategy run
TRACE_SPEED = course.choose(1.0, 2.0)  # replay the trace this many times faster than recorded (0.5 req/s)

# %%
from pdlab.config.workload import MixedWorkload, TraceWorkload
from pdlab.course_widgets import RouterPanel, StrategyPanel
from pdlab.experiment.lab import set_router


def measure(dep, workload, **controls):
    """One panel run: the load, sent through the deployment's router; Cancel and progress come in `controls`."""
    return course.measure_load(dep, workload, lab="router", progress=False, **controls)


dep = course.open_deployment("local-1p1d-router", MODEL)
print(f"router {dep.router_url}; live settings: {set_router(dep)}")

# %% [markdown]
# ## 1. The admin API
#
# `set_router(dep, threshold=...)` sends `PUT /admin/config` with `Authorization: Bearer <token>`; without the
# token the router answers 401 with an OpenAI-style error object:

# %%
import httpx

refused = httpx.put(dep.router_url + "/admin/config", json={"threshold": 0}, timeout=10)
print(refused.status_code, refused.json())

# %% [markdown]
# ## 2. The threshold, on one prefill and one decode instance
#
# Move a control: the panel applies the threshold to the live router, runs `DURATION_S` seconds of load (short
# streaming chats and 4,000-token documents), and adds a point. Left: the share of short requests that *stalled*
# at least once (a gap between two of their tokens over 5x their median gap: a head-of-line stall, notebook 02).
# Right: the long prompts' median TTFT. Changing the rate or the long share starts a new series: points of one
# series differ only in the threshold.

# %%
workload = MixedWorkload(rate=RATE, duration_s=DURATION_S, long_fraction=LONG_FRACTION, short_tokens=64,
                         long_tokens=4000, short_output_tokens=64, long_output_tokens=8, seed=0)
panel = RouterPanel(dep, workload, measure, max_threshold=MAX_THRESHOLD)
start_threshold = panel.threshold.value
panel.widget

# %% [markdown]
# Two settings to start with, set from code exactly as the slider sets them: everything direct (the threshold
# above every prompt: the decode instance does all the prefills, as a colocated instance would), then the lab's
# threshold (long prompts through prefill -> decode). `panel.wait()` blocks until they are measured.

# %%
panel.threshold.value = MAX_THRESHOLD
all_direct = panel.wait()
panel.threshold.value = start_threshold if start_threshold < MAX_THRESHOLD else 512
split = panel.wait()
for run in (all_direct, split):
    print(f"{run.label()}: {run.direct} direct, {run.disaggregated} through prefill -> decode; {run.figures()}")

# %% [markdown]
# Everything direct, every long prompt is prefilled on the instance that streams the short answers, and each
# prefill freezes them all; split, the decode instance only decodes. What the long prompts pay for it is on the
# right: their prefill now waits for the one prefill instance, then the KV transfer.
#
# ## 3. The strategy, on two replicas with prefix caching
#
# With one replica per pool every strategy picks the same one. `labs/local-replicas.yaml` has two colocated
# replicas with prefix caching, each with a small KV cache (about three of the trace's six documents), and the
# router sends every prompt straight to one of them. The load replays `data/traces/shared-prefix.jsonl`:
# questions about six long documents, each prompt a document followed by its own question. A replica that
# computed a document before finds its KV blocks in its prefix cache and prefills only the question.
#
# The threshold deployment is stopped first (when this notebook started it), so the replicas have the cores.

# %%
dep.stop()  # stops it only if this notebook started it
replicas = course.open_deployment("local-replicas", MODEL)
trace = TraceWorkload(path="data/traces/shared-prefix.jsonl", length_scale=0.5, time_scale=1 / TRACE_SPEED,
                      max_output_tokens=16, long_threshold_tokens=100000, duration_s=TRACE_S)
strategies = StrategyPanel(replicas, trace, measure)
strategies.widget

# %% [markdown]
# Choosing a strategy applies it and replays the trace (with fresh document text each run, so no strategy reuses
# another's warm caches). Left: the share of prompt tokens the replicas found in their prefix caches (vLLM's
# `prefix_cache_hits` over `prefix_cache_queries`, summed over both). Right: the requests' TTFT.

# %%
strategies.strategy.value = "prefixaware"
kept = strategies.wait()
strategies.strategy.value = "roundrobin"
spread = strategies.wait()
for run in (kept, spread):
    print(f"{run.strategy}: {run.requests} requests, {run.prefix_hit_rate:.0%} of prompt tokens from the prefix "
          f"cache, TTFT p50 {run.ttft_p50_ms:,.0f} ms, p99 {run.ttft_p99_ms:,.0f} ms")

# %% [markdown]
# ## Your turn
#
# The two panels again, with the runs so far: move the threshold, the load, the strategy. The deployments stay up
# while you play; run the cell after the panels when you are done.

# %%
panel.widget if dep.router is not None and dep.instances[0].process.alive() else print(
    "the threshold deployment is stopped; re-run section 2 to bring it back")

# %%
strategies.widget

# %%
replicas.stop()  # stops it only if this notebook started it; the checks come after, so none is left running

# %% [markdown]
# ## Check: does your measurement show the effect?

# %%
course.check(
    all_direct.disaggregated == 0 and split.disaggregated > 0,
    f"the router followed the live threshold: {all_direct.disaggregated} disaggregated at {all_direct.threshold}, "
    f"{split.disaggregated} at {split.threshold}",
    "the load must contain long prompts (LONG_FRACTION > 0) longer than the lower threshold",
)
course.check(
    all_direct.short_stalled_share > split.short_stalled_share,
    f"sending long prompts through prefill -> decode protects the short streams: {split.short_stalled_share:.0%} "
    f"of short requests stalled, against {all_direct.short_stalled_share:.0%} with everything direct",
    "raise DURATION_S or LONG_FRACTION so long prompts meet running streams; re-run on a quieter machine",
)
course.check(
    kept.prefix_hit_rate > spread.prefix_hit_rate + 0.1,
    f"prefix-aware routing found more of the prompts in the replicas' caches: {kept.prefix_hit_rate:.0%} of prompt "
    f"tokens against {spread.prefix_hit_rate:.0%} round-robin",
    "replay more of the trace (TRACE_S): a document must come back a few times for its cache to pay",
)

# %% [markdown]
# ## Exercises
#
# 1. Slide the threshold down to 0: every prompt, short ones too, goes prefill -> decode. What happens to the
#    short requests' TTFT, and to the prefill instance's load?
# 2. Raise the rate until short requests stall even with long prompts disaggregated. Which instance is now the
#    bottleneck?
# 3. In the strategy panel, try `kvaware` and `leastloaded`. Which one keeps documents on one replica, and why
#    does `leastloaded` not (think of what it looks at)?
# 4. Set both replicas' caches large (`kv_cache_blocks` removed from a copy of `labs/local-replicas.yaml`) and
#    replay a long stretch of the trace: does round-robin catch up? What does that say about when prefix-aware
#    routing pays on a cluster (notebook 07's panel asks the simulator at 8 GPUs)?
