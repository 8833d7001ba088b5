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
# Reference answers to notebook 01 (prefill vs decode). Each answer runs after the notebook, in its kernel: it uses
# `model`, `shape`, `prefill`, `decode`, `cpu`, `gpus` and `bf16` from the cells above.

# %% [markdown]
# ## Exercise 1
# By their shapes the two models differ by about 7x in parameters (the cell prints the ratios), and so, to within
# a few percent, in both a prefill's FLOPs and a decode step's bytes: on the roofline both phases have about 7x more
# work. Measured, prefill slows down by nearly that much, because a long prompt keeps the core busy with arithmetic
# (compute-bound: time follows FLOPs). A batch-1 decode step slows down less: at this size a good part of its time
# is fixed per-layer cost (Python, kernel launches), and the layer count only doubles (4 to 8). On a real model the
# weights dominate and decode time follows the weight bytes instead.

# %%
other_name = "pdlab-small" if MODEL == "pdlab-tiny" else "pdlab-tiny"
pair = {MODEL: model, other_name: phases.load_model(other_name)}
tiny, small = pair["pdlab-tiny"], pair["pdlab-small"]
tiny_shape, small_shape = phases.shape_of(tiny), phases.shape_of(small)
params_x = small_shape.params / tiny_shape.params
flops_x = small_shape.prefill_flops(256) / tiny_shape.prefill_flops(256)
bytes_x = small_shape.decode_bytes(1, CONTEXTS[0]) / tiny_shape.decode_bytes(1, CONTEXTS[0])
print(f"pdlab-small / pdlab-tiny: {params_x:.1f}x parameters, {flops_x:.1f}x prefill FLOPs (256 tokens), "
      f"{bytes_x:.1f}x decode bytes (batch 1), {small_shape.num_layers / tiny_shape.num_layers:g}x layers")
assert 6 < params_x < 8 and abs(flops_x / params_x - 1) < 0.15 and abs(bytes_x / params_x - 1) < 0.15

seconds = {name: (phases.measure_prefill(m, [256], repeats=REPEATS)[0].seconds,
                  phases.measure_decode(m, [1], [CONTEXTS[0]], repeats=REPEATS)[0].seconds)
           for name, m in (("tiny", tiny), ("small", small))}
print(f"measured: prefill of 256 tokens {seconds['small'][0] / seconds['tiny'][0]:.1f}x slower, "
      f"a batch-1 decode step at context {CONTEXTS[0]} {seconds['small'][1] / seconds['tiny'][1]:.1f}x slower")

# %% [markdown]
# ## Exercise 2
# The measured step time stays nearly flat for the first few sequences (every step reads all the weights once,
# whatever the batch) and then climbs; the batch at which it doubles and the batch at which the step's arithmetic
# intensity reaches this CPU's ridge point come out close together, a few to a few tens of sequences. That is the
# roofline's prediction: below the ridge extra sequences ride on weight reads that happen anyway, above it they cost
# arithmetic. Overheads and whatever else runs on the machine blur the match on a model this small, so the
# crossover is a range, not a number; run the cell twice and the measured batch may move.
#
# In the recorded full run on pdlab-small the step took 20.2 ms at batch 1 and 45.7 ms at batch 16, and the CPU's
# ridge point was 3.1 FLOP/byte
# <!-- cite data/results/phases-pdlab-small-20261130T132758.json: decode.0.seconds * 1000, -,
# decode.4.seconds * 1000, -, cpu_peaks.ridge_point -->,
# which the step's intensity passes between batch 4 and 8.

# %%
at_128 = phases.measure_decode(model, [1, 2, 4, 8, 16, 32, 64], [128], repeats=REPEATS)
one = at_128[0].seconds
doubled = next((s.batch for s in at_128 if s.seconds >= 2 * one), None)
intensity = [shape.decode_intensity(s.batch, 128) for s in at_128]
assert all(a < b for a, b in zip(intensity, intensity[1:], strict=False)), "intensity grows with the batch"
to_ridge = next((b for b in range(1, 4097) if shape.decode_intensity(b, 128) >= cpu.ridge_point), None)
print(pd.DataFrame({"batch": [s.batch for s in at_128], "step ms": [s.seconds * 1e3 for s in at_128],
                    "x batch 1": [s.seconds / one for s in at_128], "FLOP/byte": intensity}).round(2))
print(f"step time doubles at batch {doubled}; intensity reaches the ridge ({cpu.ridge_point:.1f} FLOP/B) at "
      f"batch {to_ridge}")

