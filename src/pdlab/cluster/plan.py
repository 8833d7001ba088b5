"""A cluster plan: a lab spec checked for the cluster tier and resolved into per-role facts (vLLM arguments,
environment, LMCache config, resources) that every render target shares, so HyperPod, Kubernetes and the host
scripts can only differ in packaging, never in what vLLM and LMCache are told."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pdlab.config import ConfigError, DeploymentSpec, EngineOptions, LabSpec, load_lab
from pdlab.config.cluster import ClusterSpec, PoolSpec
from pdlab.config.router import LMCacheReceiverPorts, RouterUpstreams, Strategy
from pdlab.lmcache import settings as lmcache_settings
from pdlab.router.process import router_command

#: The router's command in a cluster image (pdlab installed).
CLUSTER_ROUTER_PROGRAM = ("pdlab", "router", "serve")

PoolRole = Literal["prefill", "decode"]
ROLES: tuple[PoolRole, PoolRole] = ("prefill", "decode")

#: HyperPod's intelligentRoutingSpec.routingStrategy for each pdlab strategy; None: HyperPod has no equivalent.
HYPERPOD_STRATEGY: dict[Strategy, str | None] = {
    "roundrobin": "roundrobin",
    "session": "session",
    "prefixaware": "prefixaware",
    "kvaware": "kvaware",
    "leastloaded": None,
}

#: Where rendered LMCache configs are mounted in the vLLM containers.
LMCACHE_CONFIG_DIR = "/etc/lmcache"
#: Where HyperPod's operator puts the model (its modelVolumeMount default).
HYPERPOD_MODEL_DIR = "/opt/ml/model"

#: Environment EFA needs on every vLLM replica: libfabric's EFA provider carries NIXL's LIBFABRIC backend.
EFA_ENV: dict[str, str] = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
}
#: What LMCache needs in every process (PYTHONHASHSEED: equal prefix hashes across processes), as locally.
COMMON_ENV: dict[str, str] = dict(lmcache_settings.LMCACHE_ENV)


@dataclass(frozen=True)
class RolePlan:
    """Everything one pool's replicas are told."""

    role: PoolRole
    name: str
    """Object name (`<endpoint>-prefill`)."""
    pool: PoolSpec
    engine: EngineOptions
    kv_transfer_config: dict[str, Any]
    lmcache: dict[str, Any]
    """This role's LMCache config (written as YAML, read via LMCACHE_CONFIG_FILE)."""
    env: dict[str, str]
    port: int

    @property
    def lmcache_file(self) -> str:
        return f"lmcache-{self.role}.yaml"

    @property
    def resources(self) -> dict[str, dict[str, str]]:
        """Kubernetes resource requests and limits of one replica (extended resources need equal limits)."""
        requests = {"cpu": self.pool.cpu, "memory": self.pool.memory, "nvidia.com/gpu": str(self.pool.gpus)}
        limits = {"nvidia.com/gpu": str(self.pool.gpus)}
        if self.pool.efa_interfaces:
            requests["vpc.amazonaws.com/efa"] = limits["vpc.amazonaws.com/efa"] = str(self.pool.efa_interfaces)
        return {"requests": requests, "limits": limits}

    def vllm_args(self, model: str) -> list[str]:
        """Arguments after `vllm serve`: the model, then the role's flags."""
        return [model, *self.role_args]

    @property
    def engine_args(self) -> list[str]:
        """The role's engine flags (parallelism, memory, the lab's engine options)."""
        args = ["--tensor-parallel-size", str(self.pool.tp),
                "--gpu-memory-utilization", str(self.pool.gpu_memory_utilization)]
        return args + engine_flags(self.engine)

    @property
    def role_args(self) -> list[str]:
        """The flags this role adds to `vllm serve MODEL`: engine flags, then the KV connector."""
        return [*self.engine_args, "--kv-transfer-config", json.dumps(self.kv_transfer_config, separators=(",", ":"))]


