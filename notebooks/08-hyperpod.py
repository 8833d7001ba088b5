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
# # 08 · On SageMaker HyperPod: LMCache over EFA
#
# **Learning objectives.** After this notebook you can
# - say what LMCache adds to vLLM (KV offload tiers, reuse across requests and instances, P/D transfer) and how
#   its P/D protocol differs from the NIXL one you ran locally: the prefill instance *pushes* the KV to a decode
#   replica chosen in advance, where vLLM's NixlConnector has the decode instance *pull* it;
# - read LMCache's P/D keys and the EFA/libfabric environment pdlab renders for each role, and say what each does;
# - render the lab's P/D deployment for a SageMaker HyperPod cluster (`pdlab.cluster`) and read the operator's
#   `pdSpec` fields (`routingThreshold`, per-role `replicas`, `topologySpec`, `autoScalingSpec`) from its own schema;
# - recognise LMCache's failure signs in a running cluster and say what causes them;
# - apply the rendering with kubectl (shown as a dry run: no cluster or credentials are needed for this notebook).
#
# **LMCache** is a KV-cache layer that plugs into vLLM as a KV connector (`LMCacheConnectorV1`). It stores a
# prompt's KV cache in *chunks* (256 tokens by default) keyed by hashes of their tokens, and can keep them in tiers
# beyond GPU memory: CPU memory, local disk, or a remote store shared by instances. A later request whose prompt
# starts with the same tokens loads those chunks instead of computing them (*reuse*, across requests and across
# instances that share a tier). Its third use is P/D: a *sender* (the prefill instance) transfers a prompt's chunks
# to a *receiver* (a decode instance) over NIXL, which on AWS runs over **EFA** through **libfabric** (notebook 00).
#
# **Push against pull.** Locally (notebooks 00 and 03) the decode instance *pulls*: prefill answers first, its
# `kv_transfer_params` name its blocks, and the decode instance reads them when the request reaches it. LMCache's
# P/D *pushes*: the router picks the decode replica **before** prefill starts and names it in the prefill
# request's `disagg_spec`; the sender writes the chunks into that receiver's buffer as it stores them; then the
# client's request goes, unchanged, to that replica, which finds the chunks by their token hashes. The decode
# replica is committed before the prompt is even read, and the transfer can overlap the prefill.
#
# On HyperPod the HyperPod Inference Operator runs the pools and configures LMCache from `kvCacheSpec`; on plain
# Kubernetes or bare hosts pdlab renders the LMCache configs itself. The lab spec is the same shape as the local one
# plus a `cluster:` block; `docs/cluster.md` documents every field and the EFA prerequisites.

# %% tags=["parameters"]
from pdlab import course

LAB = course.choose("hyperpod-llama70b-2p2d", "hyperpod-llama8b-1p1d")  # a cluster lab under labs/

# %%
from pdlab.cluster.plan import load_plan
from pdlab.cluster.render import render, write
from pdlab.settings import repo_root, runs_dir

lab_path = repo_root() / "labs" / f"{LAB}.yaml"
plan = load_plan(lab_path)
files = {target: render(plan, target) for target in ("hyperpod", "k8s")}
for target, rendered in files.items():
    print("\n".join(str(path) for path in write(rendered, runs_dir() / "cluster" / LAB / target)))

# %% [markdown]
# ## 1. The HyperPod object
#
# `spec.worker` is what every replica shares (image, `vllm serve`, the EFA environment); `spec.pdSpec` holds the
# P/D part. The descriptions below are the operator's own, read from its CRD (`data/hyperpod/`), beside what pdlab
# rendered from the lab spec.

# %%
import pandas as pd
import yaml
from IPython.display import Markdown

from pdlab.cluster import crd

schema = crd.crd_schema("v1")
obj = yaml.safe_load(files["hyperpod"]["inferenceendpointconfig.yaml"])
pd_spec = obj["spec"]["pdSpec"]
pd.set_option("display.max_colwidth", 160)
pd.DataFrame([{"field": f"pdSpec.{name}", "rendered": yaml.safe_dump(pd_spec.get(name), default_flow_style=True,
                                                                     width=200).strip()[:120],
               "the operator's description": doc[:160]}
              for name, doc in crd.field_docs(schema, "spec.pdSpec").items()])

# %% [markdown]
# - `routingThreshold` is pdlab's `threshold`, the same rule as the local router: a prompt of at least that many
#   tokens goes prefill -> decode (0 sends everything that way).
# - `prefillSpec.replicas` and `decodingSpec.replicas` size each pool on its own: the prefill:decode split that
#   notebook 07's simulator searches. Each role also gets its own GPUs, EFA interfaces and vLLM flags.
# - `topologySpec` keeps both pools in one availability zone (`sameAZ`: EFA does not cross zones) and, with
#   `placementGroup`, close together in the network.
# - `autoScalingSpec` scales each role on its own between `minReplicaCount` and `maxReplicaCount`, from CloudWatch
#   or Prometheus triggers. pdlab does not render it (a lab measures fixed pools); its fields, from the schema:

