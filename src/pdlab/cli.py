"""The `pdlab` command line."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from pdlab.cluster.cli import app as cluster_app
from pdlab.netlab.cli import app as netlab_app
from pdlab.router.cli import app as router_app
from pdlab.sim.cli import app as sim_app

console = Console()
app = typer.Typer(help="pdlab: disaggregated prefill/decode serving, for real, on your laptop.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
model_app = typer.Typer(help="Make and list the local models.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks (write JSON under data/results/).", no_args_is_help=True)
app.add_typer(model_app, name="model")
app.add_typer(bench_app, name="bench")
app.add_typer(router_app, name="router")
app.add_typer(cluster_app, name="cluster")
app.add_typer(sim_app, name="sim")
app.add_typer(netlab_app, name="netlab")


@model_app.command("make")
def model_make(
    names: list[str] = typer.Argument(None, help="Catalog models to make (default: the default model)."),
    force: bool = typer.Option(False, help="Make again even if already made."),
) -> None:
    """Make catalog models (seeded weights, trained tokenizer) into pdlab's cache."""
    from pdlab import model
    from pdlab.settings import DEFAULT_MODEL

    for name in names or [DEFAULT_MODEL]:
        try:
            already = model.is_made(name) and not force
            with console.status(f"making {name} ..."):
                path = model.make_model(name, force=force)
        except model.ModelError as error:
            console.print(f"[red]error:[/red] {error}")
            raise typer.Exit(code=2) from None
        console.print(f"{name}: {'already made' if already else 'made'} at {path}")


@model_app.command("list")
def model_list(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the model catalog and what is made."""
    from pdlab import model

    rows = [model.describe(name) for name in model.CATALOG]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table("name", "made", "parameters", "description", "path")
    for row in rows:
        params = f"{row['parameters'] / 1e6:.1f}M" if row.get("parameters") else "-"
        table.add_row(row["name"], "yes" if row["made"] else "no", params, row["description"], row["path"])
    console.print(table)


def main() -> None:
    app()
