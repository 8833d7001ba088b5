"""`pdlab netlab ...`."""

from __future__ import annotations

import json
import signal
import sys

import typer
from rich.console import Console

from pdlab.config import ConfigError, LinkSpec, validate
from pdlab.netlab.iproute import IprouteError, NetLabUnavailable, unavailable_reason
from pdlab.netlab.presets import PRESET_LINKS

app = typer.Typer(help="Network namespaces and shaped links for two-node labs.", no_args_is_help=True)
console = Console(stderr=True)


def _require_netlab() -> None:
    if reason := unavailable_reason():
        console.print(f"[red]error:[/red] {reason}")
        raise typer.Exit(code=2)


@app.command("check")
def check_command(
    preset: str = typer.Option("10gbe", help=f"Link preset: {', '.join(PRESET_LINKS)} (scaled to pdlab-small)."),
    mbps: float | None = typer.Option(None, help="Shape to this many Mbit/s instead of the preset."),
    nbytes: int = typer.Option(20_000_000, "--bytes", min=1, help="Bytes to move from the prefill to the decode node."),
    run_id: str | None = typer.Option(None, help="Name the run (1-10 lowercase letters or digits); default random."),
    mover: str = typer.Option("tcp", help="tcp: Python sockets (the link's own rate); nixl: a NIXL/UCX READ, the "
                              "way vLLM moves a KV cache."),
) -> None:
    """Make a prefill and a decode node, move --bytes across the shaped link, tear down; print JSON with
    shaped_mbps, measured_mbps and leftovers (namespaces, links, qdiscs still present afterwards)."""
    from pdlab.netlab.check import check

    try:
        link = validate(LinkSpec, {"preset": preset, "mbps": mbps}, source="netlab check options")
    except ConfigError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=2) from None
    if mover not in ("tcp", "nixl"):
        console.print(f"[red]error:[/red] --mover: use tcp or nixl, not {mover!r}")
        raise typer.Exit(code=2)
    _require_netlab()
    # SIGTERM unwinds like Ctrl-C, so the namespaces are removed on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        with console.status(f"moving {nbytes:,} bytes across the shaped link ..."):
            result = check(link, nbytes, run_id=run_id, how=mover)
    except (NetLabUnavailable, ValueError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=2) from None
    except IprouteError as error:  # e.g. a kernel without tbf; everything made was removed on the way out
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=1) from None
    print(json.dumps(result, indent=2))
    if any(result["leftovers"].values()):
        console.print("[red]error:[/red] teardown left something behind (see leftovers)")
        raise typer.Exit(code=1)


@app.command("cleanup")
def cleanup_command() -> None:
    """Remove namespaces, interfaces and qdiscs left by netlab runs that are no longer alive."""
    from pdlab.netlab.topology import cleanup_stale, leftovers

    _require_netlab()
    removed = cleanup_stale()
    print(json.dumps({"removed_runs": removed, "still_present": leftovers()}, indent=2))
