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
# # 00 · Set-up, and your first P/D deployment, built by hand
#
# **Learning objectives.** After this notebook you can
# - check that this machine has what the lab needs (Python packages, CPU cores, the local model);
# - write a *lab spec*: the YAML file that says which vLLM instances to run, on which cores, with which KV
#   connector; validate it, and read the error when a field is wrong;
# - read the exact command line and environment pdlab will run for each instance, and say what each flag does;
# - bring the deployment up, send one request through prefill and decode **by hand** (two HTTP calls, and the
#   `kv_transfer_params` that travel between them), and bring it down, leaving nothing running.
#
# **The words.** An LLM answers a request in two phases. *Prefill* reads the whole prompt in one pass and writes
# its *KV cache* (the attention keys and values of every prompt token, kept so later tokens need not recompute
# them). *Decode* then writes the answer one token per step, reading that cache at every step. In *disaggregated
# prefill/decode* (P/D) the two phases run on different servers: a *prefill instance* computes the KV cache and a
# *decode instance* takes it over and writes the answer. The cache moves between them with **NIXL** (NVIDIA's
# Inference Xfer Library, a transfer library vLLM uses for this), which on this laptop sends it over **UCX**
# (Unified Communication X, a transport library: TCP or shared memory here, RDMA on a cluster). On AWS GPU
# clusters the same bytes cross **EFA** (Elastic Fabric Adapter, AWS's RDMA network), which NIXL reaches through
# **libfabric** (the open-source fabric library EFA's driver plugs into).
#
# The model is a small Llama-architecture model pdlab makes locally with seeded random weights, so its answers are
# gibberish. That is fine: vLLM serves it with the same code paths, KV cache layout and transfer protocol as a
# real Llama, and that is what the lab measures.

# %% tags=["parameters"]
from pdlab import course

MODEL = course.choose("pdlab-small", "pdlab-tiny")  # the catalog model to make and serve
PROMPT_TOKENS = course.choose(600, 300)  # the first request's prompt: several 128-token KV blocks
MAX_TOKENS = course.choose(32, 8)  # tokens the decode instance writes

# %% [markdown]
# ## 1. What is on this machine
#
# A report from `pdlab.course.setup_report`: versions of the packages the lab uses, how many CPU cores this process
# may use (the local deployment pins one vLLM instance per core), and which local models are made.

# %%
from IPython.display import Markdown

env = course.setup_report()
Markdown(course.environment_table(env))

# %%
course.check(
    not {"vllm", "torch", "nixl", "plotly", "ipywidgets", "anywidget"} & set(env.missing()),
    "the packages the lab needs are installed",
    f"missing: {', '.join(env.missing())}. From the repository root run `make setup` (it installs pdlab with its "
    "`local` and `lab` extras).",
)
course.check(
    env.cpu_cores >= 2,
    f"{env.cpu_cores} CPU cores available (the local deployment pins prefill and decode to a core each)",
    "give this machine (or container) at least 2 cores",
)

# %% [markdown]
# ## 2. Make the local model
#
# `pdlab.model` makes a catalog model once into pdlab's cache (`~/.cache/pdlab/models`, or `$PDLAB_HOME`); later
# calls find it there. `pdlab model make` on the command line does the same.

# %%
from pdlab import model

model.make_model(MODEL)
model.describe(MODEL)

# %% [markdown]
# ## 3. Write the lab spec
#
# A lab spec is YAML. This one describes the smallest disaggregated deployment, *1P1D*: one prefill and one decode
# instance, each pinned to its own core, with vLLM's NixlConnector moving the KV cache over UCX. Every field is
# documented in `pdlab.config` (each class's docstrings); `labs/local-1p1d.yaml` is the same spec as a file.
# Edit it here: the cells below read this text.

# %%
SPEC = f"""
name: my-1p1d
deployment:
  name: my-1p1d
  model:
    name: {MODEL}
  connector:
    kind: nixl              # vLLM's NixlConnector
    nixl_backends: [UCX]    # NIXL's transport on this machine (LIBFABRIC for EFA)
  instances:
    - name: prefill-0
      role: prefill         # reads prompts, keeps their KV cache for a decode instance to take
      cores: [0]
      kv_cache_gib: 1       # always explicit: vLLM's CPU default takes half the RAM
    - name: decode-0
      role: decode          # takes the KV cache over and writes the answer
      cores: [1]
      kv_cache_gib: 1
"""

