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
# # 01 · Prefill vs decode: two different workloads
#
# **Learning objectives.** After this notebook you can
# - measure, on the local model, how prefill time grows with prompt length and how a decode step's time grows
#   with batch size and context length;
# - compute the FLOPs, bytes and *arithmetic intensity* (FLOP per byte) of each phase from the model's config;
# - read a roofline and say why prefill is compute-bound and decode is memory-bound;
# - say what changes on an H100 or H200, from their published figures.
#
# An LLM answers a request in two phases. **Prefill** reads the whole prompt in one forward pass and writes its
# KV cache. **Decode** then writes the answer one token per step, each step reading every weight *and* the whole
# KV cache to produce a single token per sequence. Both run the same weights; what differs is how much work each
# byte fetched from memory pays for. That difference is the reason to put the two phases on different machines.
#
# Everything runs with torch on one thread, like one vLLM CPU instance pinned to one core.

# %% tags=["parameters"]
from pdlab import course

MODEL = course.choose("pdlab-small", "pdlab-tiny")  # the local model to measure
PROMPT_LENGTHS = course.choose([4, 16, 64, 256, 1024, 2048], [4, 32, 256, 1024])  # prefill: prompt tokens
BATCHES = course.choose([1, 2, 4, 8, 16, 32], [1, 4, 16])  # decode: sequences per step
CONTEXTS = course.choose([128, 1024, 4096], [64, 512])  # decode: tokens already in each sequence's KV cache
REPEATS = course.choose(5, 3)  # timed runs per point (the fastest is kept: other work on the machine only adds time)

# %%
import pandas as pd

from pdlab.benchmarks import phases
from pdlab.model.catalog import load_catalog

model = phases.load_model(MODEL)
shape = phases.shape_of(model)
shape

# %% [markdown]
# ## 1. Prefill: time against prompt length
#
# One prompt at a time, a fresh KV cache each time, logits for the last token only (as a serving engine does).

# %%
prefill = phases.measure_prefill(model, PROMPT_LENGTHS, repeats=REPEATS)
pd.DataFrame(phases.records(prefill))[["tokens", "seconds", "tokens_per_s", "flops_per_s", "intensity"]]

# %%
phases.prefill_figure(prefill)

# %% [markdown]
# A 4-token prompt leaves the CPU mostly idle: the time goes to reading weights and to per-call overheads. Longer
# prompts reuse every weight fetched for many tokens, so throughput (tokens/s) rises. At long lengths attention's
# cost, which grows with the *square* of the prompt, starts to show.
#
# ## 2. Decode: step time against batch and context
#
# A cache is filled with `context` tokens per sequence, then one step adds one token to each of `batch`
# sequences. Every step reads all the weights once, whatever the batch: that is why batching decode is nearly free
# until the KV cache reads (which grow with batch x context) start to dominate.

# %%
decode = phases.measure_decode(model, BATCHES, CONTEXTS, repeats=REPEATS)
pd.DataFrame(phases.records(decode))[["batch", "context", "seconds", "tokens_per_s", "flops_per_s", "intensity"]]

# %%
phases.decode_figure(decode)

# %% [markdown]
# ## 3. Arithmetic intensity and the roofline
#
# Arithmetic intensity = FLOPs / bytes moved from memory. A processor with peak compute $P$ (FLOP/s) and memory
# bandwidth $B$ (bytes/s) can run a kernel of intensity $I$ at most at $\min(P,\ I \cdot B)$: the *roofline*.
# Below the ridge point $P/B$ a kernel waits on memory; above it, on arithmetic.
#
# The counting conventions are in `pdlab.model.shape` (matrix products at 2 FLOPs per multiply-add; weights, embedding
# rows and KV cache bytes). This CPU's roof is measured now: a float32 matrix multiplication for $P$ and a large
# array copy for $B$, both on one thread.

# %%
cpu = phases.measure_cpu_peaks(matmul_size=course.choose(1024, 512), copy_mib=course.choose(512, 128))
gpus = {name: load_catalog().hardware[name] for name in ("H100-SXM5-80GB", "H200-SXM-141GB")}
print(f"this CPU, 1 thread: {cpu.flops_per_s / 1e9:.1f} GFLOP/s, {cpu.bytes_per_s / 1e9:.1f} GB/s, "
      f"ridge point {cpu.ridge_point:.1f} FLOP/byte")
phases.roofline_figure(cpu, prefill, decode, devices=gpus)

