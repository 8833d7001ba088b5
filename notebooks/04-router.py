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
# # 04 · The router: threshold and strategies, live
#
# **Learning objectives.** After this notebook you can
# - say what the router decides for each request: the *path* (a prompt of at least `threshold` tokens goes
#   prefill -> decode, a shorter one straight to a decode instance) and the *replica* in each pool (the strategy);
# - change the live router's settings through its admin API and see the next requests follow them;
# - measure what moving the threshold does to short streams and to long prompts.
#
# The router counts a prompt's tokens with the model's tokenizer, compares with the threshold, and picks a
# replica with the pool's strategy: `roundrobin`, `session` (sticky per user), `prefixaware` (same prompt prefix,
# same replica, to reuse its cache), `kvaware` (most free KV cache), `leastloaded` (fewest requests in flight).
# With one replica per pool, as here, every strategy picks the same one; they matter on a cluster (notebook 07).
# Settings change with `PUT /admin/config`, which needs the router's admin token.

# %% tags=["parameters"]
from pdlab import course

MODEL = course.choose("pdlab-small", "pdlab-tiny")  # the served model (ignored when $PDLAB_ATTACH names one)
RATE = course.choose(1.5, 1.5)  # requests per second in each short load
DURATION_S = course.choose(30, 10)  # seconds of load per setting
LONG_FRACTION = course.choose(0.2, 0.25)  # share of 4,000-token prompts
MAX_THRESHOLD = 8192  # the slider's right end: above every prompt, so everything goes direct

# %%
from pdlab.config.workload import MixedWorkload
from pdlab.course_widgets import RouterPanel
from pdlab.experiment.lab import set_router

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
# ## 2. The panel
#
# Move a control: the panel applies the router settings to the live router, runs `DURATION_S` seconds of load
# with the rate and long-prompt share you chose, and adds a point per run to the figure (log scale): the short
# streams' p99 inter-token latency, and the long prompts' median time to first token, against the threshold.

# %%
workload = MixedWorkload(rate=RATE, duration_s=DURATION_S, long_fraction=LONG_FRACTION, short_tokens=64,
                         long_tokens=4000, short_output_tokens=64, long_output_tokens=8, seed=0)
panel = RouterPanel(dep, workload, lambda d, w: course.measure_load(d, w, lab="router", progress=False),
                    max_threshold=MAX_THRESHOLD)
start_threshold = panel.threshold.value
panel.widget

# %% [markdown]
# Two settings to start with, set from code exactly as the slider sets them: everything direct (the threshold
# above every prompt: the decode instance does all the prefills, colocated-style), then back to the lab's
# threshold (long prompts disaggregated).

# %%
panel.threshold.value = MAX_THRESHOLD
panel.threshold.value = start_threshold if start_threshold < MAX_THRESHOLD else 512
all_direct, split = panel.history[-2], panel.history[-1]
for run in (all_direct, split):
    print(f"{run.label()}: {run.direct} direct, {run.disaggregated} disaggregated, short p99 ITL "
          f"{run.short_itl_p99_ms:,.0f} ms, long TTFT p50 {run.long_ttft_p50_ms or float('nan'):,.0f} ms")

# %% [markdown]
# ## Check: does your measurement show the effect?

# %%
course.check(
    all_direct.disaggregated == 0 and split.disaggregated > 0,
    f"the router followed the live threshold: {all_direct.disaggregated} disaggregated at {all_direct.threshold}, "
    f"{split.disaggregated} at {split.threshold}",
    "the load must contain long prompts (LONG_FRACTION > 0) longer than the lower threshold",
)
# A stall is one long gap among many short ones, so in a short run the p99 can miss it while the worst gap shows
# it (notebook 02 shows the whole timeline): the check asks that splitting lowers one or the other. Quick mode's
# ten-second loads on the tiny model are too short to show it reliably, so there it only reports.
protected = (all_direct.short_itl_p99_ms > split.short_itl_p99_ms
             or all_direct.short_itl_max_ms > split.short_itl_max_ms)
effect = (f"sending long prompts through prefill -> decode protects the short streams: p99 / max ITL "
          f"{split.short_itl_p99_ms:,.0f} / {split.short_itl_max_ms:,.0f} ms vs "
          f"{all_direct.short_itl_p99_ms:,.0f} / {all_direct.short_itl_max_ms:,.0f} ms all direct (want lower)")
if course.quick():
    print(f"quick mode, not checked: {effect}")
else:
    course.check(protected, effect,
                 "raise DURATION_S or LONG_FRACTION so long prompts meet running streams; re-run on a quieter machine")

# %% [markdown]
# ## Your turn
#
# The same panel again, with the runs so far: move the threshold, the strategies, the rate and the long share.
# The deployment stays up while you play; run the cell after it when you are done.

# %%
panel.widget

# %%
dep.stop()  # stops it only if this notebook started it

# %% [markdown]
# ## 3. Replica strategies where prompts share prefixes (simulated)
#
# This deployment has one decode replica, so the strategies have nothing to choose between. The
# routing-strategies lab has two colocated replicas with prefix caching and a trace whose prompts share long
# beginnings: sent where its beginning was computed before, a prompt prefills only the rest. `pdlab run
# labs/routing-strategies.yaml` measures it in a few minutes; the simulator replays the same schedule, with the
# router's own strategy code and the prompts' block hashes, in a fraction of a second.

# %%
from pdlab.calibration.lab import lab_profile, points_frame, simulate_lab
from pdlab.config import load_lab
from pdlab.model import resolve
from pdlab.settings import repo_root

profile, which = lab_profile()  # this machine's own where `pdlab sim probe` fitted one, else the shipped one
strategies = simulate_lab(load_lab(repo_root() / "labs" / "routing-strategies.yaml"),
                          model_dir=resolve("pdlab-small"), profile=profile)
print(which)
points_frame(strategies)

# %% [markdown]
# ## Exercises
#
# 1. Slide the threshold down to 0: every prompt, short ones too, goes prefill -> decode. What happens to the
#    short requests' TTFT, and to the prefill instance's load?
# 2. Raise the rate until the short p99 ITL climbs even with long prompts disaggregated. Which instance is now
#    the bottleneck?
# 3. Set both pools to `session` and send requests with a `user` field (`httpx.post(dep.router_url + ...)`).
#    Why does a sticky strategy matter on a cluster with a prefix cache, and not here? (Section 3's table says
#    how much; `pdlab run labs/routing-strategies.yaml` measures it.)
