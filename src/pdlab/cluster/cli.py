"""`pdlab cluster ...`."""

from __future__ import annotations

import typer

app = typer.Typer(help="Render, validate and apply the cluster tier (HyperPod, Kubernetes, scripts).",
                  no_args_is_help=True)
