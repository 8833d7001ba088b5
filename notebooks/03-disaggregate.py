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
# # 03 · Two nodes: prefill here, decode there, the KV cache across a link
#
# **Learning objectives.** After this notebook you can
# - write a two-node P/D deployment: prefill and decode each in its own network namespace with its own address,
#   joined by a link whose bandwidth you set;
# - move the KV cache the way the cluster tier does: LMCache pushes it from the prefill instance to the decode
#   instance the router names, over NIXL;
# - compute a model's KV bytes per token by hand and match it with the bytes LMCache pushed;
# - read one request's time to first token in parts: prefill, KV transfer, wait, first decode step;
# - change the link's bandwidth under a running deployment and see the transfer time follow;
# - verify that the P/D path writes exactly the tokens one instance doing both phases writes.
#
# In notebook 00 both instances ran on `127.0.0.1`, and the KV cache went from one process to the other through
# this machine's memory. In a real cluster prefill and decode run on different machines, and the cache crosses a
# network: how fast that network is decides whether disaggregation pays (notebook 06). `pdlab.netlab` makes that
# network on one laptop: each *node* is a Linux network namespace (its own interface, address and ports), the
# nodes hang off a bridge, and each node's interface is shaped with `tbf` (a token-bucket filter) to the link's
# rate in both directions, like a NIC of that speed (`docs/netlab.md`). Making namespaces needs root. Without it,
# the notebook says so and runs the two instances on two loopback addresses (`127.0.0.1`, `127.0.0.2`) instead,
# with no shaped link.
#
# The KV cache moves as on the cluster (`labs/hyperpod-*.yaml`, `docs/lmcache.md`): by **LMCache**. Right after
# the prefill, the prefill instance *pushes* the prompt's KV to the decode instance the router named, and tells the
# router when it has landed; only then does the router send the decode request. Notebook 00 used vLLM's
# NixlConnector, where the decode instance *pulls* the KV once it has the request: one word in the spec switches
# between the two (exercise 5).

# %% tags=["parameters"]
from pdlab import course

MODEL = course.choose("pdlab-small", "pdlab-tiny")  # the served model
PROMPT_TOKENS = course.choose([1000, 4000], [1000, 2000])  # prompts to follow through prefill -> decode
LINK_MBPS = course.choose([1000, 100], [400, 40])  # the link's rate (Mbit/s): first as started, then changed live
MAX_TOKENS = course.choose(16, 8)  # tokens each request writes

# %% [markdown]
# ## 1. The spec, on two nodes
#
# Notebook 00's spec with four changes: `nodes` (one namespace each), `node:` on each instance, `link` (its rate;
# `preset: 10gbe` instead would scale a real 10 GbE link to this model's KV size, see `docs/netlab.md`), and the
# connector: `kind: lmcache` with LMCache's buffers (the sender stages a prompt's KV in one, the receiver holds
# pushed KV in the other until decode loads it), and a `router`, which names the decode instance in each prefill
# request and hears the push's report. Its `threshold: 0` sends every prompt through prefill -> decode (notebook
# 04 turns that knob). `ucx_tls: "tcp,self"` leaves out UCX's shared-memory transports: namespaces share this
# machine's memory, and UCX would otherwise move the cache through it and never touch the link.
# `fallback_to_loopback: true` is what lets the notebook run without root.

# %%
SPEC = f"""
name: my-two-nodes
deployment:
  name: my-two-nodes
  model:
    name: {MODEL}
  connector:
    kind: lmcache            # LMCache pushes the KV (the cluster's); nixl: vLLM's NixlConnector, decode pulls it
    nixl_backends: [UCX]
    ucx_tls: "tcp,self"
    lmcache:
      sender_buffer_bytes: 268435456     # 256 MiB
      receiver_buffer_bytes: 536870912   # 512 MiB
  router:
    threshold: 0             # every prompt through prefill -> decode
  nodes:
    - name: prefill
    - name: decode
  link:
    mbps: {LINK_MBPS[0]}
    fallback_to_loopback: true
  instances:
    - name: prefill-0
      role: prefill
      node: prefill
      cores: [0]
      kv_cache_gib: 1
    - name: decode-0
      role: decode
      node: decode
      cores: [1]
      kv_cache_gib: 1
"""

# %%
import pandas as pd

from pdlab import netlab
from pdlab.config import parse_lab
from pdlab.deploy import Deployment
from pdlab.deploy.plan import explain, shell_line

spec = parse_lab(SPEC, source="your two-node spec").main_deployment()
two_nodes = netlab.unavailable_reason() is None
print("two nodes with a shaped link" if two_nodes else
      f"NO shaped link here: {netlab.unavailable_reason()}.\nThe instances run on two loopback addresses instead; "
      "the bandwidth knob has nothing to shape (run this notebook as root to see it work).")
planned = Deployment(spec).dry_run()
print(shell_line(planned.instances[1]))
pd.set_option("display.max_colwidth", 200)
rows = pd.DataFrame(explain(planned.instances[1]))
rows[rows["name"].isin(["ip", "--host", "--kv-transfer-config", "UCX_TLS", "UCX_NET_DEVICES"])]