# %% [markdown]
# ## Exercise 3
# At 8,192 tokens of context and a batch of 16, the KV cache is over 90% of the bytes a decode step reads: each
# sequence reads its own cache, while the weights are read once for the whole batch. Batching no longer shares the
# dominant cost, so each added sequence adds step time. Long-context serving is limited by KV bandwidth and KV
# memory, not by the weights: that is what GQA, KV quantization and a decode tier sized for KV memory address.
#
# The measured step shows it: at long context 16 sequences take many times one sequence's step. In the recorded
# full run on pdlab-small one sequence took 16.4 ms a step and 16 took 1,277.5 ms
# <!-- cite data/results/phases-pdlab-small-20261130T132758.json: -, decode.12.seconds * 1000, -,
# decode.16.seconds * 1000 -->
# at context 4,096: fewer tokens per second than one sequence alone.

# %%
batch, context = 16, 8192
kv_read = batch * (context + 1) * shape.kv_bytes_per_token()
share = kv_read / shape.decode_bytes(batch, context)
print(f"batch {batch} at context {context}: KV {kv_read / 1e6:,.0f} MB against weights "
      f"{shape.weight_bytes / 1e6:,.1f} MB: {share:.1%} of the step's bytes is KV cache")
assert share > 0.9 and kv_read > 10 * shape.weight_bytes

long_steps = phases.measure_decode(model, [1, batch], [4096], repeats=REPEATS)
for s in long_steps:
    print(f"measured at context 4096, batch {s.batch:2}: {s.seconds * 1e3:7.1f} ms a step, "
          f"{s.tokens_per_s:,.0f} tokens/s")

# %% [markdown]
# ## Exercise 4
# The local model never gets there: however large the batch, its intensity at context 1,024 levels off at a few
# FLOP/byte, because each added sequence brings its own KV reads along with its FLOPs. A 7B model fares better only
# thanks to GQA: Qwen2.5-7B (4 KV heads) reaches the H200's ridge at a batch of about 1,200 sequences, and their
# KV cache does fit beside the weights in the H200's 141 GiB
# <!-- cite data/catalog/hardware.yaml: -, -, -, "H200-SXM-141GB".memory_gib -->
# at 1,024 tokens each. At 8,192 tokens its intensity levels off below the ridge, and Llama-3.1-8B (8 KV heads)
# never reaches it even at 1,024. So decode on an H200 stays memory-bound in practice: only a thousand-odd
# concurrent short requests would make it compute-bound, and longer contexts never do.

# %%
import math

h200 = gpus["H200-SXM-141GB"]
ridge = h200.ridge_point
print(f"local model in bf16: {bf16.decode_intensity(10**9, 1024):.1f} FLOP/B at a batch of a billion; "
      f"the H200's ridge is {ridge:.0f}")
assert bf16.decode_intensity(10**9, 1024) < ridge

catalog = load_catalog()
needed = {}
for name, context in (("Qwen2.5-7B", 1024), ("Qwen2.5-7B", 8192), ("Llama-3.1-8B", 1024)):
    big = catalog.models[name].with_dtype(2)
    per_seq_flops = big.decode_flops(1, context)
    per_seq_bytes = big.decode_bytes(2, context) - big.decode_bytes(1, context)
    if per_seq_flops <= ridge * per_seq_bytes:  # intensity -> per_seq_flops / per_seq_bytes as the batch grows
        needed[name, context] = None
        print(f"{name} at context {context}: never reaches the ridge (at most {per_seq_flops / per_seq_bytes:.0f})")
        continue
    batch = needed[name, context] = math.ceil(ridge * big.weight_bytes / (per_seq_flops - ridge * per_seq_bytes))
    assert big.decode_intensity(batch, context) >= ridge > big.decode_intensity(batch - 1, context)
    kv_gib = batch * context * big.kv_bytes_per_token() / 2**30
    assert kv_gib + big.weight_bytes / 2**30 < h200.memory_gib
    print(f"{name} at context {context}: batch {batch:,}, KV cache {kv_gib:,.0f} GiB + weights "
          f"{big.weight_bytes / 2**30:.0f} GiB, against {h200.memory_gib:g} GiB on an H200")
assert 1_000 < needed["Qwen2.5-7B", 1024] < 1_400
assert needed["Qwen2.5-7B", 8192] is None and needed["Llama-3.1-8B", 1024] is None
