"""`pdlab cluster ...`: render a cluster lab for HyperPod, Kubernetes or plain GPU hosts; apply it with kubectl."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer
from rich.console import Console

from pdlab.cluster import kubectl
from pdlab.cluster.plan import ClusterPlan, load_plan
from pdlab.cluster.render import TARGETS, Target, render, write
from pdlab.config import ConfigError
from pdlab.settings import runs_dir

app = typer.Typer(help="Render, validate and apply the cluster tier (HyperPod, Kubernetes, scripts).",
                  no_args_is_help=True)
console = Console()
err_console = Console(stderr=True)

LAB_ARG = typer.Argument(..., help="A cluster lab spec (labs/hyperpod-*.yaml).")
TARGET_HELP = f"What to render for: {', '.join(TARGETS)}."
KUBE_TARGETS = ("hyperpod", "k8s")


def _fail(message: str, code: int = 2) -> typer.Exit:
    err_console.print(f"[red]error:[/red] {message}")
    return typer.Exit(code=code)


def _target(value: str, allowed: tuple[str, ...] = TARGETS) -> Target:
    if value not in allowed:
        raise _fail(f"--target: {value!r} is not one of {', '.join(allowed)}")
    return value  # type: ignore[return-value]


def _rendered(lab: Path, target: Target, out: Path | None) -> tuple[ClusterPlan, list[Path], Path]:
    try:
        plan = load_plan(lab)
        files = render(plan, target, source=str(lab))
    except ConfigError as error:
        raise _fail(str(error)) from None
    out_dir = out or runs_dir() / "cluster" / plan.lab.name / target
    return plan, write(files, out_dir), out_dir


@app.command("render")
def render_cmd(
    lab: Path = LAB_ARG,
    target: str = typer.Option("k8s", "--target", "-t", help=TARGET_HELP),
    out: Path = typer.Option(..., "--out", "-o", help="Folder to write the files to (created)."),
) -> None:
    """Render a cluster lab's files for one target."""
    _, paths, out_dir = _rendered(lab, _target(target), out)
    console.print(f"rendered {len(paths)} file(s) for {target} into {out_dir}:")
    for path in paths:
        console.print(f"  {path.name}")


def _kubectl(lab: Path, target: str, out: Path | None, dry_run: bool, action: str) -> None:
    chosen = _target(target, KUBE_TARGETS)
    plan, _, out_dir = _rendered(lab, chosen, out)
    if action == "apply":
        argv = kubectl.apply_command(out_dir)
    elif action == "delete":
        argv = kubectl.delete_command(out_dir)
    else:
        argv = kubectl.status_command(plan.cluster.namespace, plan.cluster.endpoint_name, chosen == "hyperpod")
    if dry_run:
        print(f"# files rendered in {out_dir}; would run:")
        print(shlex.join(argv))
        return
    try:
        code = kubectl.run(argv)
    except kubectl.KubectlMissing as error:
        raise _fail(str(error), code=3) from None
    if code:
        raise typer.Exit(code=code)


DRY_RUN = typer.Option(False, "--dry-run", help="Render and print the kubectl command instead of running it.")
OUT = typer.Option(None, "--out", "-o", help="Folder for the rendered files (default: runs/cluster/LAB/TARGET).")
KUBE_TARGET = typer.Option("k8s", "--target", "-t", help="hyperpod or k8s.")


@app.command("apply")
def apply_cmd(lab: Path = LAB_ARG, target: str = KUBE_TARGET, out: Path | None = OUT, dry_run: bool = DRY_RUN) -> None:
    """Render and `kubectl apply` a cluster lab."""
    _kubectl(lab, target, out, dry_run, "apply")


@app.command("delete")
def delete_cmd(lab: Path = LAB_ARG, target: str = KUBE_TARGET, out: Path | None = OUT, dry_run: bool = DRY_RUN) -> None:
    """Render and `kubectl delete` a cluster lab's objects."""
    _kubectl(lab, target, out, dry_run, "delete")


@app.command("status")
def status_cmd(lab: Path = LAB_ARG, target: str = KUBE_TARGET, out: Path | None = OUT, dry_run: bool = DRY_RUN) -> None:
    """Show a cluster lab's objects and pods (`kubectl get`)."""
    _kubectl(lab, target, out, dry_run, "status")
