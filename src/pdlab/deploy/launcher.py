"""The local launcher: start a deployment's vLLM instances (and router), wait until healthy with progress shown,
and stop everything it started.

    with Deployment(load_lab("labs/local-1p1d.yaml").deployment) as dep:
        print(dep.urls("prefill"), dep.urls("decode"))
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType

import httpx
import psutil
import yaml
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from pdlab import model, netlab
from pdlab.config.deployment import DeploymentSpec, InstanceSpec, Role
from pdlab.config.router import RouterSpec, RouterUpstreams
from pdlab.deploy import state
from pdlab.deploy.guard import GROUPS_FILE, ipc_dir
from pdlab.deploy.plan import InstancePlan, PlanError, check_ports_free, plan_deployment, served_model_name
from pdlab.deploy.process import ManagedProcess, deprioritize_spinning_threads, pin_process_tree, stop_together
from pdlab.lmcache import figures
from pdlab.lmcache.push import PushListener
from pdlab.pdrequest import decode_body, lmcache_kv_params, prefill_body
from pdlab.router.process import router_command, router_env
from pdlab.settings import (
    ADMIN_TOKEN_ENV,
    DEFAULT_STARTUP_TIMEOUT_S,
    REQUEST_ID_HEADER,
    VLLM_CPU_BLOCK_SIZE,
    VLLM_CPU_MAX_NUM_BATCHED_TOKENS,
    runs_dir,
)

#: Seconds one warm-up request may take (a first request on a busy 2-core machine takes a few).
WARM_UP_TIMEOUT_S = 120.0


class DeployError(RuntimeError):
    """A deployment that could not start; the message names the instance and shows its log tail."""


@dataclass
class RunningInstance:
    spec: InstanceSpec
    process: ManagedProcess
    lmcache: dict | None = None
    """Its LMCache config (connector kind `lmcache`), as written for it."""

    @property
    def lmcache_urls(self) -> list[str]:
        """LMCache's HTTP servers in this instance, where its own figures are (pdlab.lmcache.figures)."""
        return figures.api_urls(self.lmcache)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    @property
    def pid(self) -> int:
        return self.process.pid


def loopback_address(index: int) -> str:
    """The loopback address of node `index` when a two-node deployment runs without its shaped link: each node
    keeps an address of its own (Linux answers on all of 127.0.0.0/8)."""
    return f"127.0.0.{index + 1}"


@dataclass
class DryRun:
    """What a deployment's start would run (`Deployment.dry_run`, `pdlab up --dry-run`)."""

    instances: list[InstancePlan]
    router: list[str] | None
    """The router's command line, when the deployment has one."""
    netlab: dict | None
    """The nodes' namespaces, addresses and shaped link (NetLab.describe), when it runs on two nodes."""
    notes: list[str]
    """What differs from the spec here (e.g. no root: loopback addresses instead of the shaped link)."""


def _timestamp() -> str:
    return datetime.now().strftime("%Y%m%d-%H%M%S-%f")


