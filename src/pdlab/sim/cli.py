"""`pdlab sim ...`."""

from __future__ import annotations

import typer

app = typer.Typer(help="Simulate P/D serving at cluster scale.", no_args_is_help=True)
