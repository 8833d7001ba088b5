"""`pdlab sim lab`, `calibrate`, `rescale`, `fit`, `efficiency`, `validate`, `sitting`, `steps`: the calibration
wing's commands (fit the simulator to measurements, validate it against runs, preview a lab). The top-level command
line gathers them with the simulator's own (`pdlab.sim.cli`) under `pdlab sim`."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import typer
from rich.table import Column, Table

from pdlab.config.base import ConfigError
from pdlab.settings import VALIDATION_SEEDS, labs_dir
from pdlab.sim.cli import console, fmt, fmt_k, fmt_ms
from pdlab.sim.costs import DEFAULT_PREMIUM

app = typer.Typer(help="Fit and validate the simulator.", no_args_is_help=True)


@app.command("lab")
def lab_cmd(lab_path: Path = typer.Argument(..., help="A lab spec YAML (labs/*.yaml) with `scenarios`."),
            scenario: list[str] = typer.Option(None, "--scenario", help="Only this scenario (repeatable)."),
            profile: str = typer.Option(None, help="Cost profile: a shipped name, a profile JSON or `machine` "
                                        "(default: this machine's, where `pdlab sim probe` fitted one, else "
                                        "pdlab-small-fitted, fitted through the simulator on its calibration "
                                        "machine's runs)."),
            quick: bool = typer.Option(False, help="The lab's short load (`pdlab run --quick`)."),
            seeds: int = typer.Option(VALIDATION_SEEDS, min=1, help="Simulations per point, each percentile "
                                      "averaged over them."),
            as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Simulate what `pdlab run LAB.yaml` would measure (each scenario, sweep value and the baseline) on the same
    schedule, in seconds: a preview of the lab, and what `pdlab sim validate` later compares the run with."""
    from pdlab.calibration.lab import lab_profile, simulate_lab, unsimulated
    from pdlab.config import load_lab
    from pdlab.experiment.lab import LabError
    from pdlab.model import ModelError, resolve

    try:
        lab = load_lab(lab_path)
        profile, which = lab_profile(profile)
        first = next(iter(lab.scenarios.values()), None)
        model_dir = resolve(first.model.name, make=False) if first is not None else ""
        start = time.perf_counter()
        with console.status(f"simulating {lab.name} ...") as status:
            points = simulate_lab(lab, model_dir=model_dir, profile=profile, quick=quick,
                                  only=scenario or (), seeds=seeds, progress=lambda what: status.update(what))
    except (ConfigError, LabError, ModelError, ValueError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=2) from None
    if as_json:
        print(json.dumps({"lab": lab.name, "profile": profile, "profile_note": which, "quick": quick,
                          "points": points}, indent=2))
        return
    table = Table(Column("point", no_wrap=True), "class", "requests", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
                  show_edge=False,
                  title=f"{lab.name}, simulated (ms; mean of {seeds} seeds)")
    for name, point in points.items():
        for cls, metrics in point.items():
            if isinstance(metrics, dict):
                table.add_row(name, cls, str(metrics["count"]), fmt_ms(metrics["ttft_ms"].get("p50")),
                              fmt_ms(metrics["ttft_ms"].get("p99")), fmt_ms(metrics["itl_ms"].get("p50")),
                              fmt_ms(metrics["itl_ms"].get("p99")))
    console.print(table)
    if preempted := {name: point["preemptions"] for name, point in points.items() if point.get("preemptions")}:
        console.print("requests preempted (KV cache full), mean of the seeds: "
                      + ", ".join(f"{name} {count:.1f}" for name, count in preempted.items()))
    for name, why in unsimulated(lab, scenario or ()).items():
        console.print(f"{name}: not simulated ({why}).")
    events = " Timed events (instance kills) are not simulated." if lab.experiment.events else ""
    console.print(f"simulated in {time.perf_counter() - start:.1f} s; measure it with `pdlab run {lab_path}`, then "
                  f"compare with `pdlab sim validate runs/{lab.name}/RUN/SCENARIO ...`.{events}")
    console.print(which, soft_wrap=True)