# %%
scaling = crd.field_docs(schema, "spec.pdSpec.autoScalingSpec")
roles = {role: crd.field_docs(schema, f"spec.pdSpec.autoScalingSpec.{role}") for role in scaling}
pd.DataFrame([{"field": f"autoScalingSpec.<role>.{name}", "the operator's description": doc}
              for name, doc in next(iter(roles.values())).items()
              if name in ("minReplicaCount", "maxReplicaCount", "pollingInterval", "prometheusTrigger",
                          "scaleUpStabilizationTime", "scaleDownStabilizationTime")]).assign(
    roles=", ".join(roles))

# %%
Markdown(f"```yaml\n{files['hyperpod']['inferenceendpointconfig.yaml']}\n```")

# %% [markdown]
# ## 2. The LMCache side, role by role
#
# The `k8s` target renders what the operator does for you on HyperPod: each role's LMCache config (a ConfigMap the
# replicas read through `LMCACHE_CONFIG_FILE`), its `--kv-transfer-config`, and its environment.

# %%
configs = yaml.safe_load(files["k8s"]["lmcache-config.yaml"])["data"]
sender, receiver = (yaml.safe_load(configs[name]) for name in ("lmcache-prefill.yaml", "lmcache-decode.yaml"))
keys = list(dict.fromkeys([*sender, *receiver]))
pd.DataFrame({"prefill (sender)": [sender.get(k, "") for k in keys],
              "decode (receiver)": [receiver.get(k, "") for k in keys]}, index=keys).astype(str)

# %% [markdown]
# What each key does:
# - `enable_pd`: turns on LMCache's P/D transfer;
# - `pd_role`: `sender` on prefill replicas, `receiver` on decode replicas (two senders never exchange a chunk);
# - `transfer_channel`, `nixl_backends`: move chunks with NIXL; `LIBFABRIC` reaches EFA through libfabric (`UCX`
#   would use TCP);
# - `pd_buffer_size`, `pd_buffer_device`: the GPU buffer a sender stages outgoing chunks in, and a receiver's for
#   incoming ones (larger: it holds the KV of every prompt being decoded);
# - `pd_peer_host`, `pd_peer_init_port`, `pd_peer_alloc_port`: where a receiver listens for senders (connection
#   set-up, buffer allocation), one port per GPU rank;
# - `pd_skip_proxy_notification`: the sender notifies no proxy when a push is done (pdlab's router waits for the
#   prefill response itself);
# - `chunk_size`: tokens per chunk, the unit LMCache hashes, stores and sends;
# - `save_unfull_chunk`: also send the prompt's last, partial chunk (or decode recomputes it);
# - `local_cpu`, `max_local_cpu_size`: the CPU offload tier, off here: P/D goes GPU to GPU (on HyperPod,
#   `kvCacheSpec.enableL1Cache` turns CPU offload on).
#
# The old P/D key names (`enable_nixl`, `nixl_role`, `nixl_buffer_size`, ...) are not there: LMCache 0.5 dropped
# them, and a config that still uses them runs without P/D after a warning.

# %%
for role in plan.roles:  # computed by pdlab.lmcache.settings, as for the local LMCache lab
    print(f"{role.role}: --kv-transfer-config {role.kv_transfer_config}")
    print(f"    environment: {role.env}")

# %% [markdown]
# `kv_producer` / `kv_consumer` fix each replica's side, where the local NIXL deployment's `kv_both` left it to the
# request. The environment is libfabric's and LMCache's:
# - `FI_PROVIDER=efa`: libfabric uses the EFA provider (not its TCP one);
# - `FI_EFA_USE_DEVICE_RDMA=1`: GPUDirect RDMA, the EFA adapter reads and writes GPU memory directly;
# - `FI_EFA_FORK_SAFE=1`: libfabric keeps registered memory safe when the process forks (vLLM starts workers);
# - `PYTHONHASHSEED=0`: every process hashes tokens the same way, so a receiver finds the chunks a sender keyed;
# - `LMCACHE_CONFIG_FILE`: the role's config above.
#
# ## 3. The request, pushed
#
# The router's prefill request under each protocol (`pdlab.pdrequest`): NIXL's asks the prefill instance to keep
# the KV for someone to pull; LMCache's names the receiver, before prefill starts, by host and per-rank ports.

# %%
from pdlab.pdrequest import PREFILL_KV_PARAMS, lmcache_kv_params

