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
# # 06 · The threshold's break-even: when does disaggregation stop paying?
#
# **Learning objectives.** After this notebook you can
# - sweep the live router's threshold between short loads;
# - weigh what disaggregating a prompt costs (a KV transfer and an extra hop, paid in its TTFT) against what it
#   saves (the stall its prefill would cause every stream on the decode instance);
# - pick a threshold from your own measurements and say why.
#
# For each prompt length `L` we run the same load twice, changing only the router: threshold `L + 1` sends the
# `L`-token prompts straight to the decode instance (*direct*), threshold `L` sends them through prefill -> decode
# (*disaggregated*). Short prompts (64 tokens) go direct both times. A long prompt's prefill on the decode
# instance costs the streams about `L / prefill speed` seconds. Disaggregating it costs the long prompt an extra
# HTTP hop and its KV transfer. On an idle link and an idle sender the transfer is about `L x bytes per token /
# link speed` (notebook 03: a few milliseconds for a 3,000-token prompt of pdlab-small on loopback), but a prefill
# instance busy computing the next prompt serves the decode instance's read only between its steps: `pdlab bench
# transfer` measured the same 3,000-token read (50 MB) at 8 ms beside an idle prefill instance and 1,162 to
# 1,876 ms (medians) beside one computing a 6,000-token prompt, on this machine kind<!-- cite
# data/results/transfer/20261205-142936.json: -, -, -, -, trials.0.bytes / 1e6, summary.idle.xfer_ms_median,
# summary.prefill-busy-alone.xfer_ms_median, summary.prefill-busy.xfer_ms_median, - -->. So under load the
# transfer's cost is mostly that wait, which grows with how long the sender's steps are, not with `L`. The stall it
# saves grows with `L`; below some `L` the hop and the wait win, and above it disaggregation pays.

# %% tags=["parameters"]
from pdlab import course

MODEL = course.choose("pdlab-small", "pdlab-tiny")  # the served model (ignored when $PDLAB_ATTACH names one)
LENGTHS = course.choose([128, 256, 512, 1024, 2048, 4000], [256, 4000])  # "long" prompt lengths to try (tokens)
RATE = course.choose(1.5, 1.5)  # requests per second
DURATION_S = course.choose(30, 9)  # seconds of load per (length, path)
LONG_FRACTION = course.choose(0.25, 0.3)  # share of prompts of length L
TTFT_SLO_S, TPOT_SLO_S = 2.0, 0.1  # for the attainment column

# %%
from pdlab.config.workload import MixedWorkload
from pdlab.experiment.lab import set_router
from pdlab.metrics.kv import scrape_kv_transfer

dep = course.open_deployment("local-1p1d-router", MODEL)
decode_url = dep.urls("decode")[0]
original = set_router(dep)["threshold"]
workload = MixedWorkload(rate=RATE, duration_s=DURATION_S, long_fraction=LONG_FRACTION, short_tokens=64,
                         short_output_tokens=64, long_output_tokens=8, seed=0)

# %% [markdown]
# ## 1. The sweep
#
# The threshold changes live through the admin API between loads; the decode instance's NIXL counters say what
# each disaggregated run moved.

# %%
rows, moved = {}, {}
for length in LENGTHS:
    load = workload.model_copy(update={"long_tokens": length})
    for path, threshold in (("direct", length + 1), ("disaggregated", length)):
        set_router(dep, threshold=threshold)
        before = scrape_kv_transfer(decode_url)
        rows[(path, length)] = course.measure_load(dep, load, scenario=f"{path}-{length}", lab="break-even",
                                                   progress=False)
        moved[(path, length)] = scrape_kv_transfer(decode_url) - before
set_router(dep, threshold=original)  # leave the router as we found it

# %%
from pdlab.metrics.goodput import sweep_table

table = sweep_table(rows, TTFT_SLO_S, TPOT_SLO_S).rename(columns={"rate": "prompt_tokens", "scenario": "path"})
keys = list(zip(table["path"], table["prompt_tokens"], strict=True))
table["kv_ms_per_transfer"] = [moved[key].mean_xfer_ms for key in keys]
table["kv_mb_per_transfer"] = [(moved[key].mean_bytes or 0) / 1e6 for key in keys]
table.round(2)

# %% [markdown]
# ## 2. Stall saved against transfer paid

# %%
from pdlab.report import sweep_figure

sweep_figure(table, x="prompt_tokens", y="short_itl_p99_ms", color="path",
             title="short streams' p99 ITL: what a long prompt's prefill costs them")

# %%
sweep_figure(table, x="prompt_tokens", y="long_ttft_p99_ms", color="path",
             title="long prompts' p99 TTFT: what disaggregating costs them")

# %%
dep.stop()  # stops it only if this notebook started it; the checks below use what it measured

# %% [markdown]
# Read the two figures together. Where the *direct* curve of the first figure rises far above the
# *disaggregated* one, the prefill is stalling streams and disaggregation pays. Where the two lie together, the
# prefill is too short to hurt, and the disaggregated path only adds its transfer and hop to the long prompts'
# TTFT (second figure). The break-even threshold lies between the last length where the curves meet and the first
# where they part.
#
# ## Check: does your measurement show the effect?

# %% [markdown]
# The check compares the longest gap a short stream saw, not the p99. A stall is one long gap among many short
# ones: a 30-second load sends only a few long prompts, and when their stalled gaps are fewer than 1% of all the
# short streams' gaps the p99 does not reach them (the figure above can then show the curves together). The worst
# gap shows every stall that met a running stream.

# %%
by = table.set_index(["path", "prompt_tokens"])
gain = {n: by.loc[("direct", n), "short_itl_max_ms"] / by.loc[("disaggregated", n), "short_itl_max_ms"]
        for n in LENGTHS}
shortest, longest = LENGTHS[0], LENGTHS[-1]
course.check(
    gain[longest] > 2,
    f"at {longest} tokens disaggregation shortens the short streams' longest gap {gain[longest]:.1f}x "
    f"({by.loc[('direct', longest), 'short_itl_max_ms']:,.0f} -> "
    f"{by.loc[('disaggregated', longest), 'short_itl_max_ms']:,.0f} ms; want > 2x)",
    "raise DURATION_S or LONG_FRACTION so long prompts meet running streams; re-run on a quieter machine",
)
course.check(
    gain[shortest] < gain[longest],
    f"the gain shrinks for shorter prompts: {gain[shortest]:.1f}x at {shortest} tokens vs "
    f"{gain[longest]:.1f}x at {longest}",
    "put a shorter length (128 or 256) first in LENGTHS",
)

# %% [markdown]
# ## Exercises
#
# 1. Fill `LENGTHS` in between (e.g. 128 to 2048) and find the smallest length where the gain exceeds 2x. Is it
#    above or below the lab spec's threshold (512, `labs/local-1p1d-router.yaml`)? Would you change it?
# 2. From `kv_ms_per_transfer` and `kv_mb_per_transfer`, what rate did the transfers reach? Compare it with the
#    idle transfer of notebook 03: how much of `kv_ms_per_transfer` is the wait for a busy prefill instance? How
#    would the break-even move on a link 100x faster (EFA, notebook 07) or 10x slower (a congested TCP network)?
# 3. Double `RATE`: more streams are running when a prefill lands. Does the break-even move up or down?
