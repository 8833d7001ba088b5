"""Cluster-tier settings (pdlab.cluster): where a lab's P/D deployment runs on GPU nodes.

A cluster lab spec keeps its `deployment` (model, connector, router: the same types as the local tier) and adds a
`cluster:` section with what only a GPU cluster has: instance types, pools of replicas, GPUs, EFA interfaces,
images, and where the model weights come from (LMCache's settings are the deployment's `connector.lmcache`, the
same on both tiers). The deployment's single `prefill` and `decode` instances are the pool templates: their engine
options apply to every replica of the pool.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pdlab.config.base import Spec

DNS_LABEL = r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"
"""A Kubernetes object name (RFC 1123 label): lowercase letters, digits and dashes, at most 63 characters."""


class InstanceTypeFacts(Spec):
    """What an accelerated instance type offers (AWS's published figures)."""

    gpus: int
    gpu: str
    efa_interfaces: int
    """Most EFA network interfaces the instance exposes (`vpc.amazonaws.com/efa` allocatable)."""
    accelerator: str
    """Its GPU in the simulator's catalog (data/catalog/hardware.yaml)."""
    efa_link: str
    """Its EFA in the simulator's catalog (data/catalog/links.yaml): the node's EFA bandwidth per GPU."""


#: The instance types cluster labs may name, with AWS's published GPU and EFA counts.
INSTANCE_TYPES: dict[str, InstanceTypeFacts] = {
    "ml.p4d.24xlarge": InstanceTypeFacts(gpus=8, gpu="A100 40GB", efa_interfaces=4, accelerator="A100-SXM4-40GB",
                                         efa_link="efa-p4d"),
    "ml.p4de.24xlarge": InstanceTypeFacts(gpus=8, gpu="A100 80GB", efa_interfaces=4, accelerator="A100-SXM4-80GB",
                                          efa_link="efa-p4d"),
    "ml.p5.48xlarge": InstanceTypeFacts(gpus=8, gpu="H100 80GB", efa_interfaces=32, accelerator="H100-SXM5-80GB",
                                        efa_link="efa-p5"),
    # p5e has p5's 3,200 Gbps of EFA (32 x 100 Gbps) with p5en's H200s.
    "ml.p5e.48xlarge": InstanceTypeFacts(gpus=8, gpu="H200 141GB", efa_interfaces=32, accelerator="H200-SXM-141GB",
                                         efa_link="efa-p5"),
    "ml.p5en.48xlarge": InstanceTypeFacts(gpus=8, gpu="H200 141GB", efa_interfaces=16, accelerator="H200-SXM-141GB",
                                          efa_link="efa-p5en"),
}


class PoolSpec(Spec):
    """One role's pool of vLLM replicas (prefill or decode)."""

    replicas: int = Field(default=1, ge=1)
    """Number of vLLM servers in the pool (each a pod, or a process on a GPU host)."""
    gpus: int = Field(default=8, ge=1)
    """GPUs per replica (`nvidia.com/gpu`)."""
    tensor_parallel_size: int | None = Field(default=None, ge=1)
    """vLLM `--tensor-parallel-size`; None uses all of the replica's GPUs."""
    efa_interfaces: int = Field(default=0, ge=0)
    """EFA network interfaces per replica (`vpc.amazonaws.com/efa`); 0 means no EFA (TCP only)."""
    cpu: str = "32"
    """CPU request per replica (Kubernetes quantity)."""
    memory: str = "256Gi"
    """Memory request per replica (Kubernetes quantity); LMCache's pinned transfer buffer lives here too."""
    node_selector: dict[str, str] = {}
    """Node labels a replica must run on (Kubernetes nodeSelector), e.g. a dedicated node group per role."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    """vLLM `--gpu-memory-utilization`: share of GPU memory for weights and KV cache."""
    model: str | None = None
    """The model this pool serves; None takes `deployment.model.name`. If given it must equal it: KV caches only
    move between replicas of the same model."""

    @property
    def tp(self) -> int:
        return self.tensor_parallel_size or self.gpus


class ModelSource(Spec):
    """Where the pods get the weights (HyperPod's modelSourceConfig)."""

    kind: Literal["huggingface", "s3", "fsx"] = "huggingface"
    """`huggingface`: download from the Hub; `s3`: a bucket prefix; `fsx`: an FSx for Lustre file system."""
    hf_token_secret: str | None = None
    """Kubernetes Secret holding the Hugging Face token (key `token`), for gated models such as Llama."""
    s3_bucket: str | None = None
    """Bucket name, for kind `s3`."""
    region: str | None = None
    """Bucket region, for kind `s3`."""
    fsx_file_system_id: str | None = None
    """File system id (fs-...), for kind `fsx`."""
    location: str | None = None
    """Path of the model inside the bucket or file system."""

    @model_validator(mode="after")
    def _complete(self) -> ModelSource:
        if self.kind == "s3":
            for field in ("s3_bucket", "region", "location"):
                if not getattr(self, field):
                    raise ValueError(f"{field}: required when kind is `s3`")
        if self.kind == "fsx":
            for field in ("fsx_file_system_id", "location"):
                if not getattr(self, field):
                    raise ValueError(f"{field}: required when kind is `fsx`")
        return self


class Images(Spec):
    """Container images."""

    vllm: str = "lmcache/vllm-openai:latest"
    """vLLM with LMCache and NIXL (with its LIBFABRIC plugin, for EFA) inside; pin the tag you have tested."""
    router: str = "pdlab:0.1.0"
    """An image with pdlab installed (`pip install .`, core dependencies only), for the router; push it to a
    registry the cluster can pull from."""


class Topology(Spec):
    """Where prefill and decode replicas land relative to each other (HyperPod's topologySpec)."""

    same_az: bool = True
    """Keep both pools in one availability zone: EFA does not cross zones."""
    availability_zone: str | None = None
    """Pin both pools to this zone (e.g. `us-west-2a`)."""
    placement_group: str | None = None
    """EC2 cluster placement group for the lowest latency between pools."""


class ClusterSpec(Spec):
    """Where and how a deployment runs on a GPU cluster."""

    endpoint_name: str = Field(pattern=DNS_LABEL, max_length=50)
    """Name of the endpoint and prefix of every rendered object (short: Kubernetes appends suffixes)."""
    namespace: str = Field(default="default", pattern=DNS_LABEL)
    """Kubernetes namespace."""
    instance_type: str = "ml.p5.48xlarge"
    """Accelerated instance type of the GPU nodes (one of INSTANCE_TYPES)."""
    prefill: PoolSpec = Field(default_factory=PoolSpec)
    """The prefill pool."""
    decode: PoolSpec = Field(default_factory=PoolSpec)
    """The decode pool."""
    port: int = Field(default=8000, ge=1, le=65535)
    """HTTP port of every vLLM server."""
    router_replicas: int = Field(default=1, ge=1)
    """pdlab router pods."""
    images: Images = Field(default_factory=Images)
    """Container images."""
    model_source: ModelSource = Field(default_factory=ModelSource)
    """Where the weights come from."""
    topology: Topology = Field(default_factory=Topology)
    """Placement of the two pools."""
    cpu_kv_offload: bool = True
    """HyperPod kvCacheSpec.enableL1Cache: LMCache also keeps evicted KV in CPU memory."""

    @model_validator(mode="after")
    def _fits_instance(self) -> ClusterSpec:
        facts = INSTANCE_TYPES.get(self.instance_type)
        if facts is None:
            raise ValueError(f"instance_type: unknown {self.instance_type!r}; known: {sorted(INSTANCE_TYPES)}")
        for role in ("prefill", "decode"):
            pool: PoolSpec = getattr(self, role)
            if pool.gpus > facts.gpus:
                raise ValueError(f"{role}.gpus: {pool.gpus} > the {facts.gpus} GPUs of {self.instance_type}")
            if pool.gpus % pool.tp:
                raise ValueError(f"{role}.tensor_parallel_size: {pool.tp} does not divide gpus ({pool.gpus})")
            if pool.efa_interfaces > facts.efa_interfaces:
                raise ValueError(f"{role}.efa_interfaces: {pool.efa_interfaces} > the {facts.efa_interfaces} "
                                 f"EFA interfaces of {self.instance_type}")
        return self
