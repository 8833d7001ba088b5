"""`pdlab up`, `pdlab status`, `pdlab down`: start a lab's deployment, see it, stop it (the top-level `pdlab`
command line registers these three)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

console = Console()


def load_deployment(lab: Path):  # type: ignore[no-untyped-def]
    """The main deployment of the lab spec `lab`; a bad spec prints its error (naming the fields) and exits 2."""
    from pdlab.config import ConfigError, load_lab

    try:
        return load_lab(lab).main_deployment()
    except ConfigError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=2) from None


def up(
    lab: Path = typer.Argument(..., help="Lab spec (YAML) whose deployment to start, e.g. labs/local-1p1d.yaml."),
    foreground: bool = typer.Option(False, "--foreground", "-f",
                                    help="Stay attached; Ctrl-C stops everything. Default: detach once healthy."),
    dry_run: bool = typer.Option(False, "--dry-run",
                                 help="Start nothing: print each instance's command line and environment, what "
                                      "each flag and variable does, and the router's command line."),
) -> None:
    """Start a deployment's vLLM instances (and router) and wait until they are healthy."""
    import time

    from pdlab.deploy import DeployError, Deployment

    spec = load_deployment(lab)
    dep = Deployment(spec, detached=not foreground)
    if dry_run:
        _print_dry_run(dep)
        return
    try:
        dep.start()
    except DeployError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=1) from None
    _print_deployment(dep)
    if not foreground:
        console.print(f"Up in {dep.started_s:.0f} s. Logs: {dep.run_dir}. Stop with `pdlab down {spec.name}`.")
        return
    console.print(f"Up in {dep.started_s:.0f} s. Logs: {dep.run_dir}. Press Ctrl-C to stop.")
    try:
        while all(inst.process.alive() for inst in dep.instances):
            time.sleep(1)
        console.print("[red]an instance exited; stopping the deployment[/red]")
    except KeyboardInterrupt:
        console.print("stopping ...")
    finally:
        dep.stop()


def _print_dry_run(dep) -> None:  # type: ignore[no-untyped-def]
    import shlex

    from pdlab.deploy.plan import explain, shell_line
    from pdlab.netlab import NetLabUnavailable

    try:
        planned = dep.dry_run()
    except NetLabUnavailable as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=1) from None
    for note in planned.notes:
        console.print(f"[yellow]{note}[/yellow]")
    if planned.netlab is not None:
        nodes = ", ".join(f"{name} {node['address']} ({node['netns']})"
                          for name, node in planned.netlab["nodes"].items())
        console.print(f"nodes: {nodes}; link shaped to {planned.netlab['shaped']['mbps']:g} Mbit/s")
    for plan in planned.instances:
        console.rule(f"{plan.name} ({plan.spec.role})")
        console.print(shell_line(plan), markup=False, highlight=False, soft_wrap=True)
        table = Table("kind", "name", "value", "what it does")
        table.columns[2].overflow = "fold"
        for row in explain(plan):
            table.add_row(row["kind"], row["name"], row["value"], row["meaning"])
        console.print(table)
        if plan.lmcache is not None:
            import yaml

            console.print("LMCache settings ($LMCACHE_CONFIG_FILE, computed by pdlab.lmcache.settings as for a "
                          "cluster):", highlight=False)
            console.print(yaml.safe_dump(plan.lmcache, sort_keys=False), markup=False, highlight=False)
    if planned.router is not None:
        console.rule("router")
        console.print(shlex.join(planned.router), markup=False, highlight=False, soft_wrap=True)


def _print_deployment(dep) -> None:  # type: ignore[no-untyped-def]
    table = Table("instance", "role", "url", "cores", "pid", "log")
    for inst in dep.instances:
        table.add_row(inst.name, inst.spec.role, inst.url, ",".join(map(str, inst.spec.cores)) or "-",
                      str(inst.pid), str(inst.log_path))
    if dep.router is not None:
        table.add_row("router", "router", dep.router_url, "-", str(dep.router.pid), str(dep.router.log_path))
    console.print(table)


def status(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Show deployments started with `pdlab up`, and whether each process is alive and healthy."""
    import httpx

    from pdlab.deploy import state

    records = state.load_all()
    rows = []
    for record in records:
        for entry in record["processes"]:
            alive = state.process_alive(entry)
            try:
                healthy = alive and httpx.get(entry["url"] + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                healthy = False
            rows.append({"deployment": record["name"], **entry, "alive": alive, "healthy": healthy})
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        console.print("No deployments are up. Start one with `pdlab up labs/local-1p1d.yaml`.")
        return
    table = Table("deployment", "process", "role", "url", "pid", "alive", "healthy")
    for row in rows:
        table.add_row(row["deployment"], row["name"], row["role"], row["url"], str(row["pid"]),
                      "yes" if row["alive"] else "[red]no[/red]", "yes" if row["healthy"] else "[red]no[/red]")
    console.print(table)


def restart(
    name: str = typer.Argument(..., help="Deployment started with `pdlab up`."),
    instance: str = typer.Argument(..., help="Instance to restart, e.g. decode-0."),
) -> None:
    """Stop an instance's whole process group and start it again (while the rest of the deployment serves)."""
    from pdlab.deploy import DeployError, Deployment

    try:
        dep = Deployment.attach(name)
        dep.progress = True
        dep.console = console
        restarted = dep.restart(instance)
    except (DeployError, KeyError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=1) from None
    console.print(f"{name}: {instance} restarted (pid {restarted.pid}, {restarted.url})")


def down(name: str = typer.Argument(None, help="Deployment to stop (default: all started with `pdlab up`).")) -> None:
    """Stop deployments started with `pdlab up` (every process they started)."""
    from pdlab.deploy import state

    records = state.load_all() if name is None else [r for r in [state.load(name)] if r]
    if name is not None and not records:
        console.print(f"No deployment named {name!r} is up.")
        raise typer.Exit(code=1)
    for record in records:
        with console.status(f"stopping {record['name']} ..."):
            state.stop(record)
        console.print(f"{record['name']}: stopped")