class Deployment:
    """A running deployment. Start with `start()` or `with`; `stop()` (or leaving the block) stops every process
    it started. With `detached=True` the processes outlive this Python process and are recorded for `pdlab down`."""

    def __init__(self, spec: DeploymentSpec, run_dir: Path | None = None, progress: bool = True,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S, detached: bool = False,
                 console: Console | None = None, stand_ins: bool = False):
        self.spec = spec
        # absolute: `pdlab down` and the guard find the deployment's IPC directory from it (guard.ipc_dir)
        self.run_dir = (run_dir or runs_dir() / "deployments" / f"{spec.name}-{_timestamp()}").absolute()
        self.progress = progress
        self.startup_timeout_s = startup_timeout_s
        self.detached = detached
        self.stand_ins = stand_ins
        """Stand-in servers (pdlab.benchmarks.standin) in place of vLLM: drills of the router and the launcher."""
        self.console = console or Console(stderr=True)
        self.instances: list[RunningInstance] = []
        self.router: ManagedProcess | None = None
        self.router_url: str | None = None
        self.admin_token: str | None = None
        """Bearer token for the router's `/admin/*` endpoints."""
        self.model_dir: str = ""
        self.started_s: float | None = None
        self._guard: ManagedProcess | None = None
        self._owned = True
        self.netlab: netlab.NetLab | None = None
        self._groups_file = self.run_dir / GROUPS_FILE

    @classmethod
    def attach(cls, name: str) -> Deployment:
        """The deployment `pdlab up` started under `name`, for use from Python (a notebook, a test). The caller
        does not own it: `stop()` leaves it running; `pdlab down` stops it."""
        record = state.load(name)
        if record is None or not state.any_alive(record):
            raise DeployError(f"no deployment named {name!r} is up; start it with `pdlab up LAB.yaml`")
        saved = json.loads((Path(record["run_dir"]) / "deployment.json").read_text())
        dep = cls(DeploymentSpec.model_validate(saved["spec"]), run_dir=Path(record["run_dir"]), progress=False,
                  detached=True, stand_ins=bool(saved.get("stand_ins")))
        dep.model_dir = saved["model_dir"]
        if guard := record.get("guard"):
            dep._guard = ManagedProcess.adopt("guard", guard["pid"], guard["create_time"], Path(guard["log"]))
        dep._owned = False
        specs = {inst["name"]: inst for inst in saved["instances"]}
        resolved = {i.name: i for i in _resolved_instances(dep.spec, specs)}
        for entry in record["processes"]:
            proc = ManagedProcess.adopt(entry["name"], entry["pid"], entry["create_time"], Path(entry["log"]))
            if entry["role"] == "router":
                dep.router, dep.router_url = proc, entry["url"]
                dep.admin_token = record.get("admin_token")
            else:
                dep.instances.append(RunningInstance(resolved[entry["name"]], proc,
                                                     specs[entry["name"]].get("lmcache")))
        return dep

    # -- what callers use -------------------------------------------------------------------------------------
    @property
    def served_model(self) -> str:
        return served_model_name(self.spec)

    def urls(self, role: Role) -> list[str]:
        return [inst.url for inst in self.instances if inst.spec.role == role]

    def instance(self, name: str) -> RunningInstance:
        for inst in self.instances:
            if inst.name == name:
                return inst
        raise KeyError(f"no instance named {name!r}; instances: {[i.name for i in self.instances]}")

    @property
    def url(self) -> str:
        """Where clients send requests: the router if there is one, else the first decode/colocated instance."""
        if self.router_url:
            return self.router_url
        for role in ("colocated", "decode"):
            if urls := self.urls(role):  # type: ignore[arg-type]
                return urls[0]
        raise DeployError("deployment has no instance that serves requests directly")

    # -- lifecycle --------------------------------------------------------------------------------------------
    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> Deployment:
        if self.instances:
            raise DeployError("deployment already started")
        if self.detached and (existing := state.load(self.spec.name)) is not None and state.any_alive(existing):
            raise DeployError(f"a deployment named {self.spec.name!r} is already up (see `pdlab status`); "
                              f"stop it with `pdlab down {self.spec.name}` first")
        if self.detached and self.spec.nodes:
            raise DeployError("a two-node deployment (`nodes`) lives only as long as its owner: use "
                              "`pdlab up --foreground` or the Python API")
        try:
            self.model_dir = model.resolve(self.spec.model.name)
            self.netlab = netlab.for_deployment(self.spec)
            if self.netlab is not None:
                self.netlab.__enter__()
            elif self.spec.nodes:
                self.console.print(f"[yellow]no shaped link: {netlab.unavailable_reason()}; each node gets a "
                                   "loopback address of its own instead (link.fallback_to_loopback)[/yellow]")
            plans = self._plan(self.model_dir, self.netlab)
        except (model.ModelError, PlanError, netlab.NetLabUnavailable) as error:
            self._teardown_netlab()
            raise DeployError(str(error)) from None
        except BaseException:
            self._teardown_netlab()
            raise
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ipc_dir(self.run_dir).mkdir(mode=0o700, exist_ok=True)
        (self.run_dir / "deployment.json").write_text(json.dumps(self._record(plans), indent=2))
        start = time.monotonic()
        try:
            self._start_guard()
            for plan in plans:
                self._write_lmcache_config(plan)
                self.instances.append(RunningInstance(plan.spec, self._spawn(plan.name, plan.argv, plan.env),
                                                      plan.lmcache))
            self._wait_healthy([(i.name, i.url, i.process) for i in self.instances])
            self._warm_up()
            for inst in self.instances:  # after the warm-up: its first transfer may start threads of its own
                if inst.spec.role != "colocated" and not self.stand_ins:
                    self._settle_nixl_threads(inst)
            if self.spec.router is not None:
                self._start_router()
            self.started_s = time.monotonic() - start
            if self.detached:
                state.save(self)
        except BaseException:
            self.stop()
            raise
        return self

    def _record(self, plans: list[InstancePlan]) -> dict:
        """deployment.json: the spec as run (without the admin token: the file is not private; `pdlab up`'s state
        record, readable by its owner only, keeps it), the model and each instance's command line."""
        return {"spec": self.spec.model_dump(mode="json", exclude={"router": {"admin_token"}}),
                "model_dir": self.model_dir,
                "instances": [{"name": p.name, "url": p.url, "port": p.spec.port,
                               "nixl_side_channel_port": p.spec.nixl_side_channel_port, "argv": p.argv,
                               "lmcache": p.lmcache}
                              for p in plans],
                "netlab": self.netlab.describe() if self.netlab else None, "stand_ins": self.stand_ins}

    def dry_run(self) -> DryRun:
        """What `start()` would run, deciding everything and starting nothing: each instance's command line and
        environment, the router's command line, and the nodes' addresses (the subnet a start would take now).
        A model not made yet is shown at the path it will be made in."""
        name = self.spec.model.name
        try:
            model_dir = model.resolve(name, make=False)
        except model.ModelError:
            if name not in model.CATALOG:
                raise
            model_dir = str(model.model_path(name))
        lab = netlab.for_deployment(self.spec)  # raises NetLabUnavailable when it may not fall back
        notes = []
        if lab is not None:
            lab.preview()
        elif self.spec.nodes:
            notes.append(f"no shaped link here: {netlab.unavailable_reason()}; each node gets a loopback address "
                         "of its own instead (link.fallback_to_loopback)")
        plans = self._plan(model_dir, lab, check_ports=False)
        router = None
        if self.spec.router is not None:
            router = router_command(self._router_spec(), self._upstreams(plans, model_dir, lab))
        return DryRun(plans, router, lab.describe() if lab is not None else None, notes)

    def _plan(self, model_dir: str, lab: netlab.NetLab | None, check_ports: bool = True) -> list[InstancePlan]:
        """Plan the processes; on a two-node deployment, put each instance on its node's address and inside its
        namespace, with UCX restricted to the node's link (shared memory would bypass it). Falling back to
        loopback, each node gets a loopback address of its own (127.0.0.1, 127.0.0.2, ...)."""
        spec = self.spec
        if spec.nodes:
            nodes = [node.name for node in spec.nodes]
            address = lab.address if lab is not None else (lambda node: loopback_address(nodes.index(node)))
            spec = spec.model_copy(update={"instances": [
                inst.model_copy(update={"host": address(inst.node)}) if inst.node else inst
                for inst in spec.instances]})
        plans = plan_deployment(spec, model_dir, stand_ins=self.stand_ins, sockets=ipc_dir(self.run_dir),
                                notify_host=self._notify_host(lab))
        if check_ports:
            loopback = [p for p in plans if p.spec.node is None or lab is None]
            router_ports = [("router", spec.router.host, spec.router.port)] if spec.router else []
            if spec.router and spec.connector.kind == "lmcache":
                router_ports.append(("router (LMCache push reports)", self._notify_host(lab),
                                     spec.connector.lmcache.notify_port))
            check_ports_free(loopback, router_ports)  # a node's ports live in its own namespace
        if lab is not None:
            for plan in plans:
                if plan.spec.node:
                    plan.argv = lab.exec_prefix(plan.spec.node) + plan.argv
                    node_env = lab.env(plan.spec.node, spec.connector.ucx_tls)
                    plan.env.update(node_env)
                    plan.own_env.update(node_env)
        for plan in plans:
            if plan.lmcache is not None:  # written there by start() (as the cluster tier mounts its ConfigMap)
                path = str(self.run_dir / f"{plan.name}-lmcache.yaml")
                plan.env["LMCACHE_CONFIG_FILE"] = plan.own_env["LMCACHE_CONFIG_FILE"] = path
        return plans

    def _notify_host(self, lab: netlab.NetLab | None) -> str | None:
        """Where LMCache senders report their pushes to the router: its own address, or on nodes the address the
        nodes reach the router's (root) namespace at (their 127.0.0.1 is their own)."""
        if self.spec.router is None:
            return None
        return lab.root_address if lab is not None and self.spec.nodes else self.spec.router.host

    @staticmethod
    def _write_lmcache_config(plan: InstancePlan) -> None:
        """An instance's LMCache config, into the file its $LMCACHE_CONFIG_FILE names."""
        if plan.lmcache is not None:
            Path(plan.env["LMCACHE_CONFIG_FILE"]).write_text(yaml.safe_dump(plan.lmcache, sort_keys=False))

    def _warm_up(self) -> None:
        """One request to each instance, then one through every prefill -> decode pair, before anything is
        measured. A vLLM instance's first big request pays one-time costs (a 1,700-token prompt took 1.0 s on a
        fresh prefill instance, 0.92 s after a 1,200-token warm-up, 0.54-0.63 s after a full step), and NixlConnector's
        first transfer between two instances waits for their handshake, which a prefill instance busy with other
        prompts answers only when it pauses (a fresh 1P1D: a read posted while the prefill instance computed a
        6,000-token prompt waited 3.2 s, until it ended; later ones 0.06-0.5 s). Left in, they land on a run's
        first burst."""
        # Token ids, so its length is exact: one full step of vLLM's CPU token budget (a first full step pays
        # one-time costs of its own: a 1,200-token warm-up left a 1,700-token prompt 0.35 s slow; after this one
        # the first was 0.15 s slow, as after a two-step warm-up, which takes twice as long), and many KV blocks
        # for the P/D warm-up to move.
        tokens = min(VLLM_CPU_MAX_NUM_BATCHED_TOKENS, (self.spec.model.max_model_len or 1 << 30) - 2)
        prompt = [10 + i % 500 for i in range(tokens)]
        pairs = [(p, d) for p in self.instances if p.spec.role == "prefill"
                 for d in self.instances if d.spec.role == "decode"] if self.spec.kv_protocol == "nixl" else []
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=self.console,
                      transient=False, disable=not self.progress) as progress, \
                httpx.Client(timeout=WARM_UP_TIMEOUT_S) as client:
            task = progress.add_task("warming up: a first request per instance", total=len(self.instances) + len(pairs))
            body = {"model": self.served_model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
            # A stand-in LMCache sender refuses a request without a disagg_spec, as LMCache's own sender fails on
            # one; pdlab's connector serves it (pdlab.lmcache.connector), so a real sender is warmed up too.
            first = [inst for inst in self.instances
                     if not (self.stand_ins and self.spec.kv_protocol == "lmcache" and inst.spec.role == "prefill")]
            progress.advance(task, len(self.instances) - len(first))
            # All at once: each instance computes on its own cores (where two share a core, they take turns).
            with ThreadPoolExecutor(max_workers=max(1, len(first)), thread_name_prefix="pdlab-warm-up") as pool:
                for done in as_completed([pool.submit(_warm_post, client, inst.url, body,
                                                      f"the warm-up request to {inst.name}") for inst in first]):
                    done.result()
                    progress.advance(task)
            for prefill, decode in pairs:
                progress.update(task, description=f"warming up: a first KV transfer {prefill.name} -> {decode.name}")
                answer = _warm_post(client, prefill.url, prefill_body(body),
                                    f"the warm-up prefill on {prefill.name} (for {decode.name})")
                _warm_post(client, decode.url, decode_body(body, answer.get("kv_transfer_params")),
                           f"the warm-up decode on {decode.name} (KV from {prefill.name} over NIXL)")
                progress.advance(task)
            if self.spec.connector.kind == "lmcache" and not self.stand_ins:
                progress.update(task, description="warming up: LMCache's first transfers")
                self._warm_up_lmcache(client, body)
            progress.update(task, description="warmed up: first requests and KV transfers done")

    def _warm_up_lmcache(self, client: httpx.Client, body: dict) -> None:
        """LMCache's first transfers, and the start-up check that it moves KV at all (a misconfigured LMCache
        serves with no caching and no error): every prefill instance pushes a prompt to every decode instance, which
        must then take its KV from LMCache; a colocated instance's CPU tier must give back a prompt it stored."""
        lm = self.spec.connector.lmcache
        if not self.spec.disaggregated:
            for inst in self.instances:
                request_id = f"pdlab-warm-up-{inst.name}-{secrets.token_hex(4)}"
                fresh = {**body, "prompt": [4, *body["prompt"][1:]]}  # not the first warm-up's prompt
                _warm_post(client, inst.url, fresh, f"the LMCache warm-up on {inst.name}", request_id)
                if not figures.logged_tokens(inst.log_path).get(request_id, {}).get("stored"):
                    raise DeployError(f"LMCache stored none of a warm-up prompt on {inst.name}.\nLast lines of its "
                                      f"log ({inst.log_path}):\n{inst.process.log_tail()}")
                if not inst.spec.engine.enable_prefix_caching:  # else vLLM's own cache answers it again
                    before = figures.connector_hit_tokens(inst.url)
                    _warm_post(client, inst.url, fresh, f"the LMCache warm-up on {inst.name}")
                    _check_lmcache_hit(inst, before, "its CPU tier gave back none of a prompt it had just stored")
            return
        assert self.spec.router is not None  # LMCache P/D has a router (DeploymentSpec checks)
        pairs = [(p, d) for p in self.instances if p.spec.role == "prefill"
                 for d in self.instances if d.spec.role == "decode"]
        with PushListener(self._notify_host(self.netlab), lm.notify_port) as listener:
            for i, (prefill, decode) in enumerate(pairs):
                push_id = f"pdlab-warm-up-{prefill.name}-{decode.name}-{secrets.token_hex(4)}"
                ports = lm.receiver_ports(1)
                kv = lmcache_kv_params(push_id, decode.spec.host, ports.init_ports, ports.alloc_ports)
                # A prompt of its own per pair: the decode instance must load it, not find it cached.
                pair_body = {**body, "prompt": [3 + i, *body["prompt"][1:]]}
                _warm_post(client, prefill.url, prefill_body(pair_body, kv),
                           f"the LMCache warm-up prefill on {prefill.name} (pushing to {decode.name})")
                if not listener.wait_for(push_id, lm.push_timeout_s):
                    raise DeployError(f"{prefill.name} did not report pushing a prompt's KV to {decode.name} "
                                      f"within {lm.push_timeout_s:g} s (connector.lmcache.push_timeout_s).\n"
                                      f"Last lines of its log ({prefill.log_path}):\n{prefill.process.log_tail()}")
                before = figures.connector_hit_tokens(decode.url)
                _warm_post(client, decode.url, decode_body(pair_body, None),
                           f"the LMCache warm-up decode on {decode.name} (KV from {prefill.name})")
                _check_lmcache_hit(decode, before, f"it loaded none of the KV {prefill.name} pushed to it")

    def _settle_nixl_threads(self, inst: RunningInstance) -> None:
        """Undo two side effects of vLLM's NixlConnector on CPU that pdlab cannot configure away (see
        pin_process_tree and deprioritize_spinning_threads), and say so in the instance's log. pdlab's own
        NixlConnector (pdlab.deploy.nixl_connector) starts no progress thread: nothing spins there."""
        connector = self.spec.connector
        spins = connector.kind != "nixl" or connector.progress_thread
        moved = pin_process_tree(inst.pid, inst.spec.cores) if inst.spec.cores else []
        calmed = deprioritize_spinning_threads(inst.pid) if spins else []
        with open(inst.log_path, "a") as log:
            log.write(f"[pdlab] re-pinned threads {moved} to cores {inst.spec.cores}; "
                      f"moved spinning threads {calmed} to SCHED_IDLE (NIXL progress thread)\n")

    def _teardown_netlab(self) -> None:
        if self.netlab is not None:
            self.netlab.teardown()
            self.netlab = None

    def stop(self) -> None:
        """Stop the router and every instance (all their processes), then the guard. An attached deployment
        (see `attach`) is left running."""
        if not self._owned:
            return
        if self.router:
            self.router.stop()  # first: no request reaches an instance that is going away
        stop_together([inst.process for inst in self.instances])  # at once: each vLLM takes seconds to go
        self._groups_file.unlink(missing_ok=True)
        if self._guard is not None:
            self._guard.stop(timeout_s=5)
            self._guard = None
        self._teardown_netlab()
        shutil.rmtree(ipc_dir(self.run_dir), ignore_errors=True)
        if self.detached:
            state.remove(self.spec.name)

    # -- internals ----------------------------------------------------------------------------------------------
    def _start_guard(self) -> None:
        """The guard (pdlab.deploy.guard): stops the rest of a process group whose leader died, and everything if
        this process dies without stopping the deployment; a detached deployment (`pdlab up`) has no owner."""
        self._groups_file.write_text("")
        me = psutil.Process()
        owner = ["0", "0"] if self.detached else [str(me.pid), repr(me.create_time())]
        argv = [sys.executable, "-m", "pdlab.deploy.guard", *owner, str(self._groups_file)]
        self._guard = ManagedProcess("guard", argv, dict(os.environ), self.run_dir / "guard.log").start()

    def restart(self, name: str) -> RunningInstance:
        """Stop instance `name`'s whole process group (whatever is left of it) and start it again, as planned at
        the start; returns it once healthy. Requests meanwhile: the router's breaker keeps them off it, and its
        health check lets them back once it answers. Works on an attached deployment (`pdlab restart`) too."""
        old = self.instance(name)
        plan = next((p for p in self._plan(self.model_dir, self.netlab, check_ports=False) if p.name == name), None)
        if plan is None:
            raise DeployError(f"instance {name!r} is not in the deployment's plan")
        old.process.stop(timeout_s=10)
        self._forget_group(old.process)
        self._write_lmcache_config(plan)
        proc = self._spawn(plan.name, plan.argv, plan.env)
        new = RunningInstance(plan.spec, proc, plan.lmcache)
        self.instances[self.instances.index(old)] = new
        self._wait_healthy([(new.name, new.url, proc)])
        if new.spec.role != "colocated" and not self.stand_ins:
            self._settle_nixl_threads(new)
        if self.detached or not self._owned:
            proc.release()  # it outlives this Python process, like the rest of the deployment
            state.save(self)
        return new

    def _forget_group(self, proc: ManagedProcess) -> None:
        """Take a stopped process group off the guard's list."""
        if not self._groups_file.exists():
            return
        mine = f"{proc.pid} "
        kept = [line for line in self._groups_file.read_text().splitlines() if not line.startswith(mine)]
        staging = self._groups_file.with_suffix(".tmp")
        staging.write_text("".join(f"{line}\n" for line in kept))
        os.replace(staging, self._groups_file)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> ManagedProcess:
        proc = ManagedProcess(name, argv, env, self.run_dir / f"{name}.log").start()
        if self._groups_file.exists():
            with open(self._groups_file, "a") as groups:
                groups.write(f"{proc.pid} {proc.create_time!r}\n")
        return proc

    def router_upstreams(self) -> RouterUpstreams:
        """What the router fronts: this deployment's instances, model and KV block size."""
        return self._upstreams(self.instances, self.model_dir)

    def _upstreams(self, instances: Sequence[RunningInstance | InstancePlan], model_dir: str,
                   lab: netlab.NetLab | None = None) -> RouterUpstreams:
        """The router's upstreams among `instances` (running, or planned by a dry run on `lab`'s nodes)."""
        urls = {role: [i.url for i in instances if i.spec.role == role] for role in ("prefill", "decode", "colocated")}
        block_size = next((i.spec.engine.block_size for i in instances if i.spec.engine.block_size), None)
        lmcache = {}
        if self.spec.router is not None and self.spec.kv_protocol == "lmcache" and urls["prefill"]:
            # The ports every decode instance's LMCache config lists (one computation), and where the prefill
            # instances report their pushes (the router waits for each before the decode request).
            lm = self.spec.connector.lmcache
            ports = lm.receiver_ports(1)
            lmcache = {"lmcache_init_ports": ports.init_ports, "lmcache_alloc_ports": ports.alloc_ports,
                       "lmcache_notify_host": self._notify_host(lab or self.netlab),
                       "lmcache_notify_port": lm.notify_port,
                       "lmcache_push_timeout_s": lm.push_timeout_s}
        return RouterUpstreams(prefill=urls["prefill"], decode=urls["decode"] + urls["colocated"],
                               model=self.served_model, tokenizer=model_dir,
                               max_model_len=self.spec.model.max_model_len,
                               block_size=block_size or VLLM_CPU_BLOCK_SIZE, **lmcache)

    def _router_spec(self) -> RouterSpec:
        """The lab's router, speaking the KV protocol of the deployment's connector (an unset `kv_protocol` follows
        it; the router's own default is `nixl`)."""
        router = self.spec.router
        assert router is not None
        if router.kv_protocol is None and self.spec.kv_protocol != "nixl":
            router = router.model_copy(update={"kv_protocol": self.spec.kv_protocol})
        return router

    def _start_router(self) -> None:
        router = self._router_spec()
        argv = router_command(router, self.router_upstreams())
        # Safe by default: the admin API always has a token; an unset one is made up here. Either way it reaches
        # the router through its environment, never its command line (other local users can read that, and it
        # heads the router's log).
        self.admin_token = router.admin_secret() or os.environ.get(ADMIN_TOKEN_ENV) or secrets.token_urlsafe(24)
        self.router = self._spawn("router", argv, router_env(router, dict(os.environ), self.admin_token))
        self.router_url = f"http://{router.host}:{router.port}"
        self._wait_healthy([("router", self.router_url, self.router)])

    def _wait_healthy(self, targets: list[tuple[str, str, ManagedProcess]]) -> None:
        pending = {name: (url, proc) for name, url, proc in targets}
        start = time.monotonic()
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=self.console, transient=False, disable=not self.progress) as progress:
            tasks = {name: progress.add_task(f"{name}: starting", total=None) for name in pending}
            with httpx.Client(timeout=2.0) as client:
                while pending:
                    for name, (url, proc) in list(pending.items()):
                        if not proc.alive():
                            raise DeployError(
                                f"instance {name!r} exited with code {proc.returncode()} during start-up.\n"
                                f"Last lines of its log ({proc.log_path}):\n{proc.log_tail()}")
                        if _healthy(client, url):
                            del pending[name]
                            progress.update(tasks[name], description=f"{name}: ready at {url}", total=1,
                                            completed=1)
                        else:
                            progress.update(tasks[name], description=f"{name}: starting ({escape(_last_line(proc))})")
                    if pending and time.monotonic() - start > self.startup_timeout_s:
                        name = next(iter(pending))
                        proc = pending[name][1]
                        raise DeployError(
                            f"instance {name!r} was not healthy after {self.startup_timeout_s:.0f} s.\n"
                            f"Last lines of its log ({proc.log_path}):\n{proc.log_tail()}")
                    if pending:
                        time.sleep(0.5)