# %% [markdown]
# pdlab validates a spec before it runs anything. Unknown keys are errors, not silently ignored: here is what a
# one-letter typo gives (`kv_cache_gb` for `kv_cache_gib`). The error names the field by its path.

# %%
from pdlab.config import ConfigError, parse_lab

typo_error = ""
try:
    parse_lab(SPEC.replace("kv_cache_gib", "kv_cache_gb", 1), source="the spec with a typo")
except ConfigError as error:
    typo_error = str(error)
print(typo_error)

lab = parse_lab(SPEC, source="your spec")
spec = lab.main_deployment()
print(f"valid: {lab.name}, instances {[(i.name, i.role, i.cores) for i in spec.instances]}")

# %% [markdown]
# ## 4. What pdlab will run
#
# `Deployment(spec).dry_run()` decides everything a start decides (ports, cores, flags, environment) and starts
# nothing. In a terminal, `pdlab up labs/local-1p1d.yaml --dry-run` prints the same for a spec file.
# Each instance is one `python -m vllm.entrypoints.openai.api_server` process (what `vllm serve` runs), pinned to
# its cores with `taskset`. The table says what each flag, each key of the `--kv-transfer-config` JSON and each
# environment variable does. This command line is what you would write on a GPU node, with a GPU's device and
# EFA's backend in place of `cpu` and `UCX`.

# %%
import pandas as pd

from pdlab.deploy import Deployment
from pdlab.deploy.plan import explain, shell_line

planned = Deployment(spec).dry_run()
for plan in planned.instances:
    print(f"# {plan.name} ({plan.spec.role}) at {plan.url}, NIXL side channel port "
          f"{plan.spec.nixl_side_channel_port}\n{shell_line(plan)}\n")

# %%
pd.set_option("display.max_colwidth", 200)
pd.DataFrame(explain(planned.instances[0]))

# %% [markdown]
# Two things to notice. Both instances get the same `--kv-transfer-config` with `kv_role: kv_both`: nothing in the
# command line makes an instance "the prefill one". What makes a request prefill-only is the request itself (next
# section). And each instance has its own NIXL *side channel* port: before the first transfer the decode instance
# asks the prefill instance there for its NIXL metadata (which memory holds its KV blocks, how to reach it).
#
# ## 5. Bring it up
#
# `course.start` says first whether something else is already running here (it would share the cores this lab
# measures on), then starts both instances, waits until each answers its health check, and warms them up (a first
# request each, and a first KV transfer between them). On a 2-core AMD EPYC the pdlab-small pair answered its health
# checks 25.5 s after the start (`pdlab bench startup`, data/results/startup/), each instance using 3.3 GB of
# memory; the warm-up adds a few seconds.

# %%
import psutil

dep = course.start(spec)
for instance in dep.instances:
    print(f"{instance.spec.name:10} {instance.spec.role:8} {instance.url}  pid {instance.pid}  {instance.log_path}")
pids = [instance.pid for instance in dep.instances]
running = all(psutil.pid_exists(pid) for pid in pids)

# %% [markdown]
# ## 6. One request through prefill and decode, by hand
#
# **Call 1, to the prefill instance.** The request asks for one token, without streaming, and carries
# `kv_transfer_params` saying "decode will happen elsewhere: keep this KV cache for someone to pull".

# %%
import httpx

from pdlab.load.prompts import PromptBuilder

prompt = PromptBuilder(dep.model_dir).prompt(PROMPT_TOKENS, key="notebook-00")
request = {"model": dep.served_model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
           "ignore_eos": True}
prefill_url, decode_url = dep.urls("prefill")[0], dep.urls("decode")[0]

