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
# # 08 · On SageMaker HyperPod: LMCache over EFA
#
# **Learning objectives.** After this notebook you can
# - render the lab's 1P1D deployment for a SageMaker HyperPod cluster (`pdlab.cluster`): one
#   `InferenceEndpointConfig` with prefill and decode pools, the KV cache moved GPU to GPU by LMCache over NIXL on
#   EFA;
# - read what each field does, and map the local lab's knobs (threshold, strategies, engine options) onto it;
# - apply it with kubectl (shown here as a dry run: no cluster or credentials are needed to read this notebook).
#
# Locally, vLLM's NixlConnector moves the KV cache over UCX between two CPU processes. On HyperPod the HyperPod
# Inference Operator runs the pools and configures LMCache from `kvCacheSpec`; NIXL's LIBFABRIC backend sends
# the cache over EFA with GPUDirect RDMA (the NIC reads GPU memory directly). The lab spec is the same shape as
# the local one plus a `cluster:` block; `docs/cluster.md` documents every field and the EFA prerequisites.

# %% tags=["parameters"]
from pdlab import course

LAB = course.choose("hyperpod-llama70b-2p2d", "hyperpod-llama8b-1p1d")  # a cluster lab under labs/
TARGET = "hyperpod"  # hyperpod | k8s | script

# %%
from pdlab.cluster.plan import load_plan
from pdlab.cluster.render import render, write
from pdlab.settings import repo_root, runs_dir

lab_path = repo_root() / "labs" / f"{LAB}.yaml"
plan = load_plan(lab_path)
files = render(plan, TARGET)
out = runs_dir() / "cluster" / LAB / TARGET
written = write(files, out)
print("\n".join(str(path) for path in written))

# %% [markdown]
# ## 1. Read it
#
# `spec.worker` is what every replica shares (image, `vllm serve`, the EFA environment: `FI_PROVIDER=efa`,
# `FI_EFA_USE_DEVICE_RDMA=1`); `spec.pdSpec` holds each pool's replicas, GPUs, EFA interfaces and vLLM flags, and
# `routingThreshold`: pdlab's `threshold`, the same rule as the local router (`>=` goes P/D).
# `kvCacheSpec` turns on LMCache; `intelligentRoutingSpec` picks the operator router's strategy.

# %%
from IPython.display import Markdown

main = next(iter(files))
Markdown(f"`{main}`\n\n```yaml\n{files[main]}\n```")

# %%
import yaml

obj = yaml.safe_load(files["inferenceendpointconfig.yaml"]) if TARGET == "hyperpod" else {}
pd_spec = obj.get("spec", {}).get("pdSpec", {})
print(f"routingThreshold: {pd_spec.get('routingThreshold')}  (lab: {plan.deployment.router.threshold})")
for pool in ("prefillSpec", "decodingSpec"):
    print(f"{pool}: {yaml.safe_dump(pd_spec.get(pool, {}), default_flow_style=True, width=200)[:300]}")
print(f"kvCacheSpec: {obj.get('spec', {}).get('kvCacheSpec')}")

# %% [markdown]
# ## 2. Apply it
#
# `pdlab cluster apply` renders and runs `kubectl apply -f` against your current kubectl context (pdlab holds no
# credentials). With `--dry-run` it only renders and prints the command, which is what we do here.

# %%
import subprocess
import sys

dry = subprocess.run([sys.executable, "-m", "pdlab.cli", "cluster", "apply", str(lab_path), "--target", TARGET,
                      "--dry-run"], capture_output=True, text=True, cwd=repo_root())
print(dry.stdout or dry.stderr)

# %% [markdown]
# On a real cluster, in order: the Secret with the Hugging Face token, `pdlab cluster apply ... --target
# hyperpod`, then `pdlab cluster status ...` until the pools are ready. Check EFA first (`docs/cluster.md`,
# "EFA prerequisites"): without the security-group rule or the device plugin, NIXL falls back or fails at start-up.
#
# ## Check: is the rendered object valid for the operator?
#
# The API server would silently drop a misspelt field; pdlab checks the object against the operator's CRD schema
# made strict, so a misspelling is an error here instead.

# %%
from pdlab.cluster import crd

problems = crd.problems(obj, crd.crd_schema("v1")) if TARGET == "hyperpod" else []
course.check(
    dry.returncode == 0 and not problems and (TARGET != "hyperpod" or
                                              pd_spec["routingThreshold"] == plan.deployment.router.threshold),
    f"the {TARGET} rendering of {LAB} conforms to the operator's CRD and carries the lab's threshold",
    f"problems: {problems or dry.stderr}. Fix the field named in the lab spec and re-render.",
)

# %% [markdown]
# ## Exercises
#
# 1. Set `TARGET = "k8s"` and read `prefill.yaml` and `lmcache-config.yaml`: where do `pd_role`, `nixl_backends`
#    and the peer ports appear? Why are the pools StatefulSets?
# 2. In a copy of the lab spec, set `decode_strategy: leastloaded` and render for HyperPod. What does the error say,
#    and which target supports it?
# 3. Notebook 07 found the best prefill:decode split for Llama-70B on H200s. Write it into a copy of
#    `labs/hyperpod-llama70b-2p2d.yaml` (replicas per pool) and render it.
# 4. Before renting the nodes, ask the simulator: `pdlab sim run labs/sim/hyperpod-llama70b-2p2d.yaml` simulates
#    the lab as rendered (its `cluster_lab:` line). Point it at your copy: does your split keep the SLOs at 16
#    req/s where the shipped 2P2D does?
