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
# # 02 · Head-of-line blocking: one long prompt freezes every stream
#
# **Learning objectives.** After this notebook you can
# - send a mixed load (short streaming chats and long documents) to one colocated vLLM instance and read its
#   per-request timeline;
# - point at a *head-of-line (HOL) stall*: every running stream stops while a long prompt is prefilled;
# - say what chunked prefill (a smaller per-step token budget) changes, and what it cannot fix.
#
# A colocated instance runs both phases in the same scheduler steps. vLLM gives every running sequence one decode
# token per step, then fills the step's token budget with prefill. A 4,000-token prompt makes that step (or those
# steps) long, and every stream sharing the instance waits for it: its inter-token latency (ITL) jumps from tens
# of milliseconds to seconds. Notebook 01 measured why: prefill is compute-bound, and the step cannot end sooner.
#
# We start two colocated instances side by side, each on its own core: `default` with vLLM's default budget and
# `chunked` with `max_num_batched_tokens=256`, then send each the same load in turn.

# %% tags=["parameters"]
from pdlab import course

MODEL = course.choose("pdlab-small", "pdlab-tiny")  # the served model
RATE = course.choose(1.5, 1.5)  # requests per second (Poisson arrivals)
DURATION_S = course.choose(60, 12)  # seconds of load per instance
LONG_FRACTION = course.choose(0.2, 0.25)  # share of long prompts
SHORT_TOKENS, LONG_TOKENS = 64, course.choose(4000, 4000)  # prompt lengths (tokens)
SHORT_OUTPUT = course.choose(128, 64)  # tokens each short request streams
CHUNK_BUDGET = 256  # the chunked instance's max_num_batched_tokens
PORTS = (8120, 8121)  # this notebook's pair, clear of the shared 1P1D deployment's ports (8000, 8100+)

# %%
from pdlab.config.workload import MixedWorkload
from pdlab.deploy import Deployment
from pdlab.metrics.summary import scenario_summary
from pdlab.report import figures

spec = course.lab_deployment("local-colocated", MODEL)
default, chunked = (inst.model_copy(update={"port": port}) for inst, port in zip(spec.instances, PORTS, strict=True))
chunked = chunked.model_copy(update={"engine": chunked.engine.model_copy(
    update={"enable_chunked_prefill": True, "max_num_batched_tokens": CHUNK_BUDGET})})
spec = spec.model_copy(update={"name": "course-hol", "router": None, "instances": [default, chunked]})
dep = Deployment(spec).start()  # this notebook's own pair, whatever else is running
for inst in dep.instances:
    print(f"{inst.name:12} {inst.url}  max_num_batched_tokens={inst.spec.engine.max_num_batched_tokens}")

# %% [markdown]
# ## 1. The load
#
# Open-loop: each request is sent at its scheduled time whether or not the earlier ones have finished, as real
# users do. Short requests stream `SHORT_OUTPUT` tokens; long ones are documents to read with a short answer.

# %%
workload = MixedWorkload(rate=RATE, duration_s=DURATION_S, long_fraction=LONG_FRACTION, short_tokens=SHORT_TOKENS,
                         long_tokens=LONG_TOKENS, short_output_tokens=SHORT_OUTPUT, long_output_tokens=8, seed=0)
rows = {}
for inst in dep.instances:
    rows[inst.name] = course.measure_load(dep, workload, scenario=inst.name, lab="hol", url=inst.url)

# %% [markdown]
# ## 2. The timeline: where the streams freeze
#
# One line per request, in send order. The thick part is the wait for the first token (TTFT), each tick a
# streamed token, red a *stall* (a gap over 5x that request's median gap). The shaded bands are long prompts'
# prefills: every red segment sits in one.

# %%
figures.timeline_figure(rows[default.name], title=f"{default.name}: vLLM's default token budget")

# %% [markdown]
# ## 3. Chunked prefill: the classic mitigation
#
# With a budget of 256 tokens per step, a 4,000-token prompt is prefilled over ~16 steps, each also carrying one
# token of every stream. The streams keep moving, slower, instead of freezing.

# %%
figures.timeline_figure(rows[chunked.name], title=f"{chunked.name}: max_num_batched_tokens={CHUNK_BUDGET}")

# %%
from pdlab.report import headline_table

summaries = {name: scenario_summary(r) for name, r in rows.items()}
headline_table({"scenarios": summaries}).round(1)

# %%
figures.itl_cdf_figure(rows)

# %% [markdown]
# **Its limit.** Chunking spreads the prefill but does not remove it: each step still does 256 tokens of prefill
# work, so while a long prompt is read every stream's ITL is several times its idle value, and a long prompt now
# takes more steps to reach its first token. The prefill and decode still compete for the same core. The next
# notebook moves them apart.
#
# ## Check: does your measurement show the effect?

# %%
base, tuned = summaries[default.name]["short"]["itl_ms"], summaries[chunked.name]["short"]["itl_ms"]
course.check(
    base["max"] > 5 * base["p50"],
    f"with the default budget a short stream froze: its longest gap is {base['max']:,.0f} ms against a median "
    f"of {base['p50']:,.0f} ms (want > 5x)",
    "raise DURATION_S or LONG_FRACTION so that long prompts meet running streams, or make LONG_TOKENS longer",
)
course.check(
    tuned["max"] < base["max"],
    f"chunked prefill shortens the worst freeze ({tuned['max']:,.0f} ms vs {base['max']:,.0f} ms)",
    "re-run with nothing else busy on the machine; a longer DURATION_S gives more collisions to compare",
)

# %%
dep.stop()

# %% [markdown]
# ## Exercises
#
# 1. Set `CHUNK_BUDGET` to 64 and to 1024. How do the short streams' p99 ITL and the long prompts' TTFT move?
#    Which users pay for a smaller budget?
# 2. Double `RATE`. Do stalls get longer, more frequent, or both? Why (think about how many streams are running
#    when a long prompt arrives)?
# 3. Set `LONG_FRACTION` to 0: what is the ITL of a stream with no long prompt around? That is the figure
#    disaggregation tries to keep under any load.
