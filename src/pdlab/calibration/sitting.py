"""`pdlab sim sitting`: record in one sitting everything a local profile is fitted on and validated against, then
fit it and validate it.

The simulator describes the machine it was calibrated on, at that machine's speed on the day: a 2-core laptop's
speed moves 10-20% between sessions (more on a shared machine), so calibration runs, probes and validation runs
must come from one sitting (docs/dev/simulator-calibration.md). A sitting is a fixed list of pdlab commands, each a
child process that starts and stops its own deployment:
1. the prefill probe (`pdlab bench prefill`, one request at a time on an idle instance), which the fit adds;
2. the labs, interleaved so that a drift of the machine's speed touches both sides alike: calibration run i,
   hol-blocking run i, threshold-sweep run i, for i = 1..max(calibration runs, validation runs);
3. the probes the fit holds (`pdlab bench admission` on the P/D pair and the colocated pair, `streams`,
   `transfer` in its hand-driven conditions), then a short prefill probe, the speed check: its times against the
   first probe's say how far the machine's speed moved during the sitting (`speed` in the manifest);
4. the fit (`pdlab sim calibrate --from-runs` on the calibration runs with the probes, from `start`);
5. the validation (`pdlab sim validate`): the first validation runs validated, the middle ones pooled with them,
   the last beside them as the repeat (with three or more).

Everything lands in one new directory (`runs/sim-sitting/<timestamp>/` by default): `runs/`, `probes/`,
`profile.json`, `validation/`, and `sitting.json`, the manifest, rewritten after every step with each command,
its exit status and time. A step that fails, Ctrl-C or SIGTERM ends the sitting there; the manifest keeps what was
done and says `complete: false`. An existing directory is never written into.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from pdlab.environment import capture
from pdlab.load.rundir import point_dirs
from pdlab.settings import runs_dir

CALIBRATION_LAB = "sim-calibration.yaml"
VALIDATION_LABS = ("hol-blocking.yaml", "threshold-sweep.yaml")
#: Deployments the probes start: the P/D pair (with its router, for the transfer probe) and the colocated pair.
PD_LAB, PD_ROUTER_LAB, COLOCATED_LAB = "local-1p1d.yaml", "local-1p1d-router.yaml", "local-colocated.yaml"
#: The speed check's prompt lengths (a subset of `pdlab bench prefill`'s default lengths, so the first probe has
#: them too).
SPEED_LENGTHS = (64, 1024, 3000)
#: The transfer probe's conditions the fit reads (the wake-ups' spread), not the whole bench.
TRANSFER_CONDITIONS = "prefill-busy-alone,prefill-busy-together"
#: How long a child gets to stop its deployment after Ctrl-C before it is sent SIGTERM.
STOP_GRACE_S = 60.0
#: Names of the steps `run` reads the manifest's speed drift, profile and validation from.
PREFILL_PROBE, SPEED_CHECK, FIT, VALIDATION = "prefill probe", "speed check", "fit", "validation"


class SittingError(RuntimeError):
    """A sitting that cannot start (its directory exists) or a step that failed."""


@dataclass
class Step:
    """One command of the sitting. `argv` is a list, or a function of nothing that builds it when the step runs
    (the fit and the validation name run directories that exist only by then); `describe` is what a dry run
    shows for it."""

    name: str
    argv: list[str] | Callable[[], list[str]]
    output: Path
    describe: str = ""

    def command(self) -> list[str]:
        return self.argv() if callable(self.argv) else list(self.argv)

    def shown(self) -> str:
        """The command as a learner would type it (`describe` for one built only when it runs)."""
        if self.describe:
            return self.describe
        return " ".join(["pdlab", *self.command()[len(pdlab_command()):]])


def pdlab_command(*args: str | Path) -> list[str]:
    """A pdlab CLI command run by this interpreter (the same environment, whatever is on PATH)."""
    return [sys.executable, "-m", "pdlab.cli", *map(str, args)]


def scenario_dirs(run_dir: Path) -> list[Path]:
    """A lab run's scenario directories (those with measured rows), in name order."""
    found = point_dirs(run_dir)
    if not found:
        raise SittingError(f"{run_dir}: no scenario with measured rows (rows.csv); did its run fail?")
    return found


def _lab_name(lab_file: str) -> str:
    return lab_file.removesuffix(".yaml")


