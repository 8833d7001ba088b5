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
# # 05 · Load and SLOs: what users feel, in numbers
#
# **Learning objectives.** After this notebook you can
# - generate open-loop load with locust (pdlab.load) and read the raw rows it records;
# - define TTFT, TPOT, ITL and E2E, and say which one shows a head-of-line stall;
# - compute SLO attainment and *goodput* (the highest rate at which at least 90% of requests meet both SLOs);
# - see latency grow with the request rate.
#
# The metrics (the full glossary is in `docs/metrics.md`):
#
# | name | definition |
# | --- | --- |
# | **TTFT** | send -> first streamed token: queueing + prefill (+ KV transfer and the hop, in P/D) |
# | **ITL** | every gap between two consecutive tokens of a request, kept one by one |
# | **TPOT** | (E2E - TTFT) / (tokens - 1): one request's *mean* gap. A mean hides a stall; ITL's tail shows it |
# | **E2E** | send -> last token |
# | **SLO attainment** | share of sent requests with TTFT <= TTFT-SLO and TPOT <= TPOT-SLO (failures miss) |
# | **goodput** | the highest measured rate with attainment >= 90% (DistServe's definition) |

# %% tags=["parameters"]
from pdlab import course

MODEL = course.choose("pdlab-small", "pdlab-tiny")  # the served model (ignored when $PDLAB_ATTACH names one)
RATES = course.choose([0.5, 1.0, 2.0, 3.0, 4.0, 6.0], [0.5, 6.0])  # request rates to measure (req/s)
DURATION_S = course.choose(40, 10)  # seconds of load per rate
LONG_FRACTION = course.choose(0.2, 0.25)  # share of 4,000-token prompts
TTFT_SLO_S = 2.0  # time-to-first-token objective (seconds)
TPOT_SLO_S = 0.1  # time-per-output-token objective (seconds)

# %%
from pdlab.config.workload import MixedWorkload

dep = course.open_deployment("local-1p1d-router", MODEL)
workload = MixedWorkload(duration_s=DURATION_S, long_fraction=LONG_FRACTION, short_tokens=64, long_tokens=4000,
                         short_output_tokens=64, long_output_tokens=8, seed=0)

# %% [markdown]
# ## 1. One load, the raw rows
#
# Locust sends each request at its scheduled time (open loop) and records one row per request: its class, the
# router's path, when it was sent, and the time of every streamed token. Everything else is computed from these.

# %%
runs = {}
for rate in RATES:
    runs[rate] = course.measure_load(dep, workload.model_copy(update={"rate": rate}), scenario=f"rate-{rate:g}",
                                     lab="slo")
first = runs[RATES[0]]
first[["request_id", "cls", "path", "start_s", "status", "late_s"]].head()

# %% [markdown]
# ## 2. Per-request metrics

# %%
from pdlab.metrics.latency import request_metrics

per_request = request_metrics(runs[RATES[-1]])
per_request[["request_id", "cls", "ttft_s", "tpot_s", "e2e_s", "stalls"]].head(10)

# %% [markdown]
# ## 3. SLO attainment and goodput across rates

# %%
from pdlab.metrics.goodput import goodput_rate, sweep_table
from pdlab.report import sweep_figure

table = sweep_table({("1p1d", rate): rows for rate, rows in runs.items()}, TTFT_SLO_S, TPOT_SLO_S)
goodput = goodput_rate(runs, TTFT_SLO_S, TPOT_SLO_S)
print(f"goodput at TTFT <= {TTFT_SLO_S} s and TPOT <= {TPOT_SLO_S * 1e3:g} ms: "
      f"{'none of the measured rates' if goodput is None else f'{goodput:g} req/s'}")
table.round(3)

# %%
sweep_figure(table, x="rate", y="attainment", title="SLO attainment against request rate", target=0.9)

# %%
sweep_figure(table, x="rate", y="short_ttft_p99_ms", title="short requests' p99 TTFT against request rate")

# %%
dep.stop()  # stops it only if this notebook started it; the checks below use what it measured

# %% [markdown]
# ## Check: does your measurement show the effect?

# %%
from pdlab.metrics.summary import scenario_summary

low, high = scenario_summary(runs[RATES[0]]), scenario_summary(runs[RATES[-1]])
course.check(
    high["all"]["ttft_ms"]["p90"] > 1.5 * low["all"]["ttft_ms"]["p90"],
    f"more load, longer waits: p90 TTFT {high['all']['ttft_ms']['p90']:,.0f} ms at {RATES[-1]:g} req/s vs "
    f"{low['all']['ttft_ms']['p90']:,.0f} ms at {RATES[0]:g} req/s (want more than 1.5x)",
    "make the highest rate in RATES higher (or LONG_FRACTION larger) so that requests queue",
)
# One request of the lowest rate's few is worth 1/len of its attainment: more than that is beyond noise.
slack = max(0.1, 1 / len(runs[RATES[0]]))
course.check(
    table["attainment"].iloc[-1] <= table["attainment"].iloc[0] + slack,
    f"SLO attainment does not improve with load by more than one request's worth ({table['attainment'].iloc[0]:.0%} "
    f"at {RATES[0]:g} req/s, {table['attainment'].iloc[-1]:.0%} at {RATES[-1]:g} req/s)",
    "runs this short are noisy: raise DURATION_S",
)

# %% [markdown]
# ## Exercises
#
# 1. Tighten `TPOT_SLO_S` to 20 ms. Which requests miss now: short or long ones? Use `per_request`.
# 2. Find a request with a stall (`stalls > 0`): compare its TPOT with its largest ITL. Which SLO would catch a
#    user staring at a frozen answer?
# 3. Add rates to `RATES` until attainment drops under 90%. That rate is this deployment's limit; notebook 07
#    asks the same question of a GPU cluster.
