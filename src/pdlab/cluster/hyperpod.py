"""SageMaker HyperPod: one InferenceEndpointConfig (inference.sagemaker.aws.amazon.com/v1) with `pdSpec`, for the
HyperPod Inference Operator. The operator runs the prefill and decode Deployments, moves KV with its LMCache
integration (`kvCacheSpec`) and routes with its own router: pdlab's threshold becomes `pdSpec.routingThreshold`
and pdlab's strategy becomes `intelligentRoutingSpec.routingStrategy`."""

from __future__ import annotations

import re
from typing import Any

from pdlab.cluster.plan import HYPERPOD_MODEL_DIR, HYPERPOD_STRATEGY, ClusterPlan, RolePlan
from pdlab.cluster.text import to_yaml
from pdlab.config import ConfigError

API_VERSION = "inference.sagemaker.aws.amazon.com/v1"
KIND = "InferenceEndpointConfig"
MODEL_VOLUME = "model-weights"


def routing_strategy(plan: ClusterPlan, source: str = "spec") -> str:
    """HyperPod has one routing strategy for the whole endpoint; pdlab has one per pool. Render only what HyperPod
    can express, and name the field that it cannot."""
    router = plan.deployment.router
    assert router is not None
    problems = []
    for field in ("prefill_strategy", "decode_strategy"):
        name = getattr(router, field)
        if HYPERPOD_STRATEGY[name] is None:
            allowed = sorted(k for k, v in HYPERPOD_STRATEGY.items() if v)
            problems.append((f"deployment.router.{field}", f"`{name}` has no HyperPod routingStrategy; use one of "
                                                          f"{allowed} (or render --target k8s)"))
    if not problems and router.prefill_strategy != router.decode_strategy:
        problems.append(("deployment.router.prefill_strategy", f"HyperPod has one routingStrategy for both pools; "
                         f"`{router.prefill_strategy}` differs from decode_strategy `{router.decode_strategy}`"))
    if problems:
        raise ConfigError(source, problems)
    strategy = HYPERPOD_STRATEGY[router.decode_strategy]
    assert strategy is not None
    return strategy


def _model_source(plan: ClusterPlan) -> dict[str, Any]:
    src = plan.cluster.model_source
    if src.kind == "huggingface":
        hf: dict[str, Any] = {"modelId": plan.model}
        if src.hf_token_secret:
            hf["tokenSecretRef"] = {"name": src.hf_token_secret, "key": "token"}
        return {"modelSourceType": "huggingface", "huggingFaceModel": hf}
    if src.kind == "s3":
        return {"modelSourceType": "s3", "s3Storage": {"bucketName": src.s3_bucket, "region": src.region},
                "modelLocation": src.location}
    return {"modelSourceType": "fsx", "fsxStorage": {"fileSystemId": src.fsx_file_system_id},
            "modelLocation": src.location}


def _role_spec(role: RolePlan) -> dict[str, Any]:
    # KV transfer itself is the operator's (kvCacheSpec): only engine flags go here, not --kv-transfer-config.
    spec: dict[str, Any] = {"replicas": role.pool.replicas, "resources": role.resources, "args": role.engine_args}
    if role.pool.node_selector:
        spec["nodeSelector"] = dict(role.pool.node_selector)
    return spec


def model_name(plan: ClusterPlan) -> str:
    """SageMaker model name: the HF id's last part, in the CRD's allowed characters."""
    return re.sub(r"[^a-zA-Z0-9]+", "-", plan.model.split("/")[-1]).strip("-")[:63]


def endpoint_config(plan: ClusterPlan, source: str = "spec") -> dict[str, Any]:
    cluster = plan.cluster
    router = plan.deployment.router
    assert router is not None
    env = {**plan.decode.env}
    env.pop("LMCACHE_CONFIG_FILE")  # the operator writes LMCache's config from kvCacheSpec
    topology: dict[str, Any] = {"sameAZ": cluster.topology.same_az}
    if cluster.topology.availability_zone:
        topology["availabilityZone"] = cluster.topology.availability_zone
    if cluster.topology.placement_group:
        topology["placementGroup"] = cluster.topology.placement_group
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": cluster.endpoint_name, "namespace": cluster.namespace},
        "spec": {
            "modelName": model_name(plan),
            "endpointName": cluster.endpoint_name,
            "instanceType": cluster.instance_type,
            "modelSourceConfig": _model_source(plan),
            "worker": {
                "image": cluster.images.vllm,
                "command": ["vllm", "serve"],
                "args": [HYPERPOD_MODEL_DIR, *plan.shared_args()],
                "environmentVariables": [{"name": k, "value": v} for k, v in env.items()],
                "modelInvocationPort": {"containerPort": cluster.port, "name": "http"},
                "modelVolumeMount": {"name": MODEL_VOLUME, "mountPath": HYPERPOD_MODEL_DIR},
                "resources": plan.decode.resources,
            },
            "intelligentRoutingSpec": {"enabled": True, "routingStrategy": routing_strategy(plan, source)},
            "kvCacheSpec": {"enableL1Cache": cluster.cpu_kv_offload, "enableL2Cache": False},
            "pdSpec": {
                "routingThreshold": router.threshold,
                "prefillSpec": _role_spec(plan.prefill),
                "decodingSpec": _role_spec(plan.decode),
                "topologySpec": topology,
            },
        },
    }


def render(plan: ClusterPlan, source: str = "spec") -> dict[str, str]:
    return {"inferenceendpointconfig.yaml": to_yaml(endpoint_config(plan, source))}