def plan(out: Path, *, labs_dir: Path, calibration_runs: int = 2, validation_runs: int = 3, quick: bool = False,
         evaluations: int = 3000, seeds: int = 3, start: str = "pdlab-small-fitted") -> list[Step]:
    """The sitting's steps, in order (module docstring)."""
    if calibration_runs < 1 or validation_runs < 1:
        raise SittingError("a sitting needs at least one calibration run and one validation run of each lab")
    runs, probes = out / "runs", out / "probes"
    quick_flag = ["--quick"] if quick else []
    # Quick: the probes the fit holds taken once each, for a trial of the procedure. The prefill probes keep their
    # repeats: the speed check compares their fastest times, and one sample each moved it by a third.
    few = ["--repeats", "1"] if quick else []
    prefill, speed = probes / "prefill.json", probes / "speed-check.json"
    steps = [Step(PREFILL_PROBE, pdlab_command("bench", "prefill", labs_dir / COLOCATED_LAB, "--out", prefill),
                  prefill)]
    lab_runs: dict[str, list[Path]] = {}
    for i in range(1, max(calibration_runs, validation_runs) + 1):
        labs = ([CALIBRATION_LAB] if i <= calibration_runs else []) + \
            (list(VALIDATION_LABS) if i <= validation_runs else [])
        for lab in labs:
            run_dir = runs / f"{_lab_name(lab)}-{i}"
            lab_runs.setdefault(lab, []).append(run_dir)
            steps.append(Step(f"{_lab_name(lab)} run {i}",
                              pdlab_command("run", labs_dir / lab, "--out", run_dir, *quick_flag), run_dir))
    admission = [probes / "admission-pd.json", probes / "admission-colocated.json"]
    streams, transfer = probes / "streams.json", probes / "transfer.json"
    steps += [
        Step("admission probe (P/D pair)",
             pdlab_command("bench", "admission", labs_dir / PD_LAB, *few, "--out", admission[0]), admission[0]),
        Step("admission probe (colocated pair)",
             pdlab_command("bench", "admission", labs_dir / COLOCATED_LAB, *few, "--out", admission[1]),
             admission[1]),
        Step("streams probe", pdlab_command("bench", "streams", labs_dir / PD_LAB, *few, "--out", streams), streams),
        Step("transfer probe", pdlab_command("bench", "transfer", labs_dir / PD_ROUTER_LAB, "--conditions",
                                             TRANSFER_CONDITIONS, *few, "--out", transfer), transfer),
        Step(SPEED_CHECK, pdlab_command("bench", "prefill", labs_dir / COLOCATED_LAB, "--lengths",
                                          ",".join(map(str, SPEED_LENGTHS)), "--out", speed), speed),
    ]
    profile, validation = out / "profile.json", out / "validation"
    calibration = lab_runs[CALIBRATION_LAB]

    def fit_argv() -> list[str]:
        dirs = [d for run_dir in calibration for d in scenario_dirs(run_dir)]
        return pdlab_command("sim", "calibrate", "--from-runs", *dirs, "--prefill-probe", prefill,
                             *[arg for a in admission for arg in ("--admission-probe", a)],
                             "--streams-probe", streams, "--transfer-probe", transfer, "--start", start,
                             "--seeds", str(seeds), "--evaluations", str(evaluations), "--out", profile)

    def validate_argv() -> list[str]:
        first, pooled, repeat = [], [], []
        for lab in VALIDATION_LABS:
            each = lab_runs[lab]
            first += scenario_dirs(each[0])
            middle, last = (each[1:-1], each[-1:]) if len(each) >= 3 else (each[1:], [])
            pooled += [d for run_dir in middle for d in scenario_dirs(run_dir)]
            repeat += [d for run_dir in last for d in scenario_dirs(run_dir)]
        return pdlab_command("sim", "validate", *first, *[arg for d in pooled for arg in ("--pool", d)],
                             *[arg for d in repeat for arg in ("--repeat", d)], "--profile", profile,
                             "--out", validation)

    steps += [
        Step(FIT, fit_argv, profile,
             describe=f"pdlab sim calibrate --from-runs {' '.join(f'{d}/*/' for d in calibration)} "
                      f"--prefill-probe {prefill} --admission-probe ... --streams-probe {streams} "
                      f"--transfer-probe {transfer} --start {start} --seeds {seeds} --evaluations {evaluations} "
                      f"--out {profile}"),
        Step(VALIDATION, validate_argv, validation,
             describe="pdlab sim validate " + " ".join(f"{lab_runs[lab][0]}/*/" for lab in VALIDATION_LABS)
                      + " --pool (the middle runs) --repeat (the last, with three or more)"
                      + f" --profile {profile} --out {validation}"),
    ]
    return steps