ports = plan.receiver_ports
decode = plan.roles[1]
decode_host = f"{plan.replica_names(decode)[0]}.{plan.service_host(decode.name)}"  # its pod's DNS name on k8s
print("pull (NIXL, local):", PREFILL_KV_PARAMS)
print("push (LMCache):    ", lmcache_kv_params("req-1", decode_host, ports.init_ports, ports.alloc_ports))

# %% [markdown]
# ## 4. When it goes wrong: the signs
#
# - **Decode replicas log zero chunks retrieved** (LMCache's "hit tokens: 0") for prompts prefill stored: the roles
#   do not pair (two senders, or `kv_role` and `pd_role` disagree), or `PYTHONHASHSEED` differs between the
#   processes, so the receiver looks up hashes the sender never made. Decode then computes every prompt itself:
#   it answers, correctly and slowly, so only the logs or the TTFT show it.
# - **KV transfers well below ~1 GB/s**: EFA is not in use. NIXL fell back to TCP (`nixl_backends: [UCX]`,
#   libfabric's TCP provider, no `vpc.amazonaws.com/efa` resource on the pod, or a security group without the
#   all-traffic rule to itself). One EFA adapter carries 100 Gbit/s, 12.5 GB/s.
# - **The object applies, yet a setting has no effect**: a misspelt field, silently pruned by the API server. The
#   check below catches it before `kubectl apply`.
# - **A prefill replica's engine dies on a plain request**: something sent it a request without `disagg_spec`; in
#   LMCache's P/D every request to a sender must name its receiver.
#
# `docs/cluster.md` ("EFA prerequisites") lists the checks to run on a node (`fi_info -p efa`).
#
# ## 5. Apply it
#
# `pdlab cluster apply` renders and runs `kubectl apply -f` against your current kubectl context (pdlab holds no
# credentials). With `--dry-run` it only renders and prints the command, which is what we do here.

# %%
import subprocess
import sys

dry = subprocess.run([sys.executable, "-m", "pdlab.cli", "cluster", "apply", str(lab_path), "--target", "hyperpod",
                      "--dry-run"], capture_output=True, text=True, cwd=repo_root())
print(dry.stdout or dry.stderr)

# %% [markdown]
# On a real cluster, in order: the Secret with the Hugging Face token, `pdlab cluster apply ... --target
# hyperpod`, then `pdlab cluster status ...` until the pools are ready. Check EFA first (`docs/cluster.md`,
# "EFA prerequisites"): without the security-group rule or the device plugin, NIXL falls back or fails at start-up.
#
# ## Check: is the rendering valid for the operator, and do the two roles pair?
#
# The API server would silently drop a misspelt field; pdlab checks the object against the operator's CRD schema
# made strict, so a misspelling is an error here instead.

# %%
problems = crd.problems(obj, schema)
course.check(
    dry.returncode == 0 and not problems and pd_spec["routingThreshold"] == plan.deployment.router.threshold,
    f"the HyperPod rendering of {LAB} conforms to the operator's CRD and carries the lab's threshold "
    f"({pd_spec['routingThreshold']})",
    f"problems: {problems or dry.stderr}. Fix the field named in the lab spec and re-render.",
)
course.check(
    (sender["pd_role"], receiver["pd_role"]) == ("sender", "receiver")
    and receiver["pd_peer_init_port"] == ports.init_ports
    and all(role.env.get("PYTHONHASHSEED") == "0" for role in plan.roles),
    f"the roles pair: prefill sends, decode receives on ports {ports.init_ports} (the ones the router names), and "
    "every replica hashes with PYTHONHASHSEED=0",
    "re-render from an unmodified lab spec; `tests/test_cluster.py` checks the same pairing",
)

# %% [markdown]
# ## Exercises
#
# 1. Read `prefill.yaml` and `lmcache-config.yaml` under the k8s rendering's folder: where do `pd_role`,
#    `nixl_backends` and the peer ports appear? Why are the pools StatefulSets?
# 2. In a copy of the lab spec, set `decode_strategy: leastloaded` and render for HyperPod. What does the error say,
#    and which target supports it?
# 3. Notebook 07 found the best prefill:decode split for Llama-70B on H200s. Write it into a copy of
#    `labs/hyperpod-llama70b-2p2d.yaml` (replicas per pool) and render it.
# 4. Add an `autoScalingSpec` to `obj` by hand (say `prefillAutoScaling: {minReplicaCount: 1, maxReplicaCount:
#    4}`) and run `crd.problems(obj, schema)`. Then misspell one of its fields: what does the check say? Why would
#    you scale the prefill pool on a different signal than the decode pool?
# 5. Before renting the nodes, ask the simulator: `pdlab sim run labs/sim/hyperpod-llama70b-2p2d.yaml` simulates
#    the lab as rendered (its `cluster_lab:` line). Point it at your copy: does your split keep the SLOs at 16
#    req/s where the shipped 2P2D does?
