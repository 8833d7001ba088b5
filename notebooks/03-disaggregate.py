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
# # 03 · Disaggregate: prefill here, decode there
#
# **Learning objectives.** After this notebook you can
# - bring up one prefill and one decode vLLM instance with a router in front (1P1D);
# - follow one request through prefill -> KV transfer -> decode, and read the transfer's bytes and time from the
#   decode instance's NIXL metrics;
# - verify that the P/D path gives exactly the answer the prefill instance gives on its own;
# - see the HOL stall of notebook 02 disappear under the same kind of load.
#
# In P/D disaggregation the prefill instance reads the prompt and writes its KV cache, then the decode instance
# pulls that cache (vLLM's NixlConnector, here over UCX on this machine, RDMA on a GPU cluster) and streams the
# answer. A long prompt now stalls only the prefill instance; streams on the decode instance keep their pace.

# %% tags=["parameters"]
from pdlab import course

MODEL = course.choose("pdlab-small", "pdlab-tiny")  # the served model (ignored when $PDLAB_ATTACH names one)
PROMPT_TOKENS = course.choose(2000, 1000)  # the prompt we follow through the P/D path
MAX_TOKENS = course.choose(32, 16)  # tokens to generate
RATE = course.choose(1.5, 1.5)  # load of section 4, requests per second
DURATION_S = course.choose(60, 12)  # seconds of load
LONG_FRACTION = course.choose(0.2, 0.25)

# %%
dep = course.open_deployment("local-1p1d-router", MODEL)
prefill_url, decode_url = dep.urls("prefill")[0], dep.urls("decode")[0]
print(f"prefill {prefill_url}, decode {decode_url}, router {dep.router_url}, model {dep.served_model}")

# %% [markdown]
# ## 1. One request, step by step
#
# `pd_completion_async` does what the router does for a long prompt: it sends the request to the prefill
# instance with `max_tokens=1` and `kv_transfer_params={"do_remote_decode": true}`; the answer carries
# `kv_transfer_params` naming the blocks that hold the prompt's KV cache; the same request goes to the decode
# instance with those parameters, and the decode instance pulls the blocks before its first step.
# We scrape the decode instance's NIXL counters before and after.

# %%
from pdlab.load.prompts import PromptBuilder
from pdlab.metrics.kv import scrape_kv_transfer
from pdlab.pdrequest import pd_completion_async

prompt = PromptBuilder(dep.model_dir).prompt(PROMPT_TOKENS, key="notebook-03")
before = scrape_kv_transfer(decode_url)
answer = await pd_completion_async(prefill_url, decode_url, dep.served_model, prompt, max_tokens=MAX_TOKENS,
                                   stream=False)
moved = scrape_kv_transfer(decode_url) - before
print(f"prompt {answer.prompt_tokens} tokens; kv_transfer_params from prefill: {answer.kv_transfer_params}")
print(f"prefill leg {answer.prefill_s * 1e3:,.0f} ms; whole request {answer.e2e_s * 1e3:,.0f} ms")
print(f"KV transfer: {moved.transfers:g} transfer(s), {moved.bytes / 1e6:,.2f} MB "
      f"in {moved.xfer_seconds * 1e3:,.1f} ms")

# %% [markdown]
# How many bytes should that be? Each prompt token stores a key and a value vector per layer and KV head.

# %%
from pdlab.model.shape import shape_of_dir

shape = shape_of_dir(dep.model_dir)  # float32, as served here
expected = shape.kv_bytes_per_token() * answer.prompt_tokens
print(f"{shape.kv_bytes_per_token():,} bytes per token x {answer.prompt_tokens} tokens = {expected / 1e6:,.2f} MB "
      f"(vLLM moves whole 128-token blocks)")

# %% [markdown]
# ## 2. Same answer as a colocated instance?
#
# Greedy decoding (temperature 0) with `ignore_eos` is deterministic: the prefill instance asked for the whole
# answer itself must write the same tokens as the P/D path did.

# %%
import httpx

direct = httpx.post(f"{prefill_url}/v1/completions", timeout=120, json={
    "model": dep.served_model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
    "ignore_eos": True}).json()["choices"][0]
print(f"P/D:    {answer.text!r}\ndirect: {direct['text']!r}")

# %% [markdown]
# ## 3. Under load
#
# The same mixed load as notebook 02, now through the router: long prompts go prefill -> decode, short ones
# straight to decode. On each long request's row a diamond marks the moment the prefill instance answered the
# router (hover it): the rest of its TTFT is the KV transfer, the wait on the decode instance and its first step.

# %%
from pdlab.config.workload import MixedWorkload
from pdlab.metrics.summary import scenario_summary
from pdlab.report import figures, headline_table

workload = MixedWorkload(rate=RATE, duration_s=DURATION_S, long_fraction=LONG_FRACTION, short_tokens=64,
                         long_tokens=4000, short_output_tokens=64, long_output_tokens=8, seed=0)
rows = course.measure_load(dep, workload, scenario="disaggregated", lab="disaggregate")
summary = scenario_summary(rows)
figures.timeline_figure(rows, title="1P1D behind the router")

# %%
headline_table({"scenarios": {"disaggregated": summary}}).round(1)

# %% [markdown]
# ## Check: does your measurement show the effect?

# %%
course.check(
    moved.transfers >= 1 and moved.bytes > 0.5 * expected,
    f"the decode instance pulled the prompt's KV cache: {moved.bytes / 1e6:,.2f} MB (expected about "
    f"{expected / 1e6:,.2f} MB)",
    "make PROMPT_TOKENS longer than a few KV blocks (128 tokens each); check both instances' logs for NIXL errors",
)
course.check(
    answer.text == direct["text"],
    "the P/D path wrote exactly the tokens the prefill instance writes on its own",
    "greedy decoding must be on (temperature 0) and both instances must serve the same model",
)
itl, during = summary["short"]["itl_ms"], summary["short_itl_during_long_prefill_ms"]
course.check(
    during["count"] > 0 and during["p50"] < 3 * itl["p50"],
    f"short streams kept their pace while long prompts were prefilled: median gap {during['p50'] or 0:,.0f} ms "
    f"during long prefills vs {itl['p50']:,.0f} ms overall ({during['count']} gaps during prefills)",
    "if no gap fell during a prefill, raise DURATION_S or LONG_FRACTION; else re-run with nothing else busy on "
    "the machine (the decode instance must have its own core)",
)

# %%
dep.stop()  # stops it only if this notebook started it

# %% [markdown]
# ## Exercises
#
# 1. Double `PROMPT_TOKENS`. Do the bytes double? Does the transfer time? What is the transfer's MB/s, and how
#    does it compare with a 400 Gb/s EFA link (notebook 08)?
# 2. From section 3's timeline, find a long request: how does its TTFT split into prefill (up to the diamond),
#    transfer and the first decode step? Compare the part after the diamond with section 1's transfer time.
# 3. Send a prompt shorter than 128 tokens (one KV block) through `pd_completion_async`. How many bytes move, and why?
