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
# Reference answers to notebook 03 (two nodes, the KV cache across a link). Each answer runs after the notebook, in
# its kernel, with the deployment already stopped: the answers work from the notebook's own `traces`, your
# bytes-per-token sum `by_hand`, pdlab's link presets and the catalog. For the one new transfer it needs, exercise 1
# moves the bytes across a fresh shaped link with `pdlab.netlab`'s check, without a vLLM instance; like the
# two-node layout, that needs root.

# %% [markdown]
# ## Exercise 1
# The 10gbe preset scales a real 10 Gbit/s link by this model's KV bytes per token over a 70B model's, so that one
# token of context takes as long to cross the shaped link as a 70B token takes on real 10 GbE: the cell asserts
# exactly that. A 4,000-token prompt moves 16 whole LMCache chunks (4,096 tokens' worth; NIXL's 32 blocks of 128
# come to the same), so its transfer should take chunks x 256 x bytes per token x 8 / rate, just over a second on
# either local model, as for a 70B prompt on real
# 10 GbE. The check moves exactly those bytes across a link shaped to that rate and lands close to the prediction,
# never below it (a shaped link cannot beat its rate). It sends them over plain TCP, the link itself; `how="nixl"`
# moves them with a NIXL READ as vLLM does, a few seconds slower to set up. The notebook's own traces, LMCache's
# pushes, agree at both of its rates for prompts prefilled in one step (up to 2,048 tokens): their transfer times are
# the bytes over the link's rate. A longer prompt's push begins during its prefill, so less of it is left after the
# prefill's answer (section 4).

# %%
import math

from pdlab.model.catalog import load_catalog
from pdlab.netlab.check import check

ten_gbe = netlab.shaped_rate(spec.link.model_copy(update={"mbps": None, "preset": "10gbe"}), spec.model)
seventy_b = load_catalog().models["Llama-3.1-70B"].kv_bytes_per_token(2)
print(ten_gbe)
assert not ten_gbe.capped and math.isclose(ten_gbe.mbps, 10_000 * by_hand / seventy_b)
assert math.isclose(by_hand * 8 / (ten_gbe.mbps * 1e6), seventy_b * 8 / 10e9)  # per token: same time as a 70B on 10 GbE

kv_bytes = math.ceil(4000 / 256) * 256 * by_hand
predicted_s = kv_bytes * 8 / (ten_gbe.mbps * 1e6)
assert math.isclose(predicted_s, 4096 * seventy_b * 8 / 10e9)  # = 4,096 tokens of a 70B over real 10 GbE
print(f"a 4,000-token prompt: {kv_bytes / 1e6:.2f} MB, predicted {predicted_s * 1e3:,.0f} ms at "
      f"{ten_gbe.mbps:g} Mbit/s")
if netlab.unavailable_reason() is None:
    moved = check(spec.link.model_copy(update={"mbps": ten_gbe.mbps}), kv_bytes)
    print(f"measured across a fresh link: {moved['seconds'] * 1e3:,.0f} ms ({moved['measured_mbps']:.0f} "
          f"Mbit/s)")
    assert moved["bytes"] == kv_bytes and moved["seconds"] > 0.9 * predicted_s
    assert not any(moved["leftovers"].values()), "the check removes its namespaces and link"
else:
    print(f"no new transfer here: {netlab.unavailable_reason()}")
for label, group in traces.items():
    for t in group:
        print(f"{label:>18}, {t.prompt_tokens:,} tokens: transfer {t.transfer_s * 1e3:,.0f} ms" + (
            f", bytes / rate {t.bytes * 8 / (float(label.split()[0]) * 1e6) * 1e3:,.0f} ms" if on_two_nodes else ""))

# %% [markdown]
# ## Exercise 2
# Both the prefill and the transfer grow with the prompt, so the break-even is a rate: the prompt's KV bytes over its
# prefill time. The cell computes it from the longest prompt the notebook traced (the 4,000-token one in the full
# run, a shorter one in quick mode). Below that rate the transfer alone takes longer than the whole prefill, so
# sending a long prompt through prefill -> decode roughly doubles its time to first token at the break-even rate,
# compared with serving it where it was prefilled, and the penalty grows as 1 / rate below it: the table shows
# both of the notebook's links. Notebook 06 weighs that cost against what disaggregation saves the other requests.

# %%
first_label, slow_label = list(traces)[0], list(traces)[-1]
longest = max(traces[first_label], key=lambda t: t.prompt_tokens)
break_even_mbps = longest.bytes * 8 / longest.prefill_s / 1e6
print(f"{longest.prompt_tokens:,}-token prompt: {longest.bytes / 1e6:.2f} MB of KV, prefill "
      f"{longest.prefill_s * 1e3:,.0f} ms -> transfer = prefill at {break_even_mbps:,.0f} Mbit/s")
pd.DataFrame([{"link": label, "prompt tokens": t.prompt_tokens, "prefill ms": t.prefill_s * 1e3,
               "transfer ms": t.transfer_s * 1e3,
               "TTFT via P/D ms": (t.prefill_s + t.wait_s + t.transfer_s + t.step_s) * 1e3,
               "x prefill + one step": (t.prefill_s + t.wait_s + t.transfer_s + t.step_s) / (t.prefill_s + t.step_s)}
              for label in dict.fromkeys((first_label, slow_label)) for t in traces[label]]).round(1)

