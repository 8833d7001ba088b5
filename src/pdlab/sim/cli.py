"""`pdlab sim run` and `pdlab sim search`: the simulator's own commands (a sim spec in, a summary out). The
calibration wing (`pdlab.calibration.cli`) adds the commands that fit and validate it; the top-level command line
gathers both under `pdlab sim`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
import yaml
from rich.console import Console
from rich.table import Table

from pdlab.config.base import ConfigError

app = typer.Typer(help="Simulate P/D serving at cluster scale.", no_args_is_help=True)
console = Console()
PROFILE_HELP = ("Price steps with this profile instead of the spec's: a JSON path or a shipped name (e.g. "
                "Llama-3.1-70B-NVIDIA-H200-tp2, measured on an H200).")


def _load_spec(path: Path, profile: Path | None = None):
    """A sim spec from YAML; `profile`, where given, replaces the spec's own."""
    from pdlab.sim.twin import load_sim_spec

    try:
        spec = load_sim_spec(path)
    except ConfigError as error:
        console.print(f"[red]error:[/red] {_lab_spec_instead(path, error)}")
        raise typer.Exit(code=2) from None
    return spec if profile is None else spec.model_copy(update={"profile": profile})


def _lab_spec_instead(path: Path, error: ConfigError) -> ConfigError:
    """`error`, or where the file is a lab spec (one that parsed, with `scenarios` or a `deployment` and no
    `pools`), where to take it instead."""
    if any(where in ("(file)", "(yaml)") for where, _ in error.problems):
        return error
    raw = yaml.safe_load(path.read_text())
    if isinstance(raw, dict) and "cluster" in raw and "pools" not in raw:
        return ConfigError(str(path), [("(top level)", "a cluster lab: `pdlab sim run` takes a sim spec that names it "
                                                       f"(`cluster_lab: {path}`) and gives a workload, such as "
                                                       "labs/sim/hyperpod-llama70b-2p2d.yaml")])
    if isinstance(raw, dict) and ("scenarios" in raw or "deployment" in raw) and "pools" not in raw:
        return ConfigError(str(path), [("(top level)", f"a lab spec (`pdlab run` measures it): `pdlab sim lab "
                                                       f"{path}` simulates its scenarios; `pdlab sim run` takes a "
                                                       "sim spec such as labs/sim/local-hol.yaml")])
    return error


def fmt(value) -> str:
    return "-" if value is None else f"{value:,.1f}"


def fmt_k(value) -> str:
    return "-" if value is None else f"{value / 1e3:.1f}k"


def fmt_ms(value) -> str:
    """Milliseconds, whole from 100 up (a table of seven columns fits 80 characters)."""
    return "-" if value is None else f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}"


@app.command("run")
def run(spec_path: Path = typer.Argument(..., help="A sim spec YAML (see docs/simulator.md)."),
        as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
        profile: Path = typer.Option(None, help=PROFILE_HELP)) -> None:
    """Simulate one spec and print its summary (same shape as a measured run's summary.json)."""
    from pdlab.sim.scenario import simulate

    spec = _load_spec(spec_path, profile)
    start = time.perf_counter()
    try:
        summary, _ = simulate(spec)
    except ValueError as error:  # a ConfigError too
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=2) from None
    summary["elapsed_s"] = time.perf_counter() - start
    worth = validated(spec)
    summary["validated"] = worth.__dict__
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    table = Table("class", "count", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "ITL max ms",
                  title=f"{spec.name}: {summary['cost_model']}")
    for cls in ("short", "long"):
        s = summary[cls]
        table.add_row(cls, str(s["count"]), fmt(s["ttft_ms"]["p50"]), fmt(s["ttft_ms"]["p99"]),
                      fmt(s["itl_ms"]["p50"]), fmt(s["itl_ms"]["p99"]), fmt(s["itl_ms"]["max"]))
    console.print(table)
    console.print(f"requests {summary['requests']}, stalls {summary['stalls']['count']}, "
                  f"goodput {summary['goodput']['rps']:.2f} req/s ({summary['goodput']['attainment']:.0%} within SLO), "
                  f"paths {summary['paths']}, preemptions {summary['preemptions']}, "
                  f"simulated in {summary['elapsed_s']:.2f} s")
    console.print(f"what these figures are worth: {worth.text}", soft_wrap=True)


@app.command("search")
def search_cmd(spec_path: Path = typer.Argument(..., help="A sim spec YAML with a `poisson` workload."),
               gpus: int = typer.Option(..., help="GPUs to split between prefill and decode."),
               find_rate: bool = typer.Option(False, help="Also find each split's highest rate meeting the SLOs."),
               target: float = typer.Option(0.9, help="SLO attainment that counts as meeting them."),
               as_json: bool = typer.Option(False, "--json", help="Print JSON."),
               profile: Path = typer.Option(None, help=PROFILE_HELP)) -> None:
    """Best prefill:decode split of N GPUs for the spec's load and SLOs (DistServe-style goodput)."""
    from pdlab.sim.search import search

    spec = _load_spec(spec_path, profile)
    try:
        result = search(spec, gpus, find_rate=find_rate, target=target)
    except ValueError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=2) from None
    worth = validated(spec)
    if as_json:
        print(json.dumps({**result, "validated": worth.__dict__}, indent=2))
        return
    table = Table("pools", "SLO attainment", "goodput req/s", "short TTFT p99", "long TTFT p99", "short ITL p99",
                  *(["max rate req/s"] if find_rate else []), title=f"{gpus} GPUs, {result['rate_rps']} req/s")
    for row in result["splits"]:
        pools = ", ".join(f"{k} {v}" for k, v in row["pools"].items())
        table.add_row(pools, f"{row['attainment']:.1%}", f"{row['goodput_rps']:.2f}", fmt(row["short_ttft_p99_ms"]),
                      fmt(row["long_ttft_p99_ms"]), fmt(row["short_itl_p99_ms"]),
                      *([f"{row['max_rate_rps']:.2f}"] if find_rate else []))
    console.print(table)
    best = result["best"]
    console.print(f"best: {', '.join(f'{k} {v}' for k, v in best['pools'].items())} "
                  f"({best['attainment']:.1%} of requests within the SLOs, {best['goodput_rps']:.2f} req/s goodput)")
    console.print(f"what these figures are worth: {worth.text}", soft_wrap=True)


def validated(spec):  # type: ignore[no-untyped-def]
    """The spec's `pdlab.sim.worth` line; a record that cannot be read says so rather than failing the run."""
    from pdlab.sim.worth import Worth, worth

    try:
        return worth(spec)
    except (OSError, ValueError, KeyError) as error:
        return Worth(False, f"not validated (the validation records could not be read: {error})")
