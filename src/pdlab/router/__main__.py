"""`python -m pdlab.router serve ...`: the router process (see pdlab.router.process.router_command)."""

from pdlab.router.cli import app

app(prog_name="python -m pdlab.router")