# %% [markdown]
# Prefill points sit far to the right (hundreds of FLOPs per byte for long prompts); decode points sit at the left
# (about 0.5 FLOP/byte at batch 1 in float32: two FLOPs per 4-byte weight). Measured points fall below the roof:
# the gap is Python and framework overhead, which is large for a model this small.
#
# ## 4. What changes on a GPU
#
# The GPU figures come from `data/catalog/hardware.yaml` (NVIDIA's datasheets; each entry cites its source), the
# catalog the simulator uses too. The same model in bf16 halves the bytes per weight, so decode at batch 1 has an
# intensity of about 1 FLOP/byte.

# %%
bf16 = shape.with_dtype(2)
rows = []
for name, gpu in gpus.items():
    rows.append({
        "device": name,
        "peak bf16 TFLOP/s": gpu.peak_bf16_tflops,
        "HBM TB/s": gpu.hbm_gbps / 1e3,
        "ridge FLOP/byte": gpu.ridge_point,
        "decode intensity, batch 1": bf16.decode_intensity(1, 1024),
        "decode intensity, batch 64": bf16.decode_intensity(64, 1024),
        "prefill intensity, 2048 tokens": bf16.prefill_intensity(2048),
        "source": gpu.source.split(":")[0],
    })
pd.DataFrame(rows)

# %% [markdown]
# An H100's ridge point is near 300 FLOP/byte, an H200's near 200 (same compute, 43% more bandwidth). A decode step
# at batch 1 uses well under 1% of the GPU's arithmetic. Batching shares the weight reads across sequences, but each
# sequence still reads its own KV cache, and those reads grow with batch x context: even with grouped-query
# attention (GQA: several query heads share one key/value head, so the cache is several times smaller than the
# attention's heads would make it; notebook 03 counts it) decode stays at a few FLOP/byte, far left of the ridge.
# A long prefill is already past it. So the H200's extra bandwidth speeds up decode, not prefill; and a prefill
# running on the same accelerator as decode steps holds them up, which is what the next notebooks measure.
#
# ## Check: does your measurement show the effect?

# %%
shortest, longest = prefill[0], prefill[-1]
course.check(
    longest.tokens_per_s > 2 * shortest.tokens_per_s,
    f"prefill of {longest.tokens} tokens processes tokens faster per second than prefill of {shortest.tokens} "
    f"({longest.tokens_per_s:,.0f} vs {shortest.tokens_per_s:,.0f} tokens/s, want > 2x)",
    "re-run with nothing else busy on the machine (other notebooks, vLLM instances), or add longer PROMPT_LENGTHS",
)
context = CONTEXTS[0]
by_batch = sorted((s for s in decode if s.context == context), key=lambda s: s.batch)
course.check(
    by_batch[-1].tokens_per_s > 2 * by_batch[0].tokens_per_s,
    f"decoding {by_batch[-1].batch} sequences together yields more tokens/s than 1 at a time "
    f"({by_batch[-1].tokens_per_s:,.0f} vs {by_batch[0].tokens_per_s:,.0f} tokens/s at context {context}, want > 2x)",
    "re-run on a quieter machine, or add a larger batch to BATCHES",
)
course.check(
    shape.prefill_intensity(longest.tokens) > cpu.ridge_point > shape.decode_intensity(1, context),
    f"the longest prefill ({shape.prefill_intensity(longest.tokens):.0f} FLOP/B) is right of this CPU's ridge "
    f"({cpu.ridge_point:.1f} FLOP/B) and a batch-1 decode step ({shape.decode_intensity(1, context):.2f} FLOP/B) "
    "is left of it",
    "add a longer prompt to PROMPT_LENGTHS; if the ridge point looks wrong, re-run the CPU peak cell",
)

# %% [markdown]
# ## Exercises
#
# 1. Switch `MODEL` between `"pdlab-tiny"` and `"pdlab-small"` (about 7x the parameters). Which phase slows down
#    more, and why?
# 2. Find the batch size at which a decode step at context 128 costs twice a batch-1 step. Compare it with the batch
#    at which `shape.decode_intensity(batch, 128)` reaches this CPU's ridge point.
# 3. Increase `CONTEXTS` to 8192 with a batch of 16. What share of the decode step's bytes is now KV cache rather
#    than weights (`shape.kv_bytes_per_token()`, `shape.weight_bytes`)? What does that mean for long-context serving?
# 4. Using `bf16.decode_intensity`, how large must a decode batch be to reach an H200's ridge point at context 1024?
#    Is that batch realistic for the KV cache memory an H200 has (`gpu.memory_gib`) with a 7B model?