@dataclass(frozen=True)
class ClusterPlan:
    """A checked cluster lab, resolved for rendering."""

    lab: LabSpec
    deployment: DeploymentSpec
    cluster: ClusterSpec
    prefill: RolePlan
    decode: RolePlan

    @property
    def model(self) -> str:
        return self.deployment.model.name

    @property
    def roles(self) -> tuple[RolePlan, RolePlan]:
        return (self.prefill, self.decode)

    @property
    def router_name(self) -> str:
        return f"{self.cluster.endpoint_name}-router"

    def service_host(self, name: str) -> str:
        return f"{name}.{self.cluster.namespace}.svc.cluster.local"

    def shared_args(self) -> list[str]:
        """Flags every replica gets, whatever its role."""
        model = self.deployment.model
        args = ["--port", str(self.cluster.port), "--served-model-name", model.name]
        if model.dtype != "auto":
            args += ["--dtype", model.dtype]
        if model.max_model_len is not None:
            args += ["--max-model-len", str(model.max_model_len)]
        return args

    def replica_names(self, role: RolePlan) -> list[str]:
        """Stable names of a pool's replicas: StatefulSet pod names on Kubernetes, host names for the scripts."""
        return [f"{role.name}-{i}" for i in range(role.pool.replicas)]

    @property
    def receiver_ports(self) -> LMCacheReceiverPorts:
        """Where every decode replica's LMCache receiver listens (its config's pd_peer_* lists)."""
        return self.deployment.connector.lmcache.receiver_ports(self.decode.pool.tp)

    def router_argv(self, prefill_urls: list[str], decode_urls: list[str], tokenizer_dir: str) -> list[str]:
        """`pdlab router serve` for the cluster: every replica's URL (the router's strategies choose among them),
        the threshold and strategies from the lab, LMCache's P/D protocol with the decode replicas' receiver
        ports (so each prefill request names where its KV goes), listening on every address (it is the
        endpoint)."""
        assert self.deployment.router is not None  # checked in plan()
        router = self.deployment.router.model_copy(update={"kv_protocol": self.deployment.kv_protocol})
        ports = self.receiver_ports if router.kv_protocol == "lmcache" else None
        upstreams = RouterUpstreams(
            prefill=prefill_urls, decode=decode_urls, model=self.model, tokenizer=tokenizer_dir,
            max_model_len=self.deployment.model.max_model_len,
            **({"block_size": self.decode.engine.block_size} if self.decode.engine.block_size is not None else {}),
            lmcache_init_ports=ports.init_ports if ports else [],
            lmcache_alloc_ports=ports.alloc_ports if ports else [])
        return router_command(router, upstreams, program=CLUSTER_ROUTER_PROGRAM, host="0.0.0.0")

    def tokenizer_download(self, local_dir: str) -> list[str]:
        """The router counts prompt tokens with the served model's tokenizer: fetch only its files."""
        code = (f"import sys; from huggingface_hub import snapshot_download; snapshot_download({self.model!r}, "
                "allow_patterns=['tokenizer*', 'config.json', '*.jinja'], local_dir=sys.argv[1])")
        return ["python3", "-c", code, local_dir]


def engine_flags(engine: EngineOptions) -> list[str]:
    """`vllm serve` flags for the engine options a lab set (None leaves vLLM's default)."""
    flags: list[str] = []
    for name in ("max_num_batched_tokens", "max_num_seqs", "block_size"):
        value = getattr(engine, name)
        if value is not None:
            flags += ["--" + name.replace("_", "-"), str(value)]
    if engine.enable_chunked_prefill is not None:
        flags.append("--enable-chunked-prefill" if engine.enable_chunked_prefill else "--no-enable-chunked-prefill")
    flags.append("--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching")
    if engine.enforce_eager:
        flags.append("--enforce-eager")
    return flags + list(engine.extra_args)