def _speed_drift(first: Path, last: Path) -> dict[str, Any] | None:
    """Prefill time per length at the end of the sitting against its start (`pdlab bench prefill` JSONs)."""
    try:
        before = {p["prompt_tokens"]: p["ttft_s"] for p in json.loads(first.read_text())["points"]}
        after = {p["prompt_tokens"]: p["ttft_s"] for p in json.loads(last.read_text())["points"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    common = sorted(set(before) & set(after))
    if not common:
        return None
    ratios = {str(n): after[n] / before[n] for n in common}
    return {"ratio_end_to_start": ratios,
            "speed_drift_pct": max(abs(r - 1.0) for r in ratios.values()) * 100}


def _run_child(argv: list[str]) -> int:
    """Run one step's command in the foreground. On Ctrl-C the child (in our process group) gets the SIGINT too
    and stops its deployment: wait for it to finish doing so (SIGTERM after `STOP_GRACE_S`), then stop. A SIGTERM
    to the sitting is passed on to the child and ends the sitting the same way."""
    child = subprocess.Popen(argv)

    def pass_on(signum: int, frame: object) -> None:
        child.send_signal(signal.SIGTERM)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, pass_on)
    try:
        return child.wait()
    except KeyboardInterrupt:
        try:
            child.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGTERM)
            child.wait()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(steps: Sequence[Step], out: Path, *, console: Console | None = None,
        run_child: Callable[[list[str]], int] = _run_child) -> dict[str, Any]:
    """Run the steps in order into the new directory `out`, rewriting `out/sitting.json` after each; return the
    manifest. Stops at the first step that fails (exit status not 0) or at Ctrl-C (re-raised after the manifest
    is written)."""
    console = console or Console()
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise SittingError(f"{out} already exists and is not empty; a sitting never writes into earlier results "
                           "(choose another --out)")
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"sitting": str(out), "started": datetime.now().isoformat(timespec="seconds"),
                                "complete": False, "steps": [], "environment": capture()}
    path = out / "sitting.json"
    outputs = {step.name: step.output for step in steps}

    def save() -> None:
        path.write_text(json.dumps(manifest, indent=2, default=str) + "\n")

    save()
    try:
        for number, step in enumerate(steps, 1):
            argv = step.command()
            console.rule(f"[bold]{number}/{len(steps)}: {step.name}[/bold]")
            console.print(" ".join(str(a) for a in argv), style="dim", soft_wrap=True)
            began = time.monotonic()
            record = {"name": step.name, "argv": argv, "output": str(step.output),
                      "started": datetime.now().isoformat(timespec="seconds")}
            manifest["steps"].append(record)
            save()
            code = run_child(argv)
            record.update(exit_status=code, seconds=round(time.monotonic() - began, 1))
            save()
            if code != 0:
                manifest["stopped"] = f"step {step.name!r} exited with status {code}"
                save()
                raise SittingError(f"{step.name} failed (exit status {code}); the sitting stopped there. What it "
                                   f"recorded so far: {path}")
    except KeyboardInterrupt:
        manifest["stopped"] = "interrupted (Ctrl-C or SIGTERM)"
        save()
        raise
    finally:
        if PREFILL_PROBE in outputs and SPEED_CHECK in outputs and \
                (drift := _speed_drift(outputs[PREFILL_PROBE], outputs[SPEED_CHECK])):
            manifest["speed"] = drift
        manifest["finished"] = datetime.now().isoformat(timespec="seconds")
        save()
    manifest["complete"] = True
    manifest.update({key: str(outputs[name]) for key, name in (("profile", FIT), ("validation", VALIDATION))
                     if name in outputs})
    save()
    return manifest


def default_out() -> Path:
    """`runs/sim-sitting/<timestamp>/` (where `pdlab run` puts its runs)."""
    return runs_dir() / "sim-sitting" / datetime.now().strftime("%Y%m%d-%H%M%S")