def _warm_post(client: httpx.Client, url: str, body: dict, what: str, request_id: str | None = None) -> dict:
    try:
        response = client.post(url + "/v1/completions", json=body,
                               headers={REQUEST_ID_HEADER: request_id} if request_id else None)
    except httpx.HTTPError as error:
        raise DeployError(f"{what} got no answer: {type(error).__name__}: {error}") from None
    if response.is_error:
        raise DeployError(f"{what} failed: HTTP {response.status_code}: {response.text[:500]}")
    return response.json()


def _check_lmcache_hit(inst: RunningInstance, before: float, what: str) -> None:
    """The start-up check behind every LMCache warm-up: vLLM took the warm-up prompt's KV from LMCache."""
    if figures.connector_hit_tokens(inst.url) <= before:
        raise DeployError(f"LMCache is not moving KV on {inst.name}: {what}. Every process of an LMCache deployment "
                          "needs the same PYTHONHASHSEED and chunk size (pdlab sets them). "
                          f"Last lines of its log ({inst.log_path}):\n{inst.process.log_tail()}")


def _resolved_instances(spec: DeploymentSpec, saved: dict[str, dict]) -> list[InstanceSpec]:
    return [inst.model_copy(update={"port": saved[inst.name]["port"],
                                    "nixl_side_channel_port": saved[inst.name]["nixl_side_channel_port"]})
            for inst in spec.instances]


def _healthy(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url + "/health").status_code == 200
    except httpx.HTTPError:
        return False


def _last_line(proc: ManagedProcess, width: int = 70) -> str:
    line = proc.log_tail(1).strip()
    return (line[:width] + "…") if len(line) > width else line