@app.command("calibrate")
def calibrate_cmd(model: str = typer.Option("pdlab-small", help="Local catalog model to measure."),
                  out: Path = typer.Option(None, help="Profile JSON (default data/results/sim-profile-MODEL.json)."),
                  from_runs: bool = typer.Option(False, "--from-runs", help="Fit through the simulator on the "
                                                 "measured run directories given as arguments (scenario "
                                                 "directories of `pdlab run`) instead of measuring with torch."),
                  runs: list[Path] = typer.Argument(None, help="With --from-runs: the run directories."),
                  start: str = typer.Option(None, help="--from-runs: profile the search starts from (default: "
                                            "the shipped pdlab-small-vllm-cpu)."),
                  evaluations: int = typer.Option(3000, min=50, help="--from-runs: simulations the fit may run."),
                  prefill_probe: Path = typer.Option(None, "--prefill-probe", help="--from-runs: also fit to a "
                                                     "`pdlab bench prefill` result (single-request prefill times "
                                                     "on the real server)."),
                  admission_probe: list[Path] = typer.Option(None, "--admission-probe", help="--from-runs: take "
                                                             "the admission window per instance role from "
                                                             "`pdlab bench admission` results (held, not fitted; "
                                                             "repeatable)."),
                  streams_probe: list[Path] = typer.Option(None, "--streams-probe", help="--from-runs: take the "
                                                           "request overhead per running stream from `pdlab bench "
                                                           "streams` results (held, not fitted; repeatable)."),
                  transfer_probe: list[Path] = typer.Option(None, "--transfer-probe", help="--from-runs: take "
                                                            "the spread of a busy sender's wake-ups (coefficient "
                                                            "of variation of their gaps) from `pdlab bench "
                                                            "transfer` results (held, not fitted; repeatable)."),
                  sender_gated: bool = typer.Option(True, help="--from-runs: KV reads wait while the prefill "
                                                    "instance computes (how soon it serves them is fitted), as on "
                                                    "pdlab's CPU tier (`pdlab bench transfer`); "
                                                    "--no-sender-gated for runs whose transfers do not (RDMA)."),
                  seeds: int = typer.Option(1, min=1, help="--from-runs: simulations of each run per evaluation "
                                            "(seeds 0, 1, ...), each percentile averaged over them: slower, and less "
                                            "prone to fit one random draw."),
                  premium: str = typer.Option(DEFAULT_PREMIUM, help="--from-runs: what prices a prefill chunk "
                                              "beyond its causal pairs: `chunk_square` (each chunk's square) or "
                                              "`fresh_attention` (the pairs of chunks that start their prompt)."),
                  quick: bool = typer.Option(False, help="A smaller grid (for tests; less accurate).")) -> None:
    """Fit the local model's step costs: measured with torch (one thread), or fitted through the simulator to
    measured runs (step costs plus serving overheads and step-time variation)."""
    from pdlab.benchmarks.admission import load_windows_ms
    from pdlab.benchmarks.prefill import load_points
    from pdlab.benchmarks.streams import load_points as load_streams_points
    from pdlab.benchmarks.transfer import load_gap_cv
    from pdlab.calibration.calibrate import CalibrationGrid, calibrate, fit_to_runs
    from pdlab.calibration.validate import RunDirError
    from pdlab.settings import data_dir

    for given, option in ((prefill_probe, "--prefill-probe"), (admission_probe or None, "--admission-probe"),
                          (streams_probe or None, "--streams-probe"), (transfer_probe or None, "--transfer-probe")):
        if given is not None and not from_runs:
            console.print(f"[red]error:[/red] {option} goes with --from-runs (it is used in fitting to runs)")
            raise typer.Exit(code=2)
    if bool(from_runs) != bool(runs):
        console.print("[red]error:[/red] " + ("--from-runs needs run directories: pdlab sim calibrate --from-runs "
                                              "runs/LAB/RUN/SCENARIO ..." if from_runs else
                                              f"run directories ({runs[0]}, ...) go with --from-runs"))
        raise typer.Exit(code=2)
    if from_runs:
        try:
            probe = load_points(prefill_probe) if prefill_probe is not None else None
            windows_ms = {role: ms for path in admission_probe or () for role, ms in load_windows_ms(path).items()}
            streams = [inst for path in streams_probe or () for inst in load_streams_points(path)]
            cvs = [load_gap_cv(path) for path in transfer_probe or ()]
            with console.status(f"fitting {model} to {len(runs)} runs ...") as status:
                profile = fit_to_runs(runs, model, start=start, max_evaluations=evaluations,
                                      prefill_probe=probe, probe_source=str(prefill_probe) if probe else None,
                                      admission_ms=windows_ms or None,
                                      admission_sources=[str(path) for path in admission_probe or ()],
                                      streams_probe=streams or None,
                                      streams_sources=[str(path) for path in streams_probe or ()],
                                      sender_gated=sender_gated,
                                      sender_wake_cv=sum(cvs) / len(cvs) if cvs else None,
                                      transfer_sources=[str(path) for path in transfer_probe or ()], seeds=seeds,
                                      premium=premium, progress=lambda what: status.update(what))
        except (RunDirError, ConfigError, ValueError) as error:
            console.print(f"[red]error:[/red] {error}")
            raise typer.Exit(code=2) from None
    else:
        grid = _quick_grid() if quick else CalibrationGrid()
        with console.status(f"calibrating {model} ...") as status:
            profile = calibrate(model, grid, progress=lambda what: status.update(f"calibrating {model}: {what}"))
    out = out or data_dir() / "results" / f"sim-profile-{model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=2) + "\n")
    fitted = f"{len(profile['points'])} points" if "points" in profile else f"{len(runs)} runs"
    console.print(f"fitted {fitted}, fit error mean {profile['fit_error_pct']['mean']:.1f}% "
                  f"max {profile['fit_error_pct']['max']:.1f}%: {out}")
    if streamed := profile.get("streams_probe"):
        console.print(f"streams probe: {streamed['per_stream_ms']:.2f} ms per running stream beside what the steps "
                      "explain")
    if probed := profile.get("prefill_probe"):
        console.print(f"prefill probe: {len(probed['points'])} lengths, error mean "
                      f"{probed['error_pct']['mean']:.1f}% max {probed['error_pct']['max']:.1f}%")


