"""`pdlab model ...`: make and list the local models."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

console = Console()
app = typer.Typer(help="Make and list the local models.", no_args_is_help=True)


@app.command("make")
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


@app.command("list")
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
