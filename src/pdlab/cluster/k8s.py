"""Plain Kubernetes manifests (any EKS cluster with the NVIDIA and EFA device plugins): a prefill and a decode pool
of `vllm serve` with LMCache over NIXL, and the pdlab router Deployment in front.

The pools are StatefulSets behind headless Services rather than Deployments: each replica gets a stable DNS name
(`<endpoint>-decode-0.<endpoint>-decode.<ns>.svc.cluster.local`), which the router needs to list replicas for its
strategies and to tell LMCache's sender which decode replica receives the KV cache."""

from __future__ import annotations

from typing import Any

from pdlab.cluster.plan import LMCACHE_CONFIG_DIR, ClusterPlan, RolePlan
from pdlab.cluster.text import to_yaml, to_yaml_all

APP_LABEL = "app.kubernetes.io/name"
PART_LABEL = "app.kubernetes.io/component"
INSTANCE_LABEL = "app.kubernetes.io/instance"
#: Where vLLM keeps downloaded weights in the pod (an emptyDir: every pod downloads on start).
HF_HOME = "/models/hf"


def manifests(plan: ClusterPlan) -> dict[str, list[dict[str, Any]]]:
    """Kubernetes objects by the file they are written to."""
    return {
        "lmcache-config.yaml": [lmcache_configmap(plan)],
        "prefill.yaml": [service(plan, plan.prefill), statefulset(plan, plan.prefill)],
        "decode.yaml": [service(plan, plan.decode), statefulset(plan, plan.decode)],
        "router.yaml": [router_deployment(plan), router_service(plan)],
    }


def render(plan: ClusterPlan) -> dict[str, str]:
    return {name: to_yaml_all(docs) for name, docs in manifests(plan).items()}


def _meta(plan: ClusterPlan, name: str, part: str) -> dict[str, Any]:
    return {"name": name, "namespace": plan.cluster.namespace, "labels": _labels(plan, part)}


def _labels(plan: ClusterPlan, part: str) -> dict[str, str]:
    return {APP_LABEL: "pdlab", INSTANCE_LABEL: plan.cluster.endpoint_name, PART_LABEL: part}


def lmcache_configmap(plan: ClusterPlan) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(plan, f"{plan.cluster.endpoint_name}-lmcache", "lmcache"),
        "data": {role.lmcache_file: to_yaml(role.lmcache) for role in plan.roles},
    }


def _env(role: RolePlan, plan: ClusterPlan) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in role.env.items()]
    env.append({"name": "HF_HOME", "value": HF_HOME})
    if secret := plan.cluster.model_source.hf_token_secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret, "key": "token"}}})
    return env


def statefulset(plan: ClusterPlan, role: RolePlan) -> dict[str, Any]:
    ports = [{"name": "http", "containerPort": role.port}]
    if role.role == "decode":
        # LMCache's receiver listens here (one port per GPU rank); senders connect straight to the pod.
        lm = role.lmcache
        ports += [{"name": f"lmc-init-{i}", "containerPort": p} for i, p in enumerate(lm["pd_peer_init_port"])]
        ports += [{"name": f"lmc-alloc-{i}", "containerPort": p} for i, p in enumerate(lm["pd_peer_alloc_port"])]
    container = {
        "name": "vllm",
        "image": plan.cluster.images.vllm,
        "command": ["vllm", "serve"],
        "args": [plan.model, *plan.shared_args(), *role.role_args],
        "env": _env(role, plan),
        "ports": ports,
        "resources": role.resources,
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10},
        # Weights download and CUDA-graph capture take minutes; do not restart a pod that is still starting.
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10,
                         "failureThreshold": 180},
        "volumeMounts": [
            {"name": "lmcache-config", "mountPath": LMCACHE_CONFIG_DIR, "readOnly": True},
            {"name": "models", "mountPath": "/models"},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
    }
    if role.pool.efa_interfaces:
        # libfabric registers (pins) GPU and host buffers with the EFA device, which needs locked memory.
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [
            {"name": "lmcache-config", "configMap": {"name": f"{plan.cluster.endpoint_name}-lmcache"}},
            {"name": "models", "emptyDir": {}},
            # Tensor-parallel workers talk through shared memory; the container default (64 MiB) is too small.
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}},
        ],
    }
    if role.pool.node_selector:
        pod_spec["nodeSelector"] = dict(role.pool.node_selector)
    labels = _labels(plan, role.role)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(plan, role.name, role.role),
        "spec": {
            "serviceName": role.name,
            "replicas": role.pool.replicas,
            # Replicas are independent servers: start them all at once, not one after another.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def service(plan: ClusterPlan, role: RolePlan) -> dict[str, Any]:
    # Headless: gives each StatefulSet pod its own DNS name.
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(plan, role.name, role.role),
        "spec": {
            "clusterIP": "None",
            "selector": _labels(plan, role.role),
            "ports": [{"name": "http", "port": role.port, "targetPort": "http"}],
        },
    }


TOKENIZER_DIR = "/tokenizer"


def router_argv(plan: ClusterPlan) -> list[str]:
    port = plan.cluster.port
    urls = {role.role: [f"http://{name}.{plan.service_host(role.name)}:{port}" for name in plan.replica_names(role)]
            for role in plan.roles}
    return plan.router_argv(prefill_urls=urls["prefill"], decode_urls=urls["decode"], tokenizer_dir=TOKENIZER_DIR)


def _router_env(plan: ClusterPlan) -> list[dict[str, Any]]:
    # The admin API stays closed unless this Secret exists.
    return [{"name": "PDLAB_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": f"{plan.router_name}-admin", "key": "token", "optional": True}}}]


def router_deployment(plan: ClusterPlan) -> dict[str, Any]:
    router = plan.deployment.router
    assert router is not None
    labels = _labels(plan, "router")
    container = {
        "name": "router",
        "image": plan.cluster.images.router,
        "command": router_argv(plan),
        "env": _router_env(plan),
        "ports": [{"name": "http", "containerPort": router.port}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": "2", "memory": "4Gi"}},
        "volumeMounts": [{"name": "tokenizer", "mountPath": TOKENIZER_DIR, "readOnly": True}],
    }
    # The router counts prompt tokens with the model's own tokenizer; the vLLM image has huggingface_hub to fetch it.
    fetch = {
        "name": "tokenizer",
        "image": plan.cluster.images.vllm,
        "command": plan.tokenizer_download(TOKENIZER_DIR),
        "env": [e for e in _env(plan.decode, plan) if e["name"] == "HF_TOKEN"],
        "volumeMounts": [{"name": "tokenizer", "mountPath": TOKENIZER_DIR}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(plan, plan.router_name, "router"),
        "spec": {
            "replicas": plan.cluster.router_replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {
                "initContainers": [fetch],
                "containers": [container],
                "volumes": [{"name": "tokenizer", "emptyDir": {}}],
            }},
        },
    }


def router_service(plan: ClusterPlan) -> dict[str, Any]:
    router = plan.deployment.router
    assert router is not None
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(plan, plan.router_name, "router"),
        "spec": {
            "type": "ClusterIP",
            "selector": _labels(plan, "router"),
            "ports": [{"name": "http", "port": router.port, "targetPort": "http"}],
        },
    }