@app.command("rescale")
def rescale_cmd(probe: Path = typer.Option(..., help="A `pdlab bench prefill` JSON measured on this machine, e.g. "
                                           "`pdlab bench prefill --lengths 64,256,1024,3000` (about a minute)."),
                profile: Path = typer.Option(Path("pdlab-small-fitted"), help="Fitted profile to move: a JSON "
                                             "path or a name shipped in data/catalog/profiles/."),
                out: Path = typer.Option(None, help="Profile JSON to write (default: data/results/sim-profiles/"
                                         "<profile>-speed-<timestamp>.json); never overwritten.")) -> None:
    """Move a fitted profile to this machine's speed today: its step costs and serving overheads multiplied by how
    much slower (or faster) the probe's lone prompts ran than the profile says, the prefill's attention by a factor
    of its own. Minutes instead of a sitting's 1.5 hours; the rest of the profile's shape stays the calibration
    machine's."""
    from datetime import datetime

    from pdlab.benchmarks.results import ensure_new
    from pdlab.calibration.speed import FIT_SPREAD_PCT, SpeedProbeError, rescale_profile
    from pdlab.settings import data_dir
    from pdlab.sim.scenario import resolve_profile

    try:
        path = resolve_profile(profile)
        out = out or (data_dir() / "results" / "sim-profiles"
                      / f"{path.stem}-speed-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
        ensure_new(out)
        moved = rescale_profile(path, probe, profile_name=str(profile))
    except (ConfigError, SpeedProbeError, ValueError, FileExistsError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=2) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(moved, indent=2) + "\n")
    speed = moved["speed"]
    table = Table("prompt tokens", "measured ms", "profile ms", "ratio", "after, error %",
                  title=f"{profile} on this machine: x{speed['factor']:.2f}, attention "
                        f"x{speed['attention_factor']:.2f}")
    for row in speed["points"]:
        table.add_row(f"{row['prompt_tokens']:,}", fmt_ms(row["measured_ms"]), fmt_ms(row["profile_ms"]),
                      f"{row['ratio']:.2f}", f"{row['error_after_pct']:+.1f}")
    console.print(table)
    pace = "slower" if speed["factor"] >= 1 else "faster"
    console.print(f"this machine runs {max(speed['factor'], 1 / speed['factor']):.2f}x {pace} than {profile} "
                  f"says (its prefill attention x{speed['attention_factor']:.2f}); rescaled, the probe is within "
                  f"{speed['error_after_pct']['max']:.1f}% "
                  f"(mean {speed['error_after_pct']['mean']:.1f}%): {out}\n"
                  f"use it: pdlab sim lab LAB.yaml --profile {out}")
    if speed["cpu_differences"] or speed["error_after_pct"]["max"] > FIT_SPREAD_PCT:
        why = (f"the probe ran on another CPU ({'; '.join(speed['cpu_differences'])})" if speed["cpu_differences"]
               else f"rescaled, the probe is still {speed['error_after_pct']['max']:.0f}% off")
        console.print(f"[yellow]warning:[/yellow] {why}: its costs have another shape, not only another speed, and "
                      "a rescaled profile is a rough guide here; `pdlab sim sitting` fits one for this machine")


