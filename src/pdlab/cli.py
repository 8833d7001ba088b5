"""The `pdlab` command line."""

from __future__ import annotations

import json
from pathlib import Path

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


# --- course: `pdlab bench phases` (the measurements of notebook 01, recorded) ---
@bench_app.command("phases")
def bench_phases(
    model: str = typer.Option("pdlab-small", help="Catalog model or model directory."),
    lengths: str = typer.Option("4,16,64,256,1024,2048", help="Prefill prompt lengths, comma-separated."),
    batches: str = typer.Option("1,2,4,8,16,32", help="Decode batch sizes, comma-separated."),
    contexts: str = typer.Option("128,1024,4096", help="Decode context lengths, comma-separated."),
    repeats: int = typer.Option(5, min=1, help="Timed runs per point (the median is kept)."),
    out_dir: Path = typer.Option(None, "--out-dir", help="Where to write the JSON (default: data/results/)."),
) -> None:
    """Prefill time vs prompt length, decode step time vs batch and context, and this CPU's single-thread roof."""
    import time

    from pdlab import phases
    from pdlab.settings import data_dir

    def ints(text: str, option: str) -> list[int]:
        try:
            return [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise typer.BadParameter(f"{text!r}: want comma-separated integers", param_hint=option) from None

    with console.status(f"measuring prefill and decode of {model} on one thread ..."):
        record = phases.benchmark(model, ints(lengths, "--lengths"), ints(batches, "--batches"),
                                  ints(contexts, "--contexts"), repeats=repeats)
    out = (out_dir or data_dir() / "results") / f"phases-{Path(model).name}-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    console.print(f"wrote {out}")
