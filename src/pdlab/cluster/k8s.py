"""Plain Kubernetes manifests (any EKS cluster with the NVIDIA and EFA device plugins): a prefill and a decode
Deployment of `vllm serve` with LMCache over NIXL, headless Services so the router can address each replica,
and the pdlab router in front."""

from __future__ import annotations

from typing import Any

import yaml

from pdlab.cluster.plan import LMCACHE_CONFIG_DIR, ROUTER_CONFIG_DIR, ClusterPlan, RolePlan, router_command

APP_LABEL = "app.kubernetes.io/name"
PART_LABEL = "app.kubernetes.io/component"
INSTANCE_LABEL = "app.kubernetes.io/instance"
#: Where vLLM keeps downloaded weights in the pod (an emptyDir: every pod downloads on start).
HF_HOME = "/models/hf"


def manifests(plan: ClusterPlan) -> dict[str, list[dict[str, Any]]]:
    """Kubernetes objects by the file they are written to."""
    return {
        "lmcache-config.yaml": [lmcache_configmap(plan)],
        "prefill.yaml": [deployment(plan, plan.prefill), service(plan, plan.prefill)],
        "decode.yaml": [deployment(plan, plan.decode), service(plan, plan.decode)],
        "router.yaml": [router_configmap(plan), router_deployment(plan), router_service(plan)],
    }


def render(plan: ClusterPlan) -> dict[str, str]:
    return {name: yaml.safe_dump_all(docs, sort_keys=False, width=120) for name, docs in manifests(plan).items()}


def _meta(plan: ClusterPlan, name: str, part: str) -> dict[str, Any]:
    return {"name": name, "namespace": plan.cluster.namespace, "labels": _labels(plan, part)}


def _labels(plan: ClusterPlan, part: str) -> dict[str, str]:
    return {APP_LABEL: "pdlab", INSTANCE_LABEL: plan.cluster.endpoint_name, PART_LABEL: part}


def lmcache_configmap(plan: ClusterPlan) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(plan, f"{plan.cluster.endpoint_name}-lmcache", "lmcache"),
        "data": {role.lmcache_file: yaml.safe_dump(role.lmcache, sort_keys=False) for role in plan.roles},
    }


def _env(role: RolePlan, plan: ClusterPlan) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in role.env.items()]
    env.append({"name": "HF_HOME", "value": HF_HOME})
    if secret := plan.cluster.model_source.hf_token_secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret, "key": "token"}}})
    return env


def deployment(plan: ClusterPlan, role: RolePlan) -> dict[str, Any]:
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
        "kind": "Deployment",
        "metadata": _meta(plan, role.name, role.role),
        "spec": {
            "replicas": role.pool.replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def service(plan: ClusterPlan, role: RolePlan) -> dict[str, Any]:
    # Headless: the name resolves to every ready pod, so the router picks the replica (its strategies) and can
    # give the chosen decode pod's address to LMCache's sender.
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


def router_config(plan: ClusterPlan) -> dict[str, Any]:
    port = plan.cluster.port
    return plan.router_config(prefill_urls=[f"http://{plan.service_host(plan.prefill.name)}:{port}"],
                              decode_urls=[f"http://{plan.service_host(plan.decode.name)}:{port}"])


def router_configmap(plan: ClusterPlan) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(plan, plan.router_name, "router"),
        "data": {"router.yaml": yaml.safe_dump(router_config(plan), sort_keys=False)},
    }


def _router_env(plan: ClusterPlan) -> list[dict[str, Any]]:
    # The admin API stays closed unless the Secret exists; the tokenizer (for the threshold) comes from the Hub.
    env: list[dict[str, Any]] = [{"name": "PDLAB_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": f"{plan.router_name}-admin", "key": "token", "optional": True}}}]
    if secret := plan.cluster.model_source.hf_token_secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret, "key": "token"}}})
    return env


def router_deployment(plan: ClusterPlan) -> dict[str, Any]:
    router = plan.deployment.router
    assert router is not None
    labels = _labels(plan, "router")
    container = {
        "name": "router",
        "image": plan.cluster.images.router,
        "command": router_command(plan, f"{ROUTER_CONFIG_DIR}/router.yaml"),
        "env": _router_env(plan),
        "ports": [{"name": "http", "containerPort": router.port}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": "2", "memory": "4Gi"}},
        "volumeMounts": [{"name": "config", "mountPath": ROUTER_CONFIG_DIR, "readOnly": True}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(plan, plan.router_name, "router"),
        "spec": {
            "replicas": plan.cluster.router_replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {
                "containers": [container],
                "volumes": [{"name": "config", "configMap": {"name": plan.router_name}}],
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