def _quick_grid():
    from pdlab.calibration.calibrate import CalibrationGrid

    return CalibrationGrid(prefill_tokens=(64, 256), chunks=((64, 128),), decode_batches=(1, 2),
                           decode_contexts=(64, 256), repeats=1)


@app.command("fit")
def fit_cmd(table: Path = typer.Argument(..., help="CSV: prefill_tokens, prefill_context, decode_seqs, "
                                         "decode_context, step_s (one measured step per row)."),
            model: str = typer.Option(..., help="Model the steps were measured on."),
            source: str = typer.Option(..., help="Where the measurements come from."),
            out: Path = typer.Option(..., help="Profile JSON to write.")) -> None:
    """Fit a cost profile from a table of measured steps."""
    from pdlab.sim.costs import CalibrationPoint, fit_profile

    with table.open(newline="") as handle:
        rows = [row for row in csv.DictReader(line for line in handle if not line.startswith("#"))]
    try:
        points = [CalibrationPoint(int(r["prefill_tokens"]), int(r["prefill_context"]), int(r["decode_seqs"]),
                                   int(r["decode_context"]), float(r["step_s"])) for r in rows]
    except (KeyError, ValueError) as error:
        console.print(f"[red]error:[/red] {table}: bad or missing column: {error}")
        raise typer.Exit(code=2) from None
    profile = fit_profile(points, model=model, source=source)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=2) + "\n")
    console.print(f"fit error mean {profile['fit_error_pct']['mean']:.1f}% max {profile['fit_error_pct']['max']:.1f}%"
                  f": {out}")


@app.command("efficiency")
def efficiency_cmd(profiles: list[Path] = typer.Argument(..., help="GPU profiles of one GPU kind, from "
                                                        "pdlab.benchmarks.gpu_phases (data/results/gpu/*.json)."),
                   hardware: str = typer.Option(..., help="The catalog's entry for that GPU, e.g. H200-SXM-141GB."),
                   out: Path = typer.Option(None, help="JSON to write (default: data/results/gpu/efficiency-"
                                            "<hardware>-<timestamp>.json); never overwritten.")) -> None:
    """Fit the roofline's compute and memory efficiency and its per-layer overhead on measured GPU profiles, and
    show how far the roofline is from each profile's points with the fit and with the catalog's factors."""
    from datetime import datetime

    from pdlab.benchmarks.results import ensure_new
    from pdlab.calibration.efficiency import fit_efficiency, load_profiles
    from pdlab.environment import capture
    from pdlab.settings import data_dir

    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = out or data_dir() / "results" / "gpu" / f"efficiency-{hardware}-{stamp}.json"
    try:
        ensure_new(out)
        fit = fit_efficiency(load_profiles(profiles), hardware)
    except (ValueError, KeyError, OSError) as error:  # ValueError: a ConfigError too
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=2) from None
    fit.update(inputs=[str(p) for p in profiles], environment=capture())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(fit, indent=2) + "\n")
    table = Table("model", "TP", "points", "median %", "max %", "catalog's: median %", "max %",
                  title=f"roofline vs measured forward passes on {hardware} (error)")
    for row in fit["profiles"]:
        table.add_row(row["model"], str(row["tensor_parallel"]), str(row["points"]),
                      f"{row['error_pct']['median']:.1f}", f"{row['error_pct']['max']:.1f}",
                      f"{row['catalog_error_pct']['median']:.1f}", f"{row['catalog_error_pct']['max']:.1f}")
    console.print(table)
    before = fit["catalog_before"]
    console.print(f"compute efficiency {fit['compute_efficiency']:.3f} ({fit['achieved_tflops']:.0f} TFLOP/s), "
                  f"memory efficiency {fit['memory_efficiency']:.3f} ({fit['achieved_hbm_gbps']:.0f} GB/s), "
                  f"{fit['layer_overhead_us']:.1f} us per layer: error median {fit['error_pct']['median']:.1f}% "
                  f"max {fit['error_pct']['max']:.1f}% (the catalog's {before['compute_efficiency']:g} and "
                  f"{before['memory_efficiency']:g}: median {before['error_pct']['median']:.1f}% max "
                  f"{before['error_pct']['max']:.1f}%): {out}")


