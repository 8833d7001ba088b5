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
# # 03 · Two nodes: prefill here, decode there, the KV cache across a link
#
# **Learning objectives.** After this notebook you can
# - write a two-node P/D deployment: prefill and decode each in its own network namespace with its own address,
#   joined by a link whose bandwidth you set;
# - compute a model's KV bytes per token by hand and match it with the bytes NIXL moved;
# - read one request's time to first token in parts: prefill, wait, KV transfer, first decode step;
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

# %% tags=["parameters"]
from pdlab import course

MODEL = course.choose("pdlab-small", "pdlab-tiny")  # the served model
PROMPT_TOKENS = course.choose([1000, 4000], [1000, 2000])  # prompts to follow through prefill -> decode
LINK_MBPS = course.choose([1000, 100], [400, 40])  # the link's rate (Mbit/s): first as started, then changed live
MAX_TOKENS = course.choose(16, 8)  # tokens each request writes

# %% [markdown]
# ## 1. The spec, on two nodes
#
# Notebook 00's spec with three additions: `nodes` (one namespace each), `node:` on each instance, and `link`
# (its rate; `preset: 10gbe` instead would scale a real 10 GbE link to this model's KV size, see `docs/netlab.md`).
# `ucx_tls: "tcp,self"` leaves out UCX's shared-memory transports: namespaces share this machine's memory, and
# UCX would otherwise move the cache through it and never touch the link. `fallback_to_loopback: true` is what
# lets the notebook run without root.

# %%
SPEC = f"""
name: my-two-nodes
deployment:
  name: my-two-nodes
  model:
    name: {MODEL}
  connector:
    kind: nixl
    nixl_backends: [UCX]
    ucx_tls: "tcp,self"
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
rows[rows["name"].isin(["ip", "--host", "VLLM_NIXL_SIDE_CHANNEL_HOST", "UCX_TLS", "UCX_NET_DEVICES"])]

# %% [markdown]
# The decode instance's command now starts with `ip netns exec <namespace>`, binds its node's address, and tells
# UCX to send on the node's one interface (`pdlab0`). Everything else is notebook 00's command.
#
# ## 2. Bring it up
#
# Making the namespaces and the link takes a second; the instances take their usual half minute or so (notebook 00).

# %%
dep = course.start(spec)
on_two_nodes = dep.netlab is not None  # False without root: two loopback addresses, no shaped link
prefill_url, decode_url = dep.urls("prefill")[0], dep.urls("decode")[0]
print(f"prefill {prefill_url}, decode {decode_url}")
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
print(f"pdlab's figure: {shape.kv_bytes_per_token():,}; a 128-token block: {128 * by_hand / 1e6:.2f} MB")

# %% [markdown]
# ## 4. Follow requests across the link
#
# `trace_pd_request` makes notebook 00's two calls (prefill with `max_tokens=1`, then decode with the
# `kv_transfer_params`), streams the answer, and reads the decode instance's NIXL counters before and after. Each
# bar below is one request's time to first token, laid end to end:
# - **prefill**: call 1, until the prefill instance answered (it computed the prompt's KV cache);
# - **wait**: the start of call 2 until its KV read begins and after it ends: the HTTP hop, scheduling, posting the
#   read (and, when the prefill instance is busy computing, waiting until it serves the read: notebook 06);
# - **KV transfer**: the read itself, as vLLM timed it on the decode instance;
# - **first decode step**: one step of this request (the median gap between its later tokens).
#
# Then the link changes under the running deployment (`tc qdisc change`, nothing restarts) and the same prompts
# go again.

# %%
from pdlab.load.prompts import PromptBuilder
from pdlab.metrics.kv import trace_pd_request
from pdlab.report.figures import transfer_figure

builder = PromptBuilder(dep.model_dir)
traces = {}
for mbps in LINK_MBPS:
    if on_two_nodes:
        dep.netlab.set_rate(mbps)
    label = f"{mbps:g} Mbit/s" if on_two_nodes else "loopback (no link)"
    traces[label] = [await trace_pd_request(prefill_url, decode_url, dep.served_model,
                                            builder.prompt(tokens, key=f"notebook-03-{tokens}-{mbps}"),
                                            max_tokens=MAX_TOKENS)
                     for tokens in PROMPT_TOKENS]
transfer_figure(traces)

# %%
table = pd.DataFrame([{"link": label, "prompt tokens": t.prompt_tokens, "blocks": t.blocks,
                       "MB moved": t.bytes / 1e6, "MB by hand": t.blocks * 128 * by_hand / 1e6,
                       "transfer ms": t.transfer_s * 1e3, "Mbit/s in transfer": (t.throughput_mb_s or 0) * 8,
                       "prefill ms": t.prefill_s * 1e3, "wait ms": t.wait_s * 1e3}
                      for label, group in traces.items() for t in group])
table.round(2)

# %% [markdown]
# Two things to read. The bytes: vLLM moves whole 128-token blocks, the last one partly filled, so the transfer is
# `blocks x 128 x bytes per token`, with your number from section 3. The time: on the shaped link, moving the same
# bytes takes about as much longer as the link is slower, so the transfer's throughput column sits near the link's
# rate (UCX's TCP transport on two busy cores tops out around 1-2 Gbit/s, so a faster link stops mattering here).
# Compare the transfer with the prefill: on the slow link, for the longest prompt, which is larger?
#
# ## 5. The same answer as one instance doing both phases
#
# Greedy decoding (temperature 0) with `ignore_eos` is deterministic: the prefill instance asked for the whole
# answer itself must write the tokens the P/D path wrote.

# %%
import httpx

from pdlab.pdrequest import pd_completion_async

prompt = builder.prompt(PROMPT_TOKENS[0], key="notebook-03-same")
via_pd = await pd_completion_async(prefill_url, decode_url, dep.served_model, prompt, max_tokens=MAX_TOKENS,
                                   stream=False)
alone = httpx.post(f"{prefill_url}/v1/completions", timeout=120, json={
    "model": dep.served_model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
    "ignore_eos": True}).json()["choices"][0]["text"]
print(f"P/D:   {via_pd.text!r}\nalone: {alone!r}")

# %%
dep.stop()  # the checks come after the stop: a failing check leaves nothing running

# %% [markdown]
# ## Check: does your measurement show the effect?

# %%
first, *_ = traces.values()
course.check(
    all(t.blocks and abs(t.bytes - t.blocks * 128 * by_hand) <= 0.02 * t.bytes for t in first),
    f"the KV bytes moved are the handed-over blocks x 128 tokens x your {by_hand:,} bytes per token "
    f"({', '.join(f'{t.bytes / 1e6:,.2f} MB' for t in first)})",
    "check the sum in section 3 against the model's config; PROMPT_TOKENS must be longer than one block (128)",
)
course.check(via_pd.text == alone, "the P/D path wrote exactly the tokens one instance writes on its own",
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
# 3. On the slowest link, send a short prompt (200 tokens) through `trace_pd_request`. What dominates its time to
#    first token now?
# 4. A 70B model's KV takes 327,680 bytes per token in bf16 (80 layers x 2 x 8 KV heads x 128 dims x 2 bytes):
#    how many gigabytes is a 4,000-token prompt, and how long does it take on one 100 Gbit/s EFA adapter?
#    (p5 instances have 32 of them.)
