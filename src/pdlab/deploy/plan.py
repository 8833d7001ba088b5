"""From a DeploymentSpec to concrete processes: ports, cores, the vLLM command line and environment.
Pure functions (plus a port probe), so the plan can be unit-tested and shown before anything starts."""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pdlab.config.deployment import DeploymentSpec, InstanceSpec
from pdlab.lmcache import settings as lmcache_settings
from pdlab.settings import BASE_INSTANCE_PORT, BASE_NIXL_SIDE_CHANNEL_PORT, HTTP_KEEP_ALIVE_S

#: The module vLLM imports for pdlab's NixlConnector (vLLM's own, without NIXL's progress thread); pdlab itself never
#: imports it.
QUIET_NIXL_CONNECTOR_MODULE = "pdlab.deploy.nixl_connector"


class PlanError(ValueError):
    """The deployment cannot run here as specified; the message names the instance and what to change."""


@dataclass
class InstancePlan:
    """One vLLM process, fully decided."""

    spec: InstanceSpec  # with port and nixl_side_channel_port filled in
    argv: list[str]
    env: dict[str, str] = field(repr=False)
    """The whole environment the process gets (the caller's, plus what pdlab sets)."""
    own_env: dict[str, str] = field(default_factory=dict)
    """The variables pdlab sets (or overrides) for this instance: what `pdlab up --dry-run` shows."""
    lmcache: dict | None = None
    """This instance's LMCache config (connector kind `lmcache`): the launcher writes it where
    $LMCACHE_CONFIG_FILE points."""

    @property
    def lmcache_ports(self) -> list[tuple[str, int]]:
        """(what, port) LMCache listens on in this instance: receiver ports, its HTTP server's."""
        config = self.lmcache or {}
        ports = [("LMCache receiver port", p) for p in
                 config.get("pd_peer_init_port", []) + config.get("pd_peer_alloc_port", [])]
        if config.get("internal_api_server_enabled"):
            start = config["internal_api_server_port_start"]
            ports += [("LMCache HTTP port", start), ("LMCache HTTP port", start + 1)]
        return ports

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
    if spec.connector.kind == "lmcache":  # P/D, or LMCache's CPU tier on a colocated instance
        return lmcache_settings.kv_transfer_config(inst.role, buffer_device=spec.connector.buffer_device,
                                                   cpu_connector=True)
    if inst.role == "colocated" or spec.connector.kind == "none":
        return None
    config = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": spec.connector.buffer_device,
        "kv_load_failure_policy": spec.connector.kv_load_failure_policy,
        "kv_connector_extra_config": {"backends": list(spec.connector.nixl_backends)},
    }
    if not spec.connector.progress_thread:
        config["kv_connector_module_path"] = QUIET_NIXL_CONNECTOR_MODULE
    return config


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


def vllm_env(spec: DeploymentSpec, inst: InstanceSpec, model_dir: str, base: dict[str, str],
             sockets: Path | None = None) -> dict[str, str]:
    env = dict(base)
    if sockets is not None:
        env["VLLM_RPC_BASE_PATH"] = str(sockets)
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
        # With `connector.progress_thread: true`, pdlab moves NIXL's busy-polling progress thread to SCHED_IDLE
        # (deprioritize_spinning_threads). UCX's multi-threaded worker lock is a spinlock by default: when the
        # engine thread posts a KV read while the idle-class thread holds it, the engine spins on its own core and
        # the holder hardly ever runs (priority inversion), freezing every stream for 0.4-1.6 s. A mutex lets the
        # waiter sleep so the holder runs at once. Measured on the hol-blocking load: NIXL post time 1.40 -> 0.18 s,
        # short ITL max 1,252 -> 55 ms.
        "UCX_USE_MT_MUTEX": "y" if spec.connector.ucx_mutex else "n",
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(HTTP_KEEP_ALIVE_S),
        # Block hashes must agree across instances for KV-aware routing, prefix reuse and LMCache's chunk keys.
        **lmcache_settings.LMCACHE_ENV,
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
    argv = [python, "-m", "pdlab.benchmarks.standin", "--host", inst.host, "--port", str(inst.port),
            "--model", served_model_name(spec), "--name", inst.name, "--token-ms", str(STAND_IN_TOKEN_MS),
            "--prefill-us-per-token", str(STAND_IN_PREFILL_US_PER_TOKEN)]
    if spec.kv_protocol == "lmcache" and inst.role != "colocated":
        # LMCache's P/D played by the stand-ins: the same ports and report address as the instances' LMCache
        # configs (lmcache_config below), so the router speaks to them as to LMCache.
        lm = spec.connector.lmcache
        if inst.role == "prefill":
            argv += ["--lmcache-role", "sender"]
            if spec.router is not None:
                argv += ["--lmcache-notify", f"{spec.router.host}:{lm.notify_port}"]
        else:
            ports = lm.receiver_ports(1)
            argv += ["--lmcache-role", "receiver", "--lmcache-init-ports", ",".join(map(str, ports.init_ports)),
                     "--lmcache-alloc-ports", ",".join(map(str, ports.alloc_ports))]
    return argv