@app.command("validate")
def validate_cmd(runs: list[Path] = typer.Argument(..., help="Measured run directories (see docs/simulator.md)."),
                 profile: Path = typer.Option(..., help="Fitted profile from separate calibration runs: a JSON "
                                              "path or a name shipped in data/catalog/profiles/."),
                 out: Path = typer.Option(None, help="Directory for validation.json (default: a new directory under "
                                          "runs/sim-validation/)."),
                 model: str = typer.Option(None, help="Model (default: the profile's)."),
                 threshold: int = typer.Option(None, help="Override the runs' router threshold."),
                 budget: int = typer.Option(None, help="Override max_num_batched_tokens (every instance's)."),
                 repeat: list[Path] = typer.Option(None, "--repeat", help="Another measured run of the same "
                                                   "scenario (same directory name): shows how far two real runs "
                                                   "differ, next to the simulator's error. Repeatable."),
                 pool: list[Path] = typer.Option(None, "--pool", help="Another measured run of the same scenario "
                                                 "(same directory name) whose requests join it: percentiles over "
                                                 "both runs' requests, measured and simulated. Repeatable."),
                 seeds: int = typer.Option(VALIDATION_SEEDS, min=1, help="Simulations of each run (seeds 0, 1, "
                                           "...), each percentile averaged over them: the simulator's own "
                                           "percentiles rather than one random draw's."),
                 record: bool = typer.Option(False, "--record", help="Also file it under data/results/sim-validation/ "
                                             "(a new file, never overwriting one; the environment is in it).")
                 ) -> None:
    """Replay measured runs in the simulator; print and save per-metric errors and their maximum."""
    from pdlab.benchmarks import results
    from pdlab.calibration.validate import RunDirError, validate_runs
    from pdlab.settings import runs_dir
    from pdlab.sim.scenario import resolve_profile

    profile_name = profile
    try:
        profile = resolve_profile(profile)
    except ConfigError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=2) from None
    model = model or json.loads(profile.read_text())["model"]
    try:
        result = validate_runs(runs, profile, model=model, threshold=threshold, budget=budget, repeats=repeat,
                               pooled=pool, seeds=seeds)
    except RunDirError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=2) from None
    for run_result in result["runs"]:
        columns = [Column("metric", no_wrap=True), "measured", Column("95% interval", no_wrap=True), "simulated",
                   "error %"]
        if "repeat" in run_result:
            columns += ["other run", "run to run %"]
        pooled = "".join(f" + {path}" for path in run_result.get("pooled", []))
        table = Table(*columns, title=f"simulator vs measured (ms): {run_result['run']}{pooled}", show_edge=False)
        for metric, e in run_result["errors"].items():
            interval = e.get("measured_ci95")
            outside = "" if e.get("simulated_within_ci", True) else "*"
            cells = [metric.replace("_ms", ""), fmt_ms(e["measured"]),
                     f"{fmt_ms(interval[0])}-{fmt_ms(interval[1])}" if interval else "",
                     fmt_ms(e["simulated"]) + outside, fmt(e["error_pct"])]
            if "repeat" in run_result:
                cells += [fmt_ms(e.get("repeat_measured")), fmt(e.get("run_to_run_pct"))]
            table.add_row(*cells)
        console.print(table)
        if kv := run_result.get("kv_transfer_ms"):
            console.print(f"mean KV transfer: measured {fmt(kv['measured'])} ms (vLLM's NIXL metrics), simulated "
                          f"{fmt(kv['simulated'])} ms")
        if (preempted := run_result.get("preemptions")) and (preempted["measured"] or preempted["simulated"]):
            console.print(f"requests preempted (KV cache full): measured {preempted['measured']:g} (vLLM's "
                          f"counter), simulated {preempted['simulated']:.1f}")
    console.print(f"max error {fmt(result['max_error_pct'])}% (goal <= {result['goal_pct']:.0f}%), median "
                  f"{fmt(result['median_error_pct'])}%, {result['within_goal']}/{result['metrics']} metrics within "
                  "the goal")
    if sampling := result["sampling"]:
        console.print(f"the simulator lies within the measured value's 95% interval (bootstrap over the run's "
                      f"requests; * marks those outside) on {sampling['simulator_within_ci']}/{sampling['metrics']}; "
                      f"those intervals span a median {fmt(sampling['median_ci_width_pct'])}% of the value")
    if result["run_to_run"]:
        spread = result["run_to_run"]
        console.print(f"two real runs of the same load differ by median {fmt(spread['median_pct'])}%, max "
                      f"{fmt(spread['max_pct'])}% ({spread['within_goal']}/{spread['metrics']} within 10%); the "
                      f"simulator is within max(10%, that spread) on {spread['simulator_within_spread']}/"
                      f"{spread['metrics']}; the other run lies within the first's 95% interval on "
                      f"{spread['repeat_within_ci']}/{spread['metrics']}")
    if each := result["each_run"]:
        console.print(f"each of the {each['runs']} runs' own value beside the pooled one: the simulator lies between "
                      f"the lowest and the highest of them on {each['simulator_between']}/{each['metrics']}, within "
                      f"10% or between them on {each['within_goal_or_between']}/{each['metrics']}")
    from pdlab.environment import capture

    result["command"] = "pdlab sim validate " + " ".join(
        [str(r) for r in runs] + [f"--pool {r}" for r in pool or []] + [f"--repeat {r}" for r in repeat or []]
        + [f"--profile {profile_name}", f"--seeds {seeds}"])
    result["profile"] = str(profile_name)  # as given (a shipped name stays portable across checkouts)
    result["environment"] = capture()
    out = out or results.new_path(runs_dir() / "sim-validation", results.stamp())
    out.mkdir(parents=True, exist_ok=True)
    (out / "validation.json").write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"written: {out / 'validation.json'}")
    if record:
        recorded = results.record("sim-validation", out / "validation.json", f"{results.stamp()}.json")
        console.print(f"recorded: {recorded}")