# %% [markdown]
# The decode instance's command now starts with `ip netns exec <namespace>`, binds its node's address, and tells
# UCX to send on the node's one interface (`pdlab0`). Its `--kv-transfer-config` names LMCache's connector and its
# role (`kv_consumer`: it receives pushes); LMCache's own settings (`docs/lmcache.md`) go to it in a config file
# that the same code writes for the cluster's configs.
#
# ## 2. Bring it up
#
# Making the namespaces and the link takes a second; the instances take their usual half minute or so (notebook 00),
# and `pdlab` checks, before it says ready, that a first prompt's KV was pushed, reported and loaded.

# %%
dep = course.start(spec)
on_two_nodes = dep.netlab is not None  # False without root: two loopback addresses, no shaped link
prefill_url, decode_url = dep.urls("prefill")[0], dep.urls("decode")[0]
print(f"prefill {prefill_url}, decode {decode_url}, router {dep.router_url}")
if on_two_nodes:
    made = dep.netlab.describe()
    for name, node in made["nodes"].items():
        print(f"node {name}: namespace {node['netns']}, interface {node['interface']}, address {node['address']}")
    print(f"link shaped to {made['shaped']['mbps']:g} Mbit/s each way")

# %% [markdown]
# Look at it from a terminal (as root): `ip netns list`; `ip -n <namespace> addr` shows a node's interface and
# address; `tc -n <namespace> qdisc` its shaping.
#
# ## 3. How many bytes is a token's KV cache?
#
# Every layer keeps a key and a value vector per KV head for every token of context. Llama models use
# *grouped-query attention* (GQA): several query heads share one KV head, so the cache has fewer heads than the
# attention has (here `num_kv_heads` against `num_heads`). By hand, from the model's config:

# %%
from pdlab.model.shape import shape_of_dir

shape = shape_of_dir(dep.model_dir)  # float32 as served here: 4 bytes per value
head_dim = shape.head_dim
by_hand = shape.num_layers * 2 * shape.num_kv_heads * head_dim * 4
print(f"{shape.num_layers} layers x 2 (K and V) x {shape.num_kv_heads} KV heads (of {shape.num_heads} query heads) "
      f"x {head_dim} dims x 4 bytes = {by_hand:,} bytes per token")
print(f"pdlab's figure: {shape.kv_bytes_per_token():,}; LMCache's 256-token chunk: {256 * by_hand / 1e6:.2f} MB")

# %% [markdown]
# ## 4. Follow requests across the link
#
# `trace_request` sends one prompt to the router, streams the answer, and reads the router's timing headers
# (`x-pdlab-prefill-ms`, `x-pdlab-kv-wait-ms`) and LMCache's own log lines: the tokens and bytes the prefill
# instance pushed, and that the decode instance loaded them (it stops with an error if it recomputed the prompt
# instead). Each bar below is one request's time to first token, in parts:
# - **prefill**: until the prefill instance answered (it computed the prompt's KV cache, and LMCache began pushing
#   it as the prefill ended);
# - **KV transfer**: from that answer until LMCache reported the push landed (the router waits for it);
# - **wait**: the decode request's HTTP hop, scheduling, and LMCache loading the pushed KV into vLLM's cache;
# - **first decode step**: one step of this request (the median gap between its later tokens).
#
# Then the link changes under the running deployment (`tc qdisc change`, nothing restarts) and the same prompts
# go again.

# %%
from pdlab.load.prompts import PromptBuilder
from pdlab.metrics.kv import trace_request
from pdlab.report.figures import transfer_figure

builder = PromptBuilder(dep.model_dir)
traces = {}
for mbps in LINK_MBPS:
    if on_two_nodes:
        dep.netlab.set_rate(mbps)
    label = f"{mbps:g} Mbit/s" if on_two_nodes else "loopback (no link)"
    traces[label] = [await trace_request(dep, builder.prompt(tokens, key=f"notebook-03-{tokens}-{mbps}"),
                                         max_tokens=MAX_TOKENS)
                     for tokens in PROMPT_TOKENS]
transfer_figure(traces)

# %%
table = pd.DataFrame([{"link": label, "prompt tokens": t.prompt_tokens, "moved": f"{t.blocks} {t.unit}s",
                       "MB moved": t.bytes / 1e6, "MB by hand": t.blocks * t.block_tokens * by_hand / 1e6,
                       "transfer ms": t.transfer_s * 1e3, "Mbit/s in transfer": (t.throughput_mb_s or 0) * 8,
                       "prefill ms": t.prefill_s * 1e3, "wait ms": t.wait_s * 1e3}
                      for label, group in traces.items() for t in group])
table.round(2)