def lmcache_config(spec: DeploymentSpec, inst: InstanceSpec, index: int, model_dir: str,
                   notify_host: str | None = None) -> dict | None:
    """The instance's LMCache config (pdlab.lmcache.settings, as on a cluster): staged on the CPU, pushes reported
    to the router (at `notify_host`, default the router's own address; on nodes, the address the nodes reach the
    router's namespace at), the receiver on the instance's own address, LMCache's HTTP server (its figures) on
    ports of its own."""
    if spec.connector.kind != "lmcache":
        return None
    lm = spec.connector.lmcache
    notify = (notify_host or spec.router.host, lm.notify_port) if spec.router is not None else None
    api_port = None if lm.api_port is None else lm.api_port + 2 * index  # LMCache's scheduler, then its worker
    return lmcache_settings.lmcache_config(
        inst.role, lm, buffer_device=spec.connector.buffer_device, backends=list(spec.connector.nixl_backends),
        peer_host=inst.host, notify=notify, max_prefill_tokens=spec.model.max_model_len or model_context(model_dir),
        api_port=api_port)


def model_context(model_dir: str) -> int | None:
    """The model's own context length (config.json's max_position_embeddings), None where there is none."""
    config = Path(model_dir) / "config.json"
    return json.loads(config.read_text()).get("max_position_embeddings") if config.is_file() else None


def check_lmcache_local(spec: DeploymentSpec) -> None:
    """What LMCache's P/D allows on one machine (or one node: a network namespace is a machine of its own): one
    decode instance (its receiver takes its allocation port on every address of the machine, so a second would
    take the first's pushes)."""
    if spec.connector.kind != "lmcache":
        return
    by_machine: dict[str | None, list[str]] = {}
    for inst in spec.by_role("decode"):
        by_machine.setdefault(inst.node, []).append(inst.name)
    for node, names in by_machine.items():
        if len(names) > 1:
            where = f"node {node!r}" if node else "this machine"
            raise PlanError(f"instances: LMCache's P/D runs one decode instance per machine here, {where} has "
                            f"{len(names)} ({', '.join(names)}); put each on a node of its own (`node:`), or use "
                            "connector.kind `nixl` for several")


def plan_deployment(spec: DeploymentSpec, model_dir: str, base_env: dict[str, str] | None = None,
                    cores: list[int] | None = None, stand_ins: bool = False,
                    sockets: Path | None = None, notify_host: str | None = None) -> list[InstancePlan]:
    """Every instance's process, fully decided (with `stand_ins`, stand-in servers in place of vLLM); `sockets`
    is the directory for their IPC sockets (`ipc_dir`); `notify_host`: where LMCache senders reach the router
    (`lmcache_config`)."""
    check_lmcache_local(spec)
    instances = assign_ports(spec)
    check_cores(instances, available_cores() if cores is None else cores)
    env = dict(os.environ if base_env is None else base_env)
    if stand_ins:
        return [InstancePlan(inst, stand_in_argv(spec, inst), {**env, "PYTHONUNBUFFERED": "1"},
                             {"PYTHONUNBUFFERED": "1"}) for inst in instances]
    return [InstancePlan(inst, vllm_argv(spec, inst, model_dir), vllm_env(spec, inst, model_dir, env, sockets),
                         vllm_env(spec, inst, model_dir, {}, sockets),
                         lmcache_config(spec, inst, i, model_dir, notify_host))
            for i, inst in enumerate(instances)]


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
    wanted += [(p.name, what, p.spec.host, port) for p in plans for what, port in p.lmcache_ports]
    wanted += [(name, "port", host, port) for name, host, port in extra]
    for name, what, host, port in wanted:
        if port_in_use(host, int(port)):
            raise PlanError(
                f"{name}: {what} {port} on {host} is already in use. Stop what holds it (`pdlab status` / "
                f"`pdlab down` if it is an earlier pdlab deployment), or set another port in the lab spec."
            )