first = httpx.post(f"{prefill_url}/v1/completions", timeout=120, json={
    **request, "max_tokens": 1, "stream": False,
    "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                           "remote_block_ids": None, "remote_host": None, "remote_port": None}}).json()
handed_over = first["kv_transfer_params"]
print(f"prompt: {first['usage']['prompt_tokens']} tokens; the prefill instance answered with:")
handed_over

# %% [markdown]
# The answer's `kv_transfer_params` name the prefill instance (`remote_engine_id`, its side channel's
# `remote_host` and `remote_port`) and the KV blocks that hold this prompt (`remote_block_ids`: one per 128 tokens,
# listed per KV cache group).
#
# **Call 2, to the decode instance.** The same request, with those parameters copied unchanged. The decode
# instance pulls the blocks over NIXL, then writes the answer as if it had read the prompt itself. Its NIXL
# counters (`/metrics`) say what moved.

# %%
from pdlab.metrics.kv import handed_over_blocks, scrape_kv_transfer

before = scrape_kv_transfer(decode_url)
second = httpx.post(f"{decode_url}/v1/completions", timeout=120,
                    json={**request, "kv_transfer_params": handed_over}).json()
moved = scrape_kv_transfer(decode_url) - before
print(f"answer ({second['usage']['completion_tokens']} tokens): {second['choices'][0]['text']!r}")
print(f"KV moved prefill -> decode: {moved.transfers:g} transfer, {moved.bytes / 1e6:,.2f} MB in "
      f"{moved.xfer_seconds * 1e3:,.1f} ms")

# %% [markdown]
# `pdlab.pdrequest.pd_completion` makes exactly these two calls, and pdlab's router makes them for every prompt
# long enough to send through prefill -> decode (notebook 04).
#
# ## 7. Bring it down
#
# `stop()` ends every process the deployment started. The checks come after it, so a failing check never leaves
# the deployment running (a failing check also stops whatever `course.start` began).

# %%
dep.stop()
gone = not any(psutil.pid_exists(pid) for pid in pids)  # stopped and reaped: not even a zombie left

# %% [markdown]
# ## Check: was the spec checked, did the request go through prefill and decode, and is everything gone?

# %%
course.check("kv_cache_gb" in typo_error, "the spec with a typo was refused, naming the field",
             "the validation cell should print the field `deployment.instances.0.kv_cache_gb`")
course.check(running, "every instance was running after the start",
             "read the instance logs printed above; `pdlab up` on the command line shows the same start-up")
blocks = handed_over_blocks(handed_over)
course.check(
    blocks > 0 and second["usage"]["completion_tokens"] == MAX_TOKENS,
    f"the prefill instance handed over {blocks} KV blocks and the decode instance wrote "
    f"{second['usage']['completion_tokens']} tokens",
    "the prefill answer had no kv_transfer_params: check that the spec's connector is `nixl`",
)
course.check(moved.transfers >= 1 and moved.bytes > 0,
             f"the decode instance pulled the prompt's KV cache over NIXL ({moved.bytes / 1e6:,.2f} MB)",
             "a prompt shorter than one KV block (128 tokens) moves nothing: raise PROMPT_TOKENS")
course.check(gone, "no instance is left running after stop()",
             f"processes {pids} are still alive: stop them with `kill`, or restart the kernel")

# %% [markdown]
# ## Exercises
#
# 1. Send call 2 without `kv_transfer_params` (the same request, straight to the decode instance). Is the answer
#    the same? (The model is greedy and deterministic.) How many bytes did NIXL move this time, and why?
# 2. In `SPEC`, give the decode instance `engine: {max_num_batched_tokens: 256}` and re-run the dry run. Which flag
#    appears, and what does it bound? Then misspell a role (`role: decoder`) and read the error.
# 3. Compare the KV megabytes moved with what you expect: `shape_of_dir(dep.model_dir)` (from
#    `pdlab.model.shape`) gives the model's layers, KV heads and head size; a token's KV takes layers x 2 (K and V)
#    x KV heads x head size x 4 bytes (float32). vLLM moves whole 128-token blocks. (Notebook 03 does this sum.)
# 4. Open the decode instance's log (the path printed in section 5) and find the lines about the NIXL handshake
#    with the prefill instance.
