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
# # 02 · Head-of-line blocking, measured fairly: the same two cores, three ways to serve them
#
# **Learning objectives.** After this notebook you can
# - run a lab the way `pdlab run` does, from Python (`run_lab`), and read its run directory and summary;
# - compare colocated serving, colocated with a tuned chunked-prefill budget, and disaggregated prefill/decode on
#   the same two cores under the same load;
# - point at a *head-of-line (HOL) stall* on a per-request timeline and say which prompt caused it;
# - read the figures that separate the three: how many short requests stalled, how long their worst gap was, and
#   what the long prompts paid.
#
# A colocated vLLM instance runs both phases in the same scheduler steps: every running sequence gets one decode
# token per step, then the step's token budget is filled with prefill. A long prompt makes its step long, and every
# stream on that instance waits for it: its *inter-token latency* (ITL, the gap between two streamed tokens of a
# request) jumps from milliseconds to the prompt's prefill time. That is a HOL stall (pdlab counts a gap over 5x the
# request's median gap). *Chunked prefill* caps each step's tokens (`max_num_batched_tokens`), so a long prompt is
# prefilled over several steps, each also carrying the streams' tokens. *Disaggregation* moves the long prompts'
# prefill to another instance (notebooks 00 and 03), and the decode instance only decodes.
#
# To be fair, all three get the same two cores and the same load: the demo lab, `labs/hol-blocking.yaml` (what
# `pdlab demo` runs). Its *time to first token* (TTFT) and ITL figures are read per class: *short* requests are
# streaming chats, *long* ones are documents to read. The lab has a fourth scenario, `disaggregated_lmcache`: the
# same pair with LMCache pushing the KV right after prefill instead of the decode instance pulling it through NIXL.
# Like `pdlab demo`, this notebook runs the three above (`lab.experiment.demo_scenarios`); push against pull is
# measured in `docs/lmcache.md`.

# %% tags=["parameters"]
from pdlab import course

MODEL = course.choose("pdlab-small", "pdlab-tiny")  # the served model, in every scenario
DURATION_S = course.choose(None, 12)  # seconds of load per scenario; None: the lab's own
POINT_AT = None  # a request id from the colocated timeline (say "r00012") whose stall to explain; None: the longest

# %%
import pandas as pd

lab = course.lab_spec("hol-blocking", MODEL)
pd.DataFrame([{"scenario": name, "instances": ", ".join(f"{i.name} ({i.role}, core {i.cores})" for i in spec.instances),
               "token budget": ", ".join(str(i.engine.max_num_batched_tokens or "vLLM's default")
                                         for i in spec.instances),
               "router threshold": spec.router.threshold if spec.router else None}
              for name, spec in lab.scenarios.items()])

# %% [markdown]
# The load (`lab.workload`): short prompts that stream answers, and long prompts, arriving at random (Poisson). Its
# rate is set from this machine's speed: before the first scenario pdlab times a few lone long prefills and picks
# the rate at which the long prompts keep one core busy `prefill_load` of the time, so the comparison means the
# same on a fast or a slow laptop. The baseline (`alone`) is the same schedule without the long prompts.

# %%
lab.workload

# %% [markdown]
# ## 1. Run the lab
#
# `run_lab` brings each scenario's deployment up in turn on the same two cores, sends the same schedule, and
# writes a run directory (`runs/hol-blocking/<time>/`: the raw rows, a summary, an HTML report). From a terminal,
# `pdlab demo` does the same (a run `$PDLAB_RUN` names is read instead). It takes a few minutes: each deployment
# starts in about half a minute, then the load runs.

# %%
from pdlab.experiment.lab import run_lab
from pdlab.experiment.runner import read_run

run = course.shared_run(lab) or read_run(run_lab(lab, duration_s=DURATION_S, only=lab.experiment.demo_scenarios))
print(f"run directory: {run.dir}")

# %% [markdown]
# ## 2. What separates them
#
# The verdict, in words, from the run's summary, then the numbers side by side. Read the per-request figures
# first: the share of short requests that stalled at least once, and each one's worst gap (p50 and p99 over the
# requests). The ITL p99 over all gaps can hide the stalls: a stall is one long gap among many short ones.

# %%
from pdlab.report import headline_table, verdict

for line in verdict(run.summary):
    print(line)
headline_table(run.summary).round(2)

# %%
from pdlab.report import figures

figures.hol_figure(run.summary)