# -- what each part of a plan means (`pdlab up --dry-run`, notebook 00) ----------------------------------------------

#: What each vLLM flag pdlab may pass does, and why pdlab passes it.
FLAG_HELP = {
    "--model": "the model directory vLLM loads (config.json, weights, tokenizer); pdlab makes its local models",
    "--served-model-name": "the name clients put in a request's `model` field",
    "--host": "the address the HTTP server binds: loopback unless the lab says otherwise (a node's own address "
              "on two nodes)",
    "--port": "the HTTP port of the OpenAI-compatible API (/v1/completions, /health, /metrics)",
    "--dtype": "weights and activations dtype; float32 runs about 3x faster than bfloat16 on CPUs without bf16 "
               "matrix units",
    "--max-model-len": "the longest context (prompt + answer) the instance accepts",
    "--enforce-eager": "no torch.compile or graph capture: saves a warm-up of 40+ s per new shape on 2 cores",
    "--enable-prefix-caching": "keep and reuse the KV blocks of prompt prefixes seen before",
    "--no-enable-prefix-caching": "never reuse KV blocks across requests, so a measurement does not depend on what "
                                  "ran before",
    "--enable-chunked-prefill": "split a long prefill over several steps so decodes keep running between them",
    "--no-enable-chunked-prefill": "prefill a prompt in as few steps as the token budget allows",
    "--max-num-batched-tokens": "the token budget of one scheduler step (decode tokens + prefill tokens): the "
                                "knob that bounds how long a prefill can hold up a step",
    "--max-num-seqs": "the most sequences batched in one step",
    "--block-size": "tokens per KV block: the unit the cache is allocated, reused and transferred in",
    "--num-gpu-blocks-override": "the KV cache's size in blocks, in place of what VLLM_CPU_KVCACHE_SPACE holds",
    "--kv-transfer-config": "turns on a KV connector: how this instance hands KV caches to, or takes them from, "
                            "other instances (JSON; its keys below)",
}

#: The keys of `--kv-transfer-config` pdlab writes.
KV_CONFIG_HELP = {
    "kv_connector": "which connector: NixlConnector moves KV blocks with NIXL (here over UCX; over EFA through "
                    "libfabric on AWS)",
    "kv_role": "kv_both: the instance can send and receive; whether it prefills or decodes a request is decided "
               "per request by its kv_transfer_params",
    "kv_buffer_device": "where the connector stages KV blocks for transfer: cpu here, cuda on a GPU",
    "kv_load_failure_policy": "fail: a decode instance that cannot pull a KV cache ends the request with an error "
                              "instead of silently prefilling it itself",
    "kv_connector_extra_config": "connector options; `backends` lists NIXL's transports (UCX locally, LIBFABRIC "
                                 "for EFA)",
    "kv_connector_module_path": "where vLLM finds the connector class: pdlab's NixlConnector, vLLM's own without "
                                "NIXL's busy-polling progress thread (connector.progress_thread), or pdlab's "
                                "LMCache connector for vllm-cpu (LMCache has no CPU connector of its own)",
}

