"""From a DeploymentSpec to concrete processes: ports, cores, the vLLM command line and environment.
Pure functions (plus a port probe), so the plan can be unit-tested and shown before anything starts."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pdlab.config.deployment import DeploymentSpec, InstanceSpec
from pdlab.settings import BASE_INSTANCE_PORT, BASE_NIXL_SIDE_CHANNEL_PORT, HTTP_KEEP_ALIVE_S


class PlanError(ValueError):
    """The deployment cannot run here as specified; the message names the instance and what to change."""


@dataclass
class InstancePlan:
    """One vLLM process, fully decided."""

    spec: InstanceSpec  # with port and nixl_side_channel_port filled in
    argv: list[str]
    env: dict[str, str] = field(repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def assign_ports(spec: DeploymentSpec) -> list[InstanceSpec]:
    """Fill each instance's HTTP and NIXL side-channel ports: explicit ones are kept, the rest take the next
    base port not claimed by another instance."""
    taken_http = {inst.port for inst in spec.instances if inst.port is not None}
    taken_nixl = {inst.nixl_side_channel_port for inst in spec.instances if inst.nixl_side_channel_port}
    next_http, next_nixl = BASE_INSTANCE_PORT, BASE_NIXL_SIDE_CHANNEL_PORT
    resolved = []
    for inst in spec.instances:
        port, side = inst.port, inst.nixl_side_channel_port
        if port is None:
            while next_http in taken_http:
                next_http += 1
            port = next_http
            taken_http.add(port)
        if side is None:
            while next_nixl in taken_nixl:
                next_nixl += 1
            side = next_nixl
            taken_nixl.add(side)
        resolved.append(inst.model_copy(update={"port": port, "nixl_side_channel_port": side}))
    return resolved


def check_cores(instances: list[InstanceSpec], cores: list[int]) -> None:
    for i, inst in enumerate(instances):
        missing = sorted(set(inst.cores) - set(cores))
        if missing:
            raise PlanError(
                f"instances.{i}.cores: instance {inst.name!r} asks for core(s) {missing}, but this machine offers "
                f"{cores}; edit the lab spec's cores"
            )


def cores_arg(cores: list[int]) -> str:
    return ",".join(str(core) for core in cores)


def kv_transfer_config(spec: DeploymentSpec, inst: InstanceSpec) -> dict | None:
    if inst.role == "colocated" or spec.connector.kind == "none":
        return None
    if spec.connector.kind == "lmcache":
        raise PlanError(
            "connector.kind: `lmcache` is the cluster tier (LMCache's vLLM path needs CUDA); locally use `nixl`, "
            "or render the lab for a cluster with `pdlab cluster render`"
        )
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": spec.connector.buffer_device,
        "kv_load_failure_policy": spec.connector.kv_load_failure_policy,
        "kv_connector_extra_config": {"backends": list(spec.connector.nixl_backends)},
    }


def served_model_name(spec: DeploymentSpec) -> str:
    return Path(spec.model.name).name if os.sep in spec.model.name and Path(spec.model.name).is_dir() \
        else spec.model.name


def vllm_argv(spec: DeploymentSpec, inst: InstanceSpec, model_dir: str, python: str = sys.executable) -> list[str]:
    engine = inst.engine
    argv = [python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model_dir, "--served-model-name", served_model_name(spec),
            "--host", inst.host, "--port", str(inst.port), "--dtype", spec.model.dtype]
    if spec.model.max_model_len:
        argv += ["--max-model-len", str(spec.model.max_model_len)]
    if engine.enforce_eager:
        argv.append("--enforce-eager")
    # vLLM enables prefix caching by default; pdlab makes the choice explicit either way.
    argv.append("--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching")
    if engine.enable_chunked_prefill is not None:
        argv.append("--enable-chunked-prefill" if engine.enable_chunked_prefill else "--no-enable-chunked-prefill")
    for flag, value in (("--max-num-batched-tokens", engine.max_num_batched_tokens),
                        ("--max-num-seqs", engine.max_num_seqs), ("--block-size", engine.block_size),
                        ("--num-gpu-blocks-override", engine.kv_cache_blocks)):
        if value is not None:
            argv += [flag, str(value)]
    if (config := kv_transfer_config(spec, inst)) is not None:
        argv += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
    argv += engine.extra_args
    if inst.cores:
        # Pin the whole process tree (API server, engine core, worker) to the instance's cores from the start.
        argv = [_taskset(), "-c", cores_arg(inst.cores), *argv]
    return argv


def _taskset() -> str:
    path = shutil.which("taskset")
    if path is None:
        raise PlanError("pinning instances to cores needs `taskset` (Debian/Ubuntu: apt-get install util-linux)")
    return path


def vllm_env(spec: DeploymentSpec, inst: InstanceSpec, model_dir: str, base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": str(inst.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": cores_arg(inst.cores) if inst.cores else "nobind",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": inst.host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(inst.nixl_side_channel_port),
        "UCX_TLS": spec.connector.ucx_tls,
        # Loopback only, like every other port pdlab opens by default: without it UCX's TCP transport listens on
        # every interface (six listeners per worker on the machine's external one). A two-node netlab deployment
        # replaces it with its node's interface.
        "UCX_NET_DEVICES": "lo",
        # pdlab moves NIXL's busy-polling progress thread to SCHED_IDLE (deprioritize_spinning_threads). UCX's
        # multi-threaded worker lock is a spinlock by default: when the engine thread posts a KV read while the
        # idle-class thread holds it, the engine spins on its own core and the holder hardly ever runs (priority
        # inversion), freezing every stream for 0.4-1.6 s. A mutex lets the waiter sleep so the holder runs at
        # once. Measured on the hol-blocking load: NIXL post time 1.40 -> 0.18 s, short ITL max 1,252 -> 55 ms.
        "UCX_USE_MT_MUTEX": "y" if spec.connector.ucx_mutex else "n",
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(HTTP_KEEP_ALIVE_S),
        # Block hashes must agree across instances for KV-aware routing and prefix reuse.
        "PYTHONHASHSEED": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    })
    if inst.cores:
        env["OMP_NUM_THREADS"] = str(len(inst.cores))
    if Path(model_dir).is_dir():
        env["HF_HUB_OFFLINE"] = "1"  # a local model needs no hub; fail fast instead of trying to reach one
    return env


#: Stand-in timing (pdlab.benchmarks.standin): per generated token, and per prompt token prefilled.
STAND_IN_TOKEN_MS = 10
STAND_IN_PREFILL_US_PER_TOKEN = 100


def stand_in_argv(spec: DeploymentSpec, inst: InstanceSpec, python: str = sys.executable) -> list[str]:
    """pdlab's stand-in OpenAI server in place of vLLM for `inst`: the same endpoints, P/D protocol and metrics
    names, no model, up in a second. For drills of what surrounds the engine (router, launcher, load), never for
    measurements of serving."""
    return [python, "-m", "pdlab.benchmarks.standin", "--host", inst.host, "--port", str(inst.port),
            "--model", served_model_name(spec), "--name", inst.name, "--token-ms", str(STAND_IN_TOKEN_MS),
            "--prefill-us-per-token", str(STAND_IN_PREFILL_US_PER_TOKEN)]


def plan_deployment(spec: DeploymentSpec, model_dir: str, base_env: dict[str, str] | None = None,
                    cores: list[int] | None = None, stand_ins: bool = False) -> list[InstancePlan]:
    """Every instance's process, fully decided (with `stand_ins`, stand-in servers in place of vLLM)."""
    instances = assign_ports(spec)
    check_cores(instances, available_cores() if cores is None else cores)
    env = dict(os.environ if base_env is None else base_env)
    if stand_ins:
        return [InstancePlan(inst, stand_in_argv(spec, inst), {**env, "PYTHONUNBUFFERED": "1"}) for inst in instances]
    return [InstancePlan(inst, vllm_argv(spec, inst, model_dir), vllm_env(spec, inst, model_dir, env))
            for inst in instances]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            if error.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise
    return False


def check_ports_free(plans: list[InstancePlan], extra: list[tuple[str, str, int]] = ()) -> None:  # type: ignore[assignment]
    """Raise PlanError naming the first instance whose HTTP or NIXL port is already taken."""
    wanted = [(p.name, "HTTP port", p.spec.host, p.spec.port) for p in plans]
    wanted += [(p.name, "NIXL side-channel port", p.spec.host, p.spec.nixl_side_channel_port) for p in plans]
    wanted += [(name, "port", host, port) for name, host, port in extra]
    for name, what, host, port in wanted:
        if port_in_use(host, int(port)):
            raise PlanError(
                f"{name}: {what} {port} on {host} is already in use. Stop what holds it (`pdlab status` / "
                f"`pdlab down` if it is an earlier pdlab deployment), or set another port in the lab spec."
            )
