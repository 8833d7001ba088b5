"""`pdlab run` and `pdlab demo`."""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from pdlab.load import rundir
from pdlab.settings import labs_dir

console = Console()

#: The lab `pdlab demo` runs.
DEMO_LAB = "hol-blocking.yaml"
#: Where a learner goes after the demo.
DEMO_NEXT = ("Next: `make lab` opens the course in JupyterLab; notebook 02 shows these stalls on a timeline and "
             "03 takes the deployment apart (docs/course.md).")


def _load(lab: Path):  # type: ignore[no-untyped-def]
    from pdlab.config import ConfigError, load_lab

    try:
        return load_lab(lab)
    except ConfigError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=2) from None


def _fmt(value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.1f}"
    return str(value)


#: Ratios to the baseline printed under the table: the numbers people read first.
RATIOS = (("short ITL p99 / alone", ("short", "itl_ms", "p99")),
          ("short TTFT p99 / alone", ("short", "ttft_ms", "p99")))


def _dig(block: dict | None, path: tuple[str, ...]) -> float | None:
    for key in path:
        block = block.get(key) if isinstance(block, dict) else None
    return block  # type: ignore[return-value]


def print_comparison(run_dir: Path, quick: bool = False) -> None:
    """The headline figures of a run, scenarios side by side, each scenario's short-request ITL p99 and TTFT p99 as
    multiples of the baseline's (the short requests alone), and the verdict in words."""
    from pdlab.metrics.kv import lmcache_line, reuse_line
    from pdlab.report import headline_table, verdict

    summary = rundir.read_summary(run_dir)
    frame = headline_table(summary)
    table = Table("figure", *frame.columns, title=f"{summary.get('lab')}: {run_dir}")
    for label, row in frame.iterrows():
        cells = [f"{v:.0%}" if "share" in str(label) and isinstance(v, float) and not math.isnan(v) else _fmt(v)
                 for v in row.tolist()]
        table.add_row(str(label), *cells)
    baseline = summary.get("baseline")
    for label, path in RATIOS:
        base = _dig(baseline, path)
        if base:
            ratios = [_dig(block, path) for block in summary["scenarios"].values()]
            table.add_row(label, *[f"{r / base:.1f}x" if r else "-" for r in ratios], "1.0x" if baseline else "")
    console.print(table)
    for name, kv in (summary.get("kv_transfer") or {}).items():
        if kv.get("transfers"):
            console.print(f"{name}: NIXL moved {kv['bytes'] / 2**20:,.1f} MiB of KV cache in {kv['transfers']:g} "
                          f"transfers (mean {kv['mean_xfer_ms']:.1f} ms each), prefill instance -> decode instance")
        if reuse := reuse_line(kv):
            console.print(f"{name}: {reuse}")
        if pushed := lmcache_line(kv):
            console.print(f"{name}: {pushed}")
        if kv.get("preemptions"):
            console.print(f"{name}: vLLM preempted {kv['preemptions']:g} requests: the KV cache ran out, and each "
                          "computed its prompt and tokens again")
    lines = verdict(summary)
    if lines:
        console.print("[bold]Verdict[/bold]" + (" (a quick run: short loads, rough figures)"
                                                 if quick else ""))
        for line in lines:
            console.print(f"  {line}")
    if not summary.get("complete"):
        console.print("[yellow]This run is incomplete: it was interrupted; figures cover what was measured.[/yellow]")


def _fail(error: Exception) -> typer.Exit:
    console.print(f"[red]error:[/red] {error}")
    return typer.Exit(code=1)


def _report(run_dir: Path, record: bool, quick: bool, next_steps: str = "") -> None:
    """What every run prints at its end: the comparison and verdict, where the run is, where to look next, and
    where it was recorded."""
    from pdlab.experiment.lab import record_run

    print_comparison(run_dir, quick)
    console.print(f"Run directory: {run_dir}\nReport (open it in a browser): {run_dir / 'report.html'}")
    if next_steps:
        console.print(next_steps)
    if record:
        console.print(f"Recorded: {record_run(run_dir)}")


def run(
    lab: Path = typer.Argument(..., help="Lab spec (YAML) with scenarios and a workload."),
    quick: bool = typer.Option(False, help="Short loads (the lab's quick_requests or quick_duration_s), for a "
                               "first look or CI."),
    duration: float = typer.Option(None, help="Load duration in seconds, overriding the lab's."),
    only: list[str] = typer.Option(None, help="Run only these scenarios (repeatable)."),
    out: Path = typer.Option(None, help="Run directory to write (default: runs/<lab>/<timestamp>/)."),
    record: bool = typer.Option(False, help="Also copy summary and environment to data/results/<lab>/<run>/."),
    url: str = typer.Option(None, help="Send the lab's workload to this running endpoint (e.g. a cluster's router, "
                            "see docs/cluster.md) instead of deploying its scenarios; needs --model and --tokenizer."),
    model: str = typer.Option(None, help="--url: the served model's name (e.g. meta-llama/Llama-3.1-8B-Instruct)."),
    tokenizer: Path = typer.Option(None, help="--url: a directory with the model's tokenizer.json."),
    scenario: str = typer.Option("endpoint", help="--url: the scenario name the measurement is recorded under."),
) -> None:
    """Run a lab: each scenario's deployment in turn, the same workload, one run directory with a report."""
    from pdlab.deploy import DeployError
    from pdlab.experiment.lab import LabError, run_at_url, run_lab

    spec = _load(lab)
    try:
        if url is not None:
            missing = [flag for flag, value in (("--model", model), ("--tokenizer", tokenizer)) if value is None]
            if missing:
                raise LabError(f"--url needs {' and '.join(missing)}: the served model's name and a directory with "
                               "its tokenizer.json, to build prompts of exact token counts")
            if not (tokenizer / "tokenizer.json").is_file():
                raise LabError(f"--tokenizer {tokenizer}: no tokenizer.json there (fetch it with huggingface_hub."
                               "snapshot_download(MODEL, allow_patterns=['tokenizer*', 'config.json']))")
            run_dir = run_at_url(spec, url, model=model, model_dir=tokenizer, scenario=scenario, quick=quick,
                                 duration_s=duration, run_dir=out)
        else:
            run_dir = run_lab(spec, quick=quick, duration_s=duration, only=only or None, run_dir=out,
                              console=console)
    except (LabError, DeployError, FileExistsError) as error:
        raise _fail(error) from None
    _report(run_dir, record, quick)


def demo(
    out: Path = typer.Option(None, help="Write the run (summary.json, report.html, ...) into this directory."),
    quick: bool = typer.Option(False, help="Short loads, for a first look."),
    record: bool = typer.Option(False, help="Also copy summary and environment to data/results/hol-blocking/<run>/."),
) -> None:
    """The lab's headline: short requests freeze behind long prompts when colocated, and flow when prefill and
    decode are disaggregated. Runs labs/hol-blocking.yaml's headline scenarios (its `experiment.demo_scenarios`;
    about 11 minutes on 2 cores); `pdlab run labs/hol-blocking.yaml` runs them all."""
    from pdlab.deploy import DeployError
    from pdlab.experiment.lab import LabError, run_lab

    spec = _load(labs_dir() / DEMO_LAB)
    try:
        run_dir = run_lab(spec, quick=quick, run_dir=out, console=console,
                          only=spec.experiment.demo_scenarios or None)
    except (LabError, DeployError, FileExistsError) as error:
        raise _fail(error) from None
    _report(run_dir, record, quick, DEMO_NEXT)