def check(lab: LabSpec, source: str = "spec") -> tuple[DeploymentSpec, ClusterSpec]:
    """The cluster tier's cross-field rules; ConfigError names each bad field."""
    problems: list[tuple[str, str]] = []
    if lab.cluster is None:
        raise ConfigError(source, [("cluster", "a cluster lab needs a `cluster:` section")])
    if lab.deployment is None:
        raise ConfigError(source, [("deployment", "a cluster lab needs a `deployment` (scenarios are local-only)")])
    dep, cluster = lab.deployment, lab.cluster
    for role in ROLES:
        count = len(dep.by_role(role))
        if count != 1:
            where = "deployment.instances"
            problems.append((where, f"needs exactly one `{role}` instance (the {role} pool's template), has {count}"))
    if dep.by_role("colocated"):
        problems.append(("deployment.instances", "`colocated` instances have no place in a P/D cluster"))
    if dep.connector.kind != "lmcache":
        problems.append(("deployment.connector.kind", f"the cluster tier moves KV with `lmcache`, not "
                                                      f"`{dep.connector.kind}`"))
    if dep.connector.buffer_device != "cuda":
        problems.append(("deployment.connector.buffer_device", "GPU replicas stage KV on `cuda`"))
    for role in ROLES:
        pool: PoolSpec = getattr(cluster, role)
        if pool.model is not None and pool.model != dep.model.name:
            problems.append((f"cluster.{role}.model", f"{pool.model!r} differs from deployment.model.name "
                                                      f"{dep.model.name!r}: one model across pools"))
        if "LIBFABRIC" in dep.connector.nixl_backends and pool.efa_interfaces == 0:
            problems.append((f"cluster.{role}.efa_interfaces", "NIXL's LIBFABRIC backend needs EFA interfaces (>= 1)"))
    if cluster.prefill.tp != cluster.decode.tp:
        # LMCache's sender rank i pushes to the i-th receiver port, and its chunk keys carry the world size and
        # rank: decode rank i finds only what prefill rank i of an equally sized group sent.
        problems.append(("cluster.decode.tensor_parallel_size",
                         f"LMCache P/D moves KV rank to rank: decode needs prefill's tensor parallel size "
                         f"({cluster.prefill.tp}), has {cluster.decode.tp}"))
    if dep.router is None:
        problems.append(("deployment.router", "the cluster tier puts the pdlab router in front: give `router:`"))
    if cluster.model_source.kind == "huggingface" and "/" not in dep.model.name:
        problems.append(("deployment.model.name", f"{dep.model.name!r} is not a Hugging Face id (org/name)"))
    if problems:
        raise ConfigError(source, problems)
    return dep, cluster


def plan(lab: LabSpec, source: str = "spec") -> ClusterPlan:
    """Check a cluster lab and resolve it into per-role facts."""
    dep, cluster = check(lab, source)
    roles = {}
    for role in ROLES:
        env = dict(COMMON_ENV)
        if "LIBFABRIC" in dep.connector.nixl_backends:
            env.update(EFA_ENV)
        env["LMCACHE_CONFIG_FILE"] = f"{LMCACHE_CONFIG_DIR}/lmcache-{role}.yaml"
        roles[role] = RolePlan(
            role=role,
            name=f"{cluster.endpoint_name}-{role}",
            pool=getattr(cluster, role),
            engine=dep.by_role(role)[0].engine,
            kv_transfer_config=lmcache_settings.kv_transfer_config(role, buffer_device="cuda"),
            # The receiver listens on every pod address; the router decides per request where each push goes and
            # waits for the prefill's answer, not for LMCache's push report (router replicas share one Service
            # address, so a report could reach another replica than the one waiting).
            lmcache=lmcache_settings.lmcache_config(role, dep.connector.lmcache, buffer_device="cuda",
                                                    backends=list(dep.connector.nixl_backends),
                                                    tp=getattr(cluster, role).tp, peer_host="0.0.0.0",
                                                    max_prefill_tokens=dep.model.max_model_len),
            env=env,
            port=cluster.port,
        )
    return ClusterPlan(lab=lab, deployment=dep, cluster=cluster, prefill=roles["prefill"], decode=roles["decode"])


def load_plan(path: str | Path) -> ClusterPlan:
    """Load a cluster lab spec (labs/hyperpod-*.yaml) and plan it."""
    return plan(load_lab(path), source=str(path))