# %% [markdown]
# ## Exercise 3
# The KV transfer still dominates. A 200-token prompt pushes 1 whole chunk (256 tokens' worth; with NIXL, 2 blocks
# of 128), taking on the slow link what each of the traced prompts' chunks took there, while its prefill shrinks
# with its length (the cell
# scales both from the shortest traced prompt; a prefill's fixed costs make the real one somewhat longer than that
# scaling). The wait and the decode step are small beside them. A short prompt does not escape a slow link: its
# prefill and its transfer shrink together, so their ratio is set by the link's rate (whole blocks even tilt it
# towards the transfer). What it can escape is the link altogether: a 200-token prefill is cheap enough to run on
# the decode instance, which is why the router sends short prompts there directly (notebook 04's threshold).

# %%
ref = min(traces[slow_label], key=lambda t: t.prompt_tokens)  # the shortest prompt traced on the slow link
short_blocks = math.ceil(200 / ref.block_tokens)
parts_ms = {f"prefill (the {ref.prompt_tokens:,}-token prompt's, x 200 / {ref.prompt_tokens:,})":
            ref.prefill_s * 200 / ref.prompt_tokens * 1e3,
            "wait": ref.wait_s * 1e3,
            f"KV transfer ({short_blocks} of its {ref.blocks} {ref.unit}s)":
            ref.transfer_s * short_blocks / ref.blocks * 1e3,
            "first decode step": ref.step_s * 1e3}
print(f"a 200-token prompt on the {slow_label} link, scaled from this run's traces:")
for part, ms in parts_ms.items():
    print(f"  {part:52} {ms:8,.1f} ms")
if on_two_nodes:  # the shaped link bounds a chunk's time from below: 256 tokens x bytes per token / rate
    assert ref.transfer_s / ref.blocks > 0.9 * ref.block_tokens * by_hand * 8 / (min(LINK_MBPS) * 1e6)

# %% [markdown]
# ## Exercise 4
# 4,000 x 327,680 bytes is about 1.3 GB. One 100 Gbit/s EFA adapter moves it in about a tenth of a second at line
# rate, longer at the 80% efficiency the catalog assumes
# <!-- cite data/catalog/links.yaml: -, -, -, -, "efa-p5".efficiency * 100 -->.
# A p5.48xlarge has 32 adapters for its 8 GPUs, four per GPU: with the model split over 8 GPUs each GPU holds an
# eighth of the KV heads and sends its share over its own four adapters, so the whole cache crosses in a few
# milliseconds. That is why P/D on EFA costs a long prompt little, while the same cache over 10 GbE (exercise 1's
# preset) takes about a second.

# %%
seventy_b_shape = load_catalog().models["Llama-3.1-70B"]
per_token = seventy_b_shape.num_layers * 2 * seventy_b_shape.num_kv_heads * seventy_b_shape.head_dim * 2
prompt_bytes = 4000 * per_token
one_adapter_s = prompt_bytes * 8 / 100e9
p5 = netlab.real_link("efa-p5")  # the node's whole EFA bandwidth
all_adapters_s = prompt_bytes * 8 / (p5.gbps * 1e9)
print(f"{per_token:,} bytes per token x 4,000 = {prompt_bytes / 1e9:.2f} GB: {one_adapter_s * 1e3:,.0f} ms on one "
      f"100 Gbit/s adapter, {all_adapters_s * 1e3:.1f} ms on {p5.description}")
assert per_token == seventy_b == 327_680 and p5.gbps == 32 * 100

# %% [markdown]
# ## Exercise 5
# On an idle link the two come out close for prompts prefilled in one step: the same bytes (NIXL counts vLLM's
# 128-token blocks, LMCache its 256-token chunks: the same 4,096 tokens' worth for a 4,000-token prompt) cross at
# the link's rate, and the pull's set-up adds little to the wait. What differs is when the move starts. LMCache
# pushes each prefill step's KV as soon as the step is done, so a longer prompt's push is partly over when the
# prefill answers; NixlConnector's read starts only once the decode instance has the request. Under load the
# difference grows: a pull is served by the prefill instance between its steps, so it waits while that instance
# computes other prompts; a push leaves right after the prompt's own prefill step. The demo lab's recorded run of both connectors under the same load shows it (the cell
# reads it): the long prompts' first token came a median of 385 ms after the prefill's answer with NIXL's pull,
# 53 ms with LMCache's push
# <!-- cite data/results/hol-blocking/20261205-231820/summary.json: -, -, -, -, scenarios.disaggregated.by_path.disaggregated.after_prefill_ms.p50, scenarios.disaggregated_lmcache.by_path.disaggregated.after_prefill_ms.p50 -->.

# %%
import json

from pdlab.settings import data_dir

recorded = json.loads((data_dir() / "results/hol-blocking/20261205-231820/summary.json").read_text())
after = {name: recorded["scenarios"][name]["by_path"]["disaggregated"]["after_prefill_ms"]
         for name in ("disaggregated", "disaggregated_lmcache")}
assert after["disaggregated_lmcache"]["p50"] < after["disaggregated"]["p50"]
pd.DataFrame({"NIXL (pull)": after["disaggregated"], "LMCache (push)": after["disaggregated_lmcache"]}).loc[
    ["count", "p50", "p90", "p99"]].round(1)