@app.command("sitting")
def sitting_cmd(out: Path = typer.Option(None, help="A new directory for everything the sitting records (default: "
                                          "runs/sim-sitting/<timestamp>/)."),
                calibration_runs: int = typer.Option(2, min=1, help="Runs of labs/sim-calibration.yaml (fitted on)."),
                validation_runs: int = typer.Option(3, min=1, help="Runs of each validation lab (hol-blocking, "
                                                    "threshold-sweep): the first validated, the middle pooled with "
                                                    "it, the last (from three on) the repeat beside it."),
                quick: bool = typer.Option(False, help="The labs' short loads: a trial of the whole procedure, "
                                           "too few requests for a profile worth keeping."),
                evaluations: int = typer.Option(3000, min=50, help="Simulations the fit may run."),
                seeds: int = typer.Option(3, min=1, help="Simulations of each run per fit evaluation."),
                start: str = typer.Option("pdlab-small-fitted", help="Profile the fit starts from."),
                dry_run: bool = typer.Option(False, "--dry-run", help="Print the commands and stop.")) -> None:
    """Calibrate the simulator to this machine: record calibration runs, probes and validation runs in one
    sitting (about 1.5 hours on 2 cores with the defaults), then fit a profile and validate it."""
    from pdlab.calibration.sitting import SittingError, default_out, plan
    from pdlab.calibration.sitting import run as run_sitting

    out = out or default_out()
    try:
        steps = plan(out, labs_dir=labs_dir(), calibration_runs=calibration_runs, validation_runs=validation_runs,
                     quick=quick, evaluations=evaluations, seeds=seeds, start=start)
    except SittingError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=2) from None
    if dry_run:
        for number, step in enumerate(steps, 1):
            console.print(f"{number:2d}. {step.name}: {step.shown()}", soft_wrap=True)
        return
    try:
        manifest = run_sitting(steps, out, console=console)
    except SittingError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=1) from None
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted:[/yellow] what was recorded is in {out} (sitting.json says which "
                      "steps ran)")
        raise typer.Exit(code=130) from None
    if speed := manifest.get("speed"):
        drift = speed["speed_drift_pct"]
        colour = "yellow" if drift > 10 else "green"
        console.print(f"[{colour}]the machine's prefill speed moved {drift:.0f}% from the sitting's start to its "
                      f"end[/{colour}]" + (": its runs are less comparable than one steady sitting's" if drift > 10
                                           else ""))
    console.print(f"profile: {manifest['profile']}\nvalidation: {manifest['validation']}/validation.json\n"
                  f"use it: pdlab sim validate ... --profile {manifest['profile']}, or a sim spec's "
                  "`profile:`")