#: The environment variables pdlab sets for a vLLM instance.
ENV_HELP = {
    "VLLM_CPU_KVCACHE_SPACE": "GiB of memory for the KV cache (vLLM's CPU default would take half the RAM)",
    "VLLM_CPU_OMP_THREADS_BIND": "the cores vLLM's compute threads are bound to: this instance's core(s)",
    "OMP_NUM_THREADS": "as many compute threads as the instance has cores",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "where this instance's NIXL side channel listens: peers fetch its NIXL "
                                   "metadata (memory registrations, engine id) there before the first transfer",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "the side channel's port; each instance on a host needs its own",
    "UCX_TLS": "the transports UCX may use (tcp, self = within a process, sm = shared memory between processes); "
               "on two nodes shared memory is left out so the KV cache crosses the link",
    "UCX_NET_DEVICES": "the network interfaces UCX listens and sends on: lo (loopback only, like every port pdlab "
                       "opens by default), or a node's link on two nodes",
    "UCX_USE_MT_MUTEX": "UCX's worker lock as a mutex, not a spinlock: with NIXL's progress thread at idle "
                        "priority a spinlock froze the decode instance 0.4-1.6 s around KV reads",
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "seconds an idle keep-alive connection stays open (the router reuses them)",
    "VLLM_RPC_BASE_PATH": "where vLLM's (and LMCache's) processes put their IPC sockets: a directory of the "
                          "deployment's own, removed when it stops, not files left in /tmp",
    "PYTHONHASHSEED": "the same seed in every instance: vLLM's block hashes, and so prefix reuse, must agree "
                      "across instances (LMCache's chunk keys too: a sender and a receiver that differ miss silently)",
    "LMCACHE_CONFIG_FILE": "the instance's LMCache settings (written into the run directory; the cluster renders "
                           "write the same settings from the same code)",
    "VLLM_NO_USAGE_STATS": "send no usage statistics",
    "DO_NOT_TRACK": "send no usage statistics",
    "TOKENIZERS_PARALLELISM": "no tokenizer thread pool beside the instance's pinned threads",
    "PYTHONUNBUFFERED": "log lines reach the instance's log file at once",
    "HF_HUB_OFFLINE": "a local model needs no model hub: fail fast instead of trying to reach one",
}

#: What a command's prefix does.
PREFIX_HELP = {
    "taskset": "pins the whole process tree to the instance's cores from the start",
    "ip": "`ip netns exec NS`: runs the process inside its node's network namespace (its own interface and address)",
}


def explain(plan: InstancePlan) -> list[dict[str, str]]:
    """One row per part of an instance's command line and pdlab-set environment: `kind` (prefix, flag, kv, env),
    `name`, `value` and what it means."""
    rows: list[dict[str, str]] = []
    argv = plan.argv
    start = next(i for i, arg in enumerate(argv) if arg == "-m") - 1  # the python interpreter
    prefix_args = {"ip": 3, "taskset": 2}  # `ip netns exec NS`, `taskset -c CORES`
    i = 0
    while i < start:
        name = Path(argv[i]).name
        taken = prefix_args.get(name, 0)
        if name in PREFIX_HELP:
            rows.append({"kind": "prefix", "name": name, "value": " ".join(argv[i + 1:i + 1 + taken]),
                         "meaning": PREFIX_HELP[name]})
        i += 1 + taken
    rows.append({"kind": "command", "name": "python -m", "value": argv[start + 2],
                 "meaning": "vLLM's OpenAI-compatible server (what `vllm serve` runs)"})
    i = start + 3
    while i < len(argv):
        flag = argv[i]
        value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else ""
        rows.append({"kind": "flag", "name": flag, "value": value, "meaning": FLAG_HELP.get(flag, "passed through "
                                                                                         "from the lab spec")})
        if flag == "--kv-transfer-config":
            for key, setting in json.loads(value).items():
                rows.append({"kind": "kv", "name": key, "value": json.dumps(setting),
                             "meaning": KV_CONFIG_HELP.get(key, "")})
        i += 2 if value else 1
    for name, value in plan.own_env.items():
        rows.append({"kind": "env", "name": name, "value": value, "meaning": ENV_HELP.get(name, "")})
    return rows


def shell_line(plan: InstancePlan) -> str:
    """The instance's command as one shell line (pdlab-set variables first), to read or to run by hand."""
    env = " ".join(f"{name}={shlex.quote(value)}" for name, value in plan.own_env.items())
    return f"env {env} {shlex.join(plan.argv)}"
