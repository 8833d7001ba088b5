"""`pdlab router ...` and `pdlab bench router`."""

from __future__ import annotations

import typer

app = typer.Typer(help="Run the P/D router in front of a deployment.", no_args_is_help=True)


def bench() -> None:
    """Router overhead: direct vs pdlab router vs vllm-router, side by side."""
    raise typer.Exit(code=2)