@app.command("steps")
def steps_cmd(runs: list[Path] = typer.Argument(..., help="Measured run directories whose tokens one instance "
                                                "streamed (a 1P1D run, or one colocated instance)."),
              profile: Path = typer.Option(..., help="Fitted profile: a JSON path or a shipped name."),
              model: str = typer.Option(None, help="Model (default: the profile's)."),
              gap_ms: float = typer.Option(4.0, help="Tokens closer than this are one step."),
              as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables.")) -> None:
    """Read a run's decode steps back from its streamed tokens, and the simulator's for the same arrivals: per
    batch size, the steps each side took, how long, and the profile's price for the measured ones."""
    from pdlab.calibration.steps import steps_of_run
    from pdlab.calibration.validate import RunDirError
    from pdlab.sim.scenario import resolve_profile

    try:
        profile = resolve_profile(profile)
        model = model or json.loads(profile.read_text())["model"]
        results = [steps_of_run(run, profile, model=model, gap_s=gap_ms / 1e3) for run in runs]
    except (ConfigError, RunDirError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=2) from None
    if as_json:
        print(json.dumps(results, indent=2))
        return
    for result in results:
        headers = ("batch", "n", "tok", "ctx", "ms", "model", "sim n", "sim tok", "sim ctx", "sim ms")
        table = Table(*(Column(h, no_wrap=True) for h in headers), show_edge=False, pad_edge=False,
                      title=f"decode steps, measured vs simulated: {result['run']}")
        for group in result["groups"]:
            m, s = group["measured"], group["simulated"]
            if not (m["steps"] or s["steps"]):
                continue
            table.add_row(group["batch"], str(m["steps"]), str(m["tokens"]), fmt_k(m["context_median"]),
                          fmt_ms(m["step_ms_median"]), fmt_ms(group["model_ms_median"]), str(s["steps"]),
                          str(s["tokens"]), fmt_k(s["context_median"]), fmt_ms(s["step_ms_median"]))
        console.print(table)
    console.print("n: steps with the same sequences as the step before; tok: their tokens; ctx and ms: median "
                  "context (summed over the batch) and duration; model: the profile's median price for the measured "
                  "steps. Where ms and model agree the profile prices the steps right; where the tokens per batch "
                  "size differ the simulation formed other batches.")


@app.command("published")
def published_cmd(setups: list[Path] = typer.Argument(None, help="Published setups (default: every "
                                                      "labs/sim/published/*.yaml)."),
                  out: Path = typer.Option(None, help="JSON to write every point and summary to (default: a new "
                                           "file under runs/sim-published/)."),
                  record: bool = typer.Option(False, "--record", help="Also file it under data/results/sim-published/ "
                                              "(a new file)."),
                  detail: bool = typer.Option(True, help="Print every point (--no-detail: one line per setup).")
                  ) -> None:
    """Simulate the P/D papers' published setups (labs/sim/published/) and print each point's error beside its
    published figure: how far the GPU tier is from measurements it was not fitted on."""
    from pdlab.benchmarks import results
    from pdlab.calibration.published import load_setup, validate_setup
    from pdlab.environment import capture
    from pdlab.model.catalog import load_catalog
    from pdlab.settings import repo_root, runs_dir

    paths = setups or sorted((repo_root() / "labs" / "sim" / "published").glob("*.yaml"))
    try:
        results.ensure_new(out)
        catalog = load_catalog()
        compared = [validate_setup(load_setup(path), catalog) for path in paths]
    except (ConfigError, ValueError, FileExistsError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=2) from None
    summary = Table("setup", "points", "median error %", "max %", "within 10%", show_edge=False,
                    title="simulated vs published (labs/sim/published/)")
    for result in compared:
        if detail:
            table = Table("measure", "prompt", "batch", "published ms", "simulated ms", "error %", "note",
                          title=f"{result['name']}: {result['hardware']}, {result['model']}", show_edge=False)
            for row in result["points"]:
                table.add_row(row["measure"].removesuffix("_ms"), f"{row['prompt_tokens']:,}", str(row["batch"]),
                              fmt_ms(row["published_ms"]), fmt_ms(row["simulated_ms"]), f"{row['error_pct']:+.1f}",
                              row["note"][:30])
            console.print(table)
        summary.add_row(result["name"], str(result["count"]), f"{result['median_error_pct']:.1f}",
                        f"{result['max_error_pct']:.1f}", f"{result['within_10pct']}/{result['count']}")
    console.print(summary)
    out = out or results.new_path(runs_dir() / "sim-published", f"{results.stamp()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "pdlab sim published " + " ".join(map(str, paths)), "setups": compared,
                               "environment": capture(include_busy=False)}, indent=1) + "\n")
    console.print(f"written: {out}")
    if record:
        console.print(f"recorded: {results.record('sim-published', out, f'{results.stamp()}.json')}")


