"""`pdlab preflight` and `pdlab workshop ...`: thin wrappers over pdlab.workshop."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console()


def preflight(
    serve: bool = typer.Option(False, "--serve", help="Also start a real 1P1D deployment and send a request through "
                                                       "prefill -> KV transfer -> decode (about a minute)."),
    model: str = typer.Option("pdlab-small", help="The model --serve serves."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Check this seat before a workshop: platform, Python, cores, memory, disk, packages (and their tested
    versions), models, ports, leftovers (and with --serve, vLLM). Exits 1 and says what to do when a check fails."""
    from pdlab.workshop import preflight as checks

    with console.status("checking ...") as spinner:
        report = checks.run(serve=serve, serve_model=model, progress=not as_json,
                            on_check=lambda name: spinner.update(f"checking {name} ..."))
    if as_json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        mark = {"ok": "[green]ok[/green]", "warn": "[yellow]warn[/yellow]", "fail": "[red]FAIL[/red]",
                "skip": "[dim]skipped[/dim]"}
        table = Table("check", "", "found", "needed", title="pdlab pre-flight")
        for check in report.checks:
            table.add_row(check.name, mark[check.status], check.found, check.need)
        console.print(table)
        for check in report.checks:
            if check.fix:
                console.print(f"[bold]{check.name}[/bold]: {check.fix}")
        console.print("[green]Ready for the course.[/green]" if report.passed else
                      "[red]Not ready:[/red] fix the checks marked FAIL (docs/troubleshooting.md), then run again.")
    if not report.passed:
        raise typer.Exit(code=1)


app = typer.Typer(help="The workshop kit: student copies of the notebooks, answers kept apart; the course timed.",
                  no_args_is_help=True)


@app.command("student-copies")
def student_copies(force: bool = typer.Option(False, help="Write every copy again, over the work in it.")) -> None:
    """Write notebooks/student/NN-topic.ipynb: each notebook with an empty cell under each exercise, no answers.
    Copies that exist are your work and are kept."""
    from pdlab.workshop import workbook

    for path, what in workbook.write_student_copies(force=force).items():
        console.print(f"{path}: {what}")



@app.command("time")
def time_course(
    notebooks: list[str] = typer.Argument(..., help="Notebooks to run, by number (03), name (03-disaggregate) or "
                                                    "path, one after another."),
    quick: bool = typer.Option(False, "--quick", help="Quick mode (the small parameters CI uses)."),
    out: Path = typer.Option(None, help="Write here (default: a new file under runs/course-timings/)."),
    record: bool = typer.Option(False, "--record", help="Also file it under data/results/course-timings/ (a new "
                                                        "file)."),
) -> None:
    """Run course notebooks top to bottom as a learner does (a fresh kernel each, its own deployment, full
    parameters unless --quick) and time every cell; exits 1 when a notebook fails (what ran is still written)."""
    from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

    from pdlab.workshop import timing
    from pdlab.workshop.workbook import WorkbookError

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console) as bar:
        tasks: dict[str, TaskID] = {}

        def start(stem: str) -> None:
            tasks[stem] = bar.add_task(f"{stem}: starting a kernel", total=None)

        def cell(stem: str, index: int, total: int, line: str) -> None:
            bar.update(tasks[stem], description=f"{stem}: cell {index + 1}/{total}  {escape(line)}")

        def done(run: dict) -> None:
            how = f"{run['minutes']} min of cells" if run["complete"] else \
                f"[red]FAILED[/red] in cell {run['failed_cell']}: {escape(str(run['error']))}"
            bar.update(tasks[run["notebook"]], description=f"{run['notebook']}: {how}", total=1, completed=1)

        try:
            written, result = timing.time_course(notebooks, quick=quick, out=out, on_start=start, on_cell=cell,
                                                 on_done=done)
        except (FileExistsError, WorkbookError) as error:
            raise typer.BadParameter(str(error), param_hint="NOTEBOOKS / --out") from None
    console.print(f"written: {written}", soft_wrap=True)
    if record:
        console.print(f"recorded: {timing.record(written)}", soft_wrap=True)
    if not result["complete"]:
        raise typer.Exit(code=1)
