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
# # 00 · Set-up: your machine, the model, a deployment up and down
#
# **Learning objectives.** After this notebook you can
# - check that this machine has what the lab needs (Python packages, CPU cores, the local model);
# - make the local model: a small Llama-architecture model with seeded weights and a tokenizer trained on local
#   text, so nothing is downloaded;
# - bring a disaggregated deployment up (one prefill and one decode vLLM instance, the KV cache moved between them
#   by NIXL), send it one request through the prefill -> decode path, and bring it down again, leaving nothing
#   running.
#
# The model's weights are random, so its answers are gibberish. That is fine: vLLM serves it with the same code
# paths, KV cache layout and transfer protocol as a real Llama, and that is what the lab measures.

# %% tags=["parameters"]
from pdlab import course

MODEL = course.choose("pdlab-small", "pdlab-tiny")  # the catalog model to make and serve
LAB = "local-1p1d"  # a lab spec under labs/: one prefill and one decode instance
PROMPT = "Why does a long prompt hold up other requests?"  # the one request we send
MAX_TOKENS = course.choose(32, 8)

# %% [markdown]
# ## 1. What is on this machine
#
# A report from `pdlab.course.setup_report`: versions of the packages the lab uses, how many CPU cores this process may
# use (the local deployment pins one vLLM instance per core), and which local models are made.

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
# ## 3. Bring a deployment up, send one request, bring it down
#
# A lab spec (`labs/*.yaml`) says what to run; `pdlab.deploy.Deployment` starts the vLLM instances, waits until
# each answers its health check, and stops them all when the `with` block ends, even on an error. On two CPU
# cores each instance takes a minute or two to start.
#
# The request goes the disaggregated way: to the prefill instance with `max_tokens=1` (it reads the prompt and
# keeps its KV cache), then to the decode instance with the `kv_transfer_params` the prefill answered (it pulls
# the KV cache over NIXL and writes the answer).

# %%
import psutil

from pdlab.config import load_lab
from pdlab.deploy import Deployment
from pdlab.pdrequest import pd_completion_async
from pdlab.settings import repo_root

spec = load_lab(repo_root() / "labs" / f"{LAB}.yaml").main_deployment()
spec = spec.model_copy(update={"model": spec.model.model_copy(update={"name": MODEL})})

with Deployment(spec) as dep:
    for instance in dep.instances:
        print(f"{instance.spec.name:12} {instance.spec.role:8} {instance.url} pid {instance.pid} {instance.log_path}")
    pids = [instance.pid for instance in dep.instances]
    running = all(psutil.pid_exists(pid) for pid in pids)
    answer = await pd_completion_async(dep.urls("prefill")[0], dep.urls("decode")[0], dep.served_model, PROMPT,
                                       max_tokens=MAX_TOKENS)
gone = not any(psutil.pid_exists(pid) for pid in pids)  # stopped and reaped: not even a zombie left
print(f"answer: {answer.text!r}")
print(f"prefill {answer.prefill_s * 1e3:.0f} ms, first token {answer.ttft_s * 1e3:.0f} ms, "
      f"all {answer.completion_tokens} tokens {answer.e2e_s * 1e3:.0f} ms")

# %% [markdown]
# ## Check: did it come up, answer through the P/D path, and go away?

# %%
course.check(running, "every instance was running inside the `with` block",
             "read the instance logs printed above; `pdlab up` on the command line shows the same start-up")
course.check(
    bool(answer.kv_transfer_params) and answer.completion_tokens == MAX_TOKENS,
    f"the prefill instance handed over its KV cache and the decode instance wrote {answer.completion_tokens} tokens",
    "the prefill answer had no kv_transfer_params: check that both instances use the NIXL connector in the lab spec",
)
course.check(gone, "no instance is left running after the `with` block",
             f"processes {pids} are still alive: stop them with `pdlab down`")

# %% [markdown]
# ## Exercises
#
# 1. Run the same request straight to the decode instance (`httpx.post(dep.urls("decode")[0] + "/v1/completions",
#    ...)`) without the prefill step. Is the answer the same? (The model is greedy and deterministic.)
# 2. Make the prompt 20 times longer. Which of the printed times grows: prefill, first token, or the rest?
# 3. Open one instance's log (the path printed above) and find the line where vLLM reports the KV transfer.