@app.command("probe")
def probe_cmd(lab: Path = typer.Option(Path("labs/local-1p1d-router.yaml"), help="Lab whose deployment (a prefill "
                                       "and a decode instance with a router) the probe brings up."),
              deployment: str = typer.Option(None, help="Probe this running `pdlab up` deployment (a prefill and a "
                                             "decode instance with a router) instead of starting the lab's."),
              start: str = typer.Option("pdlab-small-fitted", help="Profile the fit moves to this machine."),
              from_probe: Path = typer.Option(None, "--from", help="Fit a recorded probe.json instead of measuring."),
              out: Path = typer.Option(None, help="Directory to write probe.json and profile.json (default: "
                                       "runs/sim-probe/<timestamp>/)."),
              record: bool = typer.Option(False, "--record", help="Also file both under data/results/sim-probe/ (a new "
                                          "directory named as the probe's)."),
              quick: bool = typer.Option(False, help="Fewer, shorter points (a trial of the procedure, for tests).")
              ) -> None:
    """Measure this machine in about three minutes (lone prefills, decode steps at several batches and contexts,
    mixed steps, the KV transfer beside an idle and a busy sender) and fit its profile: the shipped one rescaled
    where its shape holds, its terms refitted where not. `pdlab sim lab` uses it from then on."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from pdlab.benchmarks import results
    from pdlab.benchmarks.prefill import ProbeError
    from pdlab.calibration.machine import MachineFitError, fit_and_write, load_probe
    from pdlab.calibration.probe import measure
    from pdlab.sim.scenario import probe_dir, resolve_profile

    out = out or results.new_path(probe_dir(), results.stamp())
    try:
        resolve_profile(Path(start))  # a wrong name costs nothing
        if from_probe is not None:
            probe = load_probe(from_probe)
        else:
            where = f"deployment {deployment}" if deployment else f"{lab}'s deployment"
            console.print(f"probing this machine: {where}, then about a minute and a half of requests")
            with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                          console=console) as bar:
                task = bar.add_task("starting the deployment", total=1.0)
                probe = measure(lab, deployment=deployment, console=console, quick=quick,
                                progress=lambda what, done: bar.update(task, description=what, completed=done))
            up = f" (deployment up in {probe['startup_s']:.0f} s)" if not deployment else ""
            console.print(f"measured in {probe['total_s']:.0f} s{up}")
        written = fit_and_write(probe, start=start, out=out, probe_path=from_probe, record=record)
    except (ProbeError, MachineFitError, ConfigError, FileExistsError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=1) from None
    _print_machine_fit(written["profile"])
    console.print("written: " + ", ".join(written["paths"]) + "\n`pdlab sim lab LAB.yaml` now uses this machine's "
                  "profile (`--profile machine` anywhere a profile is named)")


def _print_machine_fit(profile: dict) -> None:
    machine = profile["machine"]
    table = Table("part", "point", "measured ms", f"{machine['from']} ms", "this machine ms", "error %",
                  title="the probe, priced before and after the fit", show_edge=False)
    for group, label in (("decode", lambda p: f"batch {p['batch']}, context {p['context_tokens']:,}"),
                         ("prefill", lambda p: f"{p['prompt_tokens']:,} tokens")):
        for point in machine[group]["points"]:
            table.add_row(f"{group} step" if group == "decode" else "lone prompt", label(point),
                          fmt_ms(point["measured_ms"]), fmt_ms(point["before_ms"]), fmt_ms(point["after_ms"]),
                          f"{point['error_after_pct']:+.1f}")
    for point in machine["mixed"]:
        table.add_row("mixed step", f"{point['chunk_tokens']:,} beside {point['streams']}",
                      fmt_ms(point["measured_ms"]), "", fmt_ms(point["priced_ms"]), f"{point['error_pct']:+.1f}")
    console.print(table)
    for group, what in (("decode", "decode step (its constant, per sequence, per context token)"),
                        ("prefill", "prefill (per token, per attention pair, per chunk square)")):
        fit = machine[group]
        factors = (f"x{fit['factor']:.2f}" + (f", attention x{fit['attention_factor']:.2f}"
                                              if fit.get("attention_factor", fit["factor"]) != fit["factor"] else ""))
        console.print(f"{what}: {fit['decision']} ({factors}; one factor left the probe within "
                      f"{fit['rescaled_error_pct']['max']:.1f}%, the fit within {fit['error_after_pct']['max']:.1f}%)")
    transfer = machine["transfer"]
    if "bandwidth_gbps" in transfer:
        console.print(f"loopback beside an idle sender: {transfer['bandwidth_gbps']:.1f} Gbit/s"
                      + (f"; a busy sender served reads every {transfer['sender_wake_ms']:.0f} ms on average (CV "
                         f"{transfer['sender_wake_cv']:.2f}, {transfer['sender_gaps']} gaps)"
                         if "sender_wake_ms" in transfer else "; too few busy-sender gaps seen: kept the profile's"))
