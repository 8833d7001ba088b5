"""`pdlab netlab ...`."""

from __future__ import annotations

import typer

app = typer.Typer(help="Network namespaces and shaped links for two-node labs.", no_args_is_help=True)