# %% [markdown]
# Two things to read. The bytes: LMCache stores and pushes whole 256-token chunks (its `chunk_size`), the last one
# partly filled, so the push is `chunks x 256 x bytes per token`, with your number from section 3 (NIXL moves
# vLLM's 128-token blocks the same way). The time: on the shaped link, moving the same
# bytes takes about as much longer as the link is slower, so the transfer's throughput column sits near the link's
# rate (UCX's TCP transport on two busy cores tops out around 1-2 Gbit/s, so a faster link stops mattering here).
# Compare the transfer with the prefill: on the slow link, for the longest prompt, which is larger?
#
# One exception, and it is what pushing buys: vLLM prefills a prompt longer than its step (2,048 tokens here) in
# several steps, and LMCache pushes each step's KV as soon as that step is done. The first part crosses the link
# while the rest is computed, so less is left after the prefill's answer, and such a prompt's "Mbit/s in transfer"
# comes out above the link's rate (the 4,000-token prompt of the full run). NIXL's pull starts only after the whole
# prefill has answered.
#
# ## 5. The same answer as one instance doing both phases
#
# Greedy decoding (temperature 0) with `ignore_eos` is deterministic: the decode instance asked to compute a new
# prompt itself must write the tokens the P/D path writes from the pushed KV. It is asked first, before anything of
# that prompt has been pushed to it. (Not the prefill instance: LMCache's sender expects every request to name a
# receiver, and a plain one would stop its engine; pdlab's router never sends it one.)

# %%
import httpx

request = {"model": dep.served_model, "prompt": builder.prompt(PROMPT_TOKENS[0], key="notebook-03-same"),
           "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
alone = httpx.post(f"{decode_url}/v1/completions", json=request, timeout=120).json()["choices"][0]["text"]
routed = httpx.post(f"{dep.router_url}/v1/completions", json=request, timeout=120)
via_pd = routed.json()["choices"][0]["text"]
print(f"the router's path: {routed.headers['x-pdlab-path']}\nP/D:   {via_pd!r}\nalone: {alone!r}")

# %%
dep.stop()  # the checks come after the stop: a failing check leaves nothing running

# %% [markdown]
# ## Check: does your measurement show the effect?

# %%
first, *_ = traces.values()
course.check(
    all(t.blocks and abs(t.bytes - t.blocks * t.block_tokens * by_hand) <= 0.02 * t.bytes for t in first),
    f"the KV bytes moved are the {first[0].unit}s x {first[0].block_tokens} tokens x your {by_hand:,} bytes per "
    f"token ({', '.join(f'{t.bytes / 1e6:,.2f} MB' for t in first)})",
    "check the sum in section 3 against the model's config",
)
course.check(routed.headers["x-pdlab-path"] == "disaggregated" and via_pd == alone,
             "the P/D path wrote exactly the tokens one instance writes on its own",
             "greedy decoding must be on (temperature 0) and both instances must serve the same model")
if on_two_nodes:
    longest = dict(zip(LINK_MBPS, (group[-1] for group in traces.values()), strict=True))
    fast, slow = longest[max(LINK_MBPS)], longest[min(LINK_MBPS)]
    ratio = max(LINK_MBPS) / min(LINK_MBPS)
    course.check(
        slow.transfer_s > fast.transfer_s * ratio / 3,
        f"a {ratio:g}x slower link made the {slow.prompt_tokens:,}-token prompt's KV transfer slower: "
        f"{fast.transfer_s * 1e3:,.0f} ms at {max(LINK_MBPS):g} Mbit/s, {slow.transfer_s * 1e3:,.0f} ms at "
        f"{min(LINK_MBPS):g} Mbit/s (want at least a third of the rate ratio)",
        "make the two LINK_MBPS values further apart, both below ~1,000 Mbit/s (above it UCX, not the link, limits)",
    )
else:
    print("not checked here: the link's effect (no root, so no shaped link; the deployment ran on loopback)")

# %% [markdown]
# ## Exercises
#
# 1. Set `LINK_MBPS` to a 10 GbE link scaled for this model: what does `netlab.shaped_rate(spec.link.model_copy(
#    update={"mbps": None, "preset": "10gbe"}), spec.model)` give? How long would a 4,000-token prompt's KV take
#    over it, by your bytes-per-token sum? Check it with one more trace.
# 2. Find the link rate at which the KV transfer of a 4,000-token prompt takes as long as its prefill. Below that
#    rate, what does disaggregation cost a long prompt's time to first token? (Notebook 06 weighs it against what
#    it saves.)
# 3. On the slowest link, send a short prompt (200 tokens) through `trace_request`. What dominates its time to
#    first token now?
# 4. A 70B model's KV takes 327,680 bytes per token in bf16 (80 layers x 2 x 8 KV heads x 128 dims x 2 bytes):
#    how many gigabytes is a 4,000-token prompt, and how long does it take on one 100 Gbit/s EFA adapter?
#    (p5 instances have 32 of them.)
# 5. Change `kind: lmcache` to `kind: nixl` in the spec and run the notebook again: vLLM's NixlConnector, as in
#    notebook 00, where the decode instance pulls the KV once it has the request (`trace_request` then makes
#    notebook 00's two calls by hand, and its wait part holds the pull's set-up). On an idle link, which parts
#    change? Under load, the pull waits for a busy prefill instance's next step: `data/results/hol-blocking/
#    20261205-231820` measured both connectors under the demo's load. How much sooner after the prefill's answer
#    did the long prompts' first token come with LMCache's push?