# %% [markdown]
# ## 3. Point at a stall
#
# One line per request of the colocated scenario, in send order: the thick part is the wait for the first token,
# each tick a streamed token, red a stall; the shaded bands are long prompts' prefills. Hover over a red segment:
# which request stalled, and when? Then find the shaded band it sits in. Set `POINT_AT` to that request's id and
# run the cell after the figure.

# %%
colocated = run.rows["colocated"]
figures.timeline_figure(colocated, title="colocated: vLLM's default token budget")

# %%
from pdlab.metrics.latency import stall_causes

causes = stall_causes(colocated)
picked = causes if POINT_AT is None else causes[causes["request_id"] == POINT_AT]
if picked.empty:
    print(f"request {POINT_AT!r} did not stall; pick a red segment's request from the timeline")
else:
    stall = picked.iloc[0]
    print(f"request {stall.request_id} ({stall.cls}) waited {stall.gap_s * 1e3:,.0f} ms for its next token, from "
          f"t={stall.t0_s:.2f} s (its median gap: {stall.median_s * 1e3:,.0f} ms).\nDuring it, long request "
          f"{stall.long_request} was being prefilled (t={stall.long_t0_s:.2f}-{stall.long_t1_s:.2f} s), "
          f"{stall.overlap_s * 1e3:,.0f} ms of it inside the stall.")
causes.head(10).round(3)

# %% [markdown]
# Now the same load, chunked and disaggregated. Chunked prefill turns each freeze into several shorter gaps (the
# stream slows instead of stopping); disaggregated, the decode instance never prefills a long prompt.

# %%
figures.timeline_figure(run.rows["colocated_chunked"], title="colocated, chunked prefill (tuned token budget)")

# %%
figures.timeline_figure(run.rows["disaggregated"], title="disaggregated: 1 prefill + 1 decode instance")

# %%
figures.itl_cdf_figure({name: rows for name, rows in run.rows.items()})

# %% [markdown]
# **The price.** Disaggregated, the long prompts have one prefill core instead of two and wait for their KV
# transfer: their TTFT is the figure that gets worse (the verdict's last line). Chunked prefill does not remove the
# prefill work from the decode instance either: a long prompt still takes the same core-seconds, spread out.
#
# ## Check: does your measurement show the effect?

# %%
scenarios = run.summary["scenarios"]
share = {name: scenarios[name]["short"]["stalled"]["share"] for name in scenarios}
worst = {name: scenarios[name]["short"]["worst_gap_ms"]["p99"] for name in scenarios}
course.check(
    share["colocated"] > 2 * share["disaggregated"] and share["colocated"] > 0.1,
    f"on the same cores, {share['colocated']:.0%} of short requests stalled colocated against "
    f"{share['disaggregated']:.0%} disaggregated",
    "raise DURATION_S so long prompts meet running streams; re-run with nothing else busy on the machine",
)
course.check(
    worst["colocated_chunked"] < worst["colocated"] and worst["disaggregated"] < worst["colocated"],
    f"chunked prefill and disaggregation both shorten the short requests' worst gap (p99 over requests): "
    f"{worst['colocated']:,.0f} ms colocated, {worst['colocated_chunked']:,.0f} ms chunked, "
    f"{worst['disaggregated']:,.0f} ms disaggregated",
    "re-run with nothing else busy on the machine; a longer DURATION_S gives more collisions to compare",
)
course.check(not causes.empty and (causes["overlap_s"] > 0).all(),
             f"every stall of the colocated run sat inside a long prompt's prefill ({len(causes)} stalls)",
             "a stall outside every prefill means something else froze the instance: look at its log")

# %% [markdown]
# ## Exercises
#
# 1. In a copy of `labs/hol-blocking.yaml`, set the chunked scenario's `max_num_batched_tokens` to 64 and to 1024
#    (load it with `course.lab_spec(PATH, MODEL)`). How do the share stalled, the worst gap and the long prompts'
#    TTFT move? Which users pay for a smaller budget?
# 2. Raise the workload's `prefill_load` from 0.55 to 0.8. Do stalls get longer, more frequent, or both? What
#    happens to the disaggregated scenario's long prompts, whose prefill now has one core?
# 3. Find a short request that stalled twice in the colocated timeline. Were both stalls the same long prompt?
# 4. Compare the short requests' ITL p99 with their worst gap p99 in the table. Why can a run where a third of the
#    short requests froze still have a low ITL p99?
