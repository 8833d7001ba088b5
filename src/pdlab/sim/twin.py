"""A cluster lab's simulated twin: the sim spec fields its `deployment` and `cluster:` section already say.

A sim spec with `cluster_lab: ../hyperpod-llama70b-2p2d.yaml` simulates that deployment as `pdlab cluster render`
would deploy it: the instance type's GPU and EFA (`pdlab.config.cluster.INSTANCE_TYPES`), the model's catalog
shape (found by its Hugging Face id), one instance per replica, each pool's tensor parallelism, GPU memory share
and engine options, and the router's settings. What the spec gives itself (the workload, SLOs, a what-if link or
rate) wins over what the lab says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdlab.config.base import ConfigError, load_yaml, read_yaml, validate
from pdlab.config.cluster import INSTANCE_TYPES, PoolSpec
from pdlab.config.lab import LabSpec
from pdlab.config.sim import LinkChoice, SimSpec, router_settings
from pdlab.model.catalog import Catalog, load_catalog

NO_EFA_LINK = "tcp-100gbe"
"""What KV transfers cross when a pool has no EFA interfaces: the node's ENA network, over TCP."""


def cluster_fields(lab: LabSpec, catalog: Catalog | None = None, source: str = "cluster_lab") -> dict[str, Any]:
    """Sim spec fields (plain data) for `lab`'s cluster deployment."""
    if lab.cluster is None or lab.deployment is None:
        raise ConfigError(source, [("cluster", f"lab {lab.name!r} has no `cluster:` section and `deployment` to "
                                               "simulate (see labs/hyperpod-*.yaml)")])
    catalog = catalog or load_catalog()
    cluster, deployment = lab.cluster, lab.deployment
    facts = INSTANCE_TYPES[cluster.instance_type]  # the cluster spec has checked the name
    try:
        model = catalog.model_named(deployment.model.name)
    except ConfigError as error:
        raise ConfigError(source, [("deployment.model.name", problem) for _, problem in error.problems]) from None

    def engine(role: str, pool: PoolSpec) -> dict[str, Any]:
        options = deployment.by_role(role)[0].engine
        given = {"max_num_batched_tokens": options.max_num_batched_tokens, "max_num_seqs": options.max_num_seqs,
                 "block_size": options.block_size}
        return {"tensor_parallel": pool.tp, "gpu_memory_utilization": pool.gpu_memory_utilization,
                "enable_prefix_caching": options.enable_prefix_caching,
                **{name: value for name, value in given.items() if value is not None}}

    ranks = min(cluster.prefill.tp, cluster.decode.tp)
    interfaces = min(cluster.prefill.efa_interfaces, cluster.decode.efa_interfaces)
    if interfaces:
        # The catalog's EFA figure is the node's divided by its GPUs; a replica gets its interfaces' share of the
        # node's, which the simulator splits over the ranks that send side by side (it multiplies them back).
        efa = catalog.get("links", facts.efa_link)
        node_gbps = efa.bandwidth_gbps * facts.gpus
        link = {"name": facts.efa_link, "bandwidth_gbps": node_gbps * interfaces / facts.efa_interfaces / ranks}
    else:
        link = {"name": NO_EFA_LINK}
    return {
        "name": lab.name,
        "hardware": facts.accelerator,
        "model": model,
        "dtype_bytes": 4 if deployment.model.dtype == "float32" else 2,
        "link": link,
        "pools": {"prefill": cluster.prefill.replicas, "decode": cluster.decode.replicas},
        "engine": engine("decode", cluster.decode),
        "prefill_engine": engine("prefill", cluster.prefill),
        "router": router_settings(deployment).model_dump(),
    }


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`base` with `override`'s values, tables merged key by key (a spec's `link: {concurrency: 4}` keeps the lab's
    EFA); naming another link drops the lab's figures for its own (`LinkChoice.named`)."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            table = out[key]
            if key == "link" and "name" in value:
                table = LinkChoice.model_validate(table).named(value["name"]).model_dump(exclude_none=True)
            out[key] = merged(table, value)
        else:
            out[key] = value
    return out


def load_sim_spec(path: Path, catalog: Catalog | None = None) -> SimSpec:
    """A sim spec from YAML; with `cluster_lab`, the lab's twin under the spec's own fields."""
    raw = read_yaml(path)
    lab_path = raw.get("cluster_lab") if isinstance(raw, dict) else None
    if lab_path is None:
        return validate(SimSpec, raw, source=str(path))
    lab_file = (path.parent / str(lab_path)).resolve()
    if not lab_file.exists():
        raise ConfigError(str(path), [("cluster_lab", f"no such file: {lab_file}")])
    lab = load_yaml(lab_file, LabSpec)
    fields = cluster_fields(lab, catalog, source=f"{path}: cluster_lab {lab_file}")
    return validate(SimSpec, merged(fields, {**raw, "cluster_lab": str(lab_file)}), source=str(path))

