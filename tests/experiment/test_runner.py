"""The experiment runner against stand-in servers: the run directory's files, summary.json's schema, fresh
directories per run, and an interrupted run marked incomplete with exact request counts."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pdlab.config import parse_workload
from pdlab.experiment.runner import ExperimentRun, read_run, run_workload
from pdlab.experiment.schema import check_summary
from pdlab.load import COLUMNS, read_rows
from pdlab.model import resolve
from tests.conftest import as_in_a_terminal
from tests.standin_process import SRC, standin

PORTS = iter(range(19200, 19300))

WORKLOAD = {"kind": "mixed", "seed": 3, "num_requests": 8, "rate": 20, "short_tokens": 16, "long_tokens": 400,
            "long_fraction": 0.25, "short_output_tokens": 12, "long_output_tokens": 3,
            "probe": {"rate": 10, "prompt_tokens": 8, "output_tokens": 4}}


def test_run_directory_files_and_summary_schema(tmp_path):
    workload = parse_workload(WORKLOAD)
    with standin(next(PORTS), "--token-ms", "2", "--prefill-us-per-token", "100", "--path-header", "direct") as url:
        run_dir = run_workload(url, workload, model="pdlab-standin", model_dir=resolve("pdlab-tiny"), lab="unit",
                               scenario="colocated", baseline=True, runs_root=tmp_path, progress=False)
        second = run_workload(url, workload, model="pdlab-standin", model_dir=resolve("pdlab-tiny"), lab="unit",
                              runs_root=tmp_path, progress=False)
    assert run_dir.parent == tmp_path / "unit" and second.parent == run_dir.parent and second != run_dir
    for name in ("environment.json", "workload.json", "summary.json", "report.html"):
        assert (run_dir / name).is_file(), name
    for scenario in ("colocated", "baseline"):
        for name in ("schedule.jsonl", "rows.csv", "locust_stats.csv", "locust.log"):
            assert (run_dir / scenario / name).is_file(), f"{scenario}/{name}"
        assert list(read_rows(run_dir / scenario / "rows.csv").columns) == list(COLUMNS)

    summary = json.loads((run_dir / "summary.json").read_text())
    check_summary(summary)
    assert summary["complete"] is True
    colocated = summary["scenarios"]["colocated"]
    scheduled = len((run_dir / "colocated" / "schedule.jsonl").read_text().splitlines())
    assert colocated["requests"]["scheduled"] == colocated["requests"]["sent"] == scheduled
    assert colocated["requests"]["completed"] == scheduled
    for key in ("p50", "p99", "max"):
        assert colocated["short"]["itl_ms"][key] is not None
    assert colocated["long"]["ttft_ms"]["p99"] is not None
    assert "long" not in summary["baseline"]  # the short requests alone
    baseline_rows = read_rows(run_dir / "baseline" / "rows.csv")
    assert set(baseline_rows["cls"]) == {"short", "probe"}
    assert set(summary["scenarios"]["colocated"]["by_path"]) == {"direct"}

    env = json.loads((run_dir / "environment.json").read_text())
    assert env["cpu_count"] >= 1 and env["packages"]["locust"]
    assert json.loads((run_dir / "workload.json").read_text())["kind"] == "mixed"
    page = (run_dir / "report.html").read_text()
    assert page.count("plotly.js v") == 1  # plotly's JS inlined once
    assert "colocated: request timeline" in page and "baseline: request timeline" in page

    back = read_run(run_dir)
    assert set(back.rows) == {"colocated", "baseline"} and back.summary == summary


INTERRUPTED = """
import sys
from pdlab.config import parse_workload
from pdlab.experiment.runner import run_workload
from pdlab.model import resolve
workload = parse_workload({"kind": "mixed", "num_requests": 40, "rate": 4, "arrival": "uniform",
                           "short_tokens": 16, "long_fraction": 0, "short_output_tokens": 40})
run_workload(sys.argv[1], workload, model="pdlab-standin", model_dir=resolve("pdlab-tiny"), lab="cut",
             runs_root=sys.argv[2], progress=False)
"""


def test_interrupted_run_is_marked_incomplete_and_counts_are_exact(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with standin(next(PORTS), "--token-ms", "50") as url:
        process = subprocess.Popen([sys.executable, "-c", INTERRUPTED, url, str(tmp_path)], env=env,
                                   stderr=subprocess.PIPE, preexec_fn=as_in_a_terminal)
        try:
            rows_file = None
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # wait until a few requests have finished
                found = list(Path(tmp_path).glob("cut/*/default/rows.csv"))
                if found and len(found[0].read_text().splitlines()) > 3:
                    rows_file = found[0]
                    break
                time.sleep(0.1)
            assert rows_file is not None, "the run never got going"
            process.send_signal(signal.SIGINT)  # what Ctrl-C in a terminal sends
            _, err = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert process.returncode != 0 and b"KeyboardInterrupt" in err

    run_dir = rows_file.parents[1]
    summary = json.loads((run_dir / "summary.json").read_text())
    check_summary(summary)
    assert summary["complete"] is False
    counts = summary["scenarios"]["default"]["requests"]
    rows = read_rows(rows_file)
    assert counts["scheduled"] == 40
    assert counts["sent"] == len(rows) < 40
    assert counts["sent"] + counts["not_sent"] == 40
    assert counts["completed"] + counts["failed"] == counts["sent"]
    assert counts["by_status"].get("interrupted", 0) >= 1  # requests in flight when it stopped
    assert (run_dir / "report.html").is_file()


def test_run_without_scenarios_leaves_an_incomplete_marker_until_finished(tmp_path):
    run = ExperimentRun("marker", parse_workload(WORKLOAD), runs_root=tmp_path, progress=False)
    assert json.loads((run.dir / "summary.json").read_text())["complete"] is False
    run.finish(complete=True)
    summary = json.loads((run.dir / "summary.json").read_text())
    check_summary(summary)
    assert summary["complete"] is True and summary["scenarios"] == {}


def test_the_baseline_records_the_deployment_it_borrowed(tmp_path):
    """The baseline runs on another scenario's deployment; its directory says which, like every scenario's does."""
    from dataclasses import dataclass, field

    @dataclass
    class RunningDeployment:  # what the runner reads of a pdlab.deploy.Deployment
        router_url: str
        run_dir: Path
        served_model: str = "pdlab-standin"
        model_dir: Path = field(default_factory=lambda: resolve("pdlab-tiny"))
        instances: list = field(default_factory=list)
        stand_ins: bool = True

        def urls(self, role: str) -> list[str]:
            return []

    deployment_dir = tmp_path / "colocated-deployment"
    deployment_dir.mkdir()
    (deployment_dir / "deployment.json").write_text(json.dumps({"spec": {"name": "borrowed"}}))
    workload = parse_workload({**WORKLOAD, "num_requests": 4})
    with standin(next(PORTS), "--token-ms", "2", "--path-header", "direct") as url:
        dep = RunningDeployment(router_url=url, run_dir=deployment_dir)
        with ExperimentRun("unit", workload, runs_root=tmp_path / "runs", progress=False) as run:
            run.measure_deployment("colocated", dep)
            run.measure_deployment("baseline", dep, baseline=True)
    recorded = run.dir / "baseline" / "deployment" / "deployment.json"
    assert json.loads(recorded.read_text())["spec"]["name"] == "borrowed"
    # A scenario's own deployment directory is the Deployment's to write (pdlab.deploy), not the runner's.
    assert not (run.dir / "colocated" / "deployment").exists()


def test_pdlab_run_sends_a_labs_workload_to_a_running_endpoint(tmp_path):
    """`pdlab run LAB --url` (a cluster's router, say) measures the lab's workload there instead of deploying it."""
    import yaml
    from typer.testing import CliRunner

    from pdlab.cli import app

    hol = yaml.safe_load((Path(__file__).parents[2] / "labs" / "hol-blocking.yaml").read_text())
    lab = tmp_path / "lab.yaml"  # the hol-blocking lab's scenarios (not deployed here), a small workload
    lab.write_text(json.dumps({"name": "elsewhere", "scenarios": hol["scenarios"],
                               "workload": {**WORKLOAD, "num_requests": 4}}))
    tokenizer = resolve("pdlab-tiny")
    out = tmp_path / "run"
    with standin(next(PORTS), "--token-ms", "2", "--path-header", "disaggregated") as url:
        result = CliRunner().invoke(app, ["run", str(lab), "--url", url, "--model", "pdlab-standin",
                                          "--tokenizer", str(tokenizer), "--scenario", "cluster", "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    check_summary(summary)
    assert summary["complete"] is True and list(summary["scenarios"]) == ["cluster"]
    requests = summary["scenarios"]["cluster"]["requests"]
    assert requests["completed"] == requests["scheduled"] >= 4  # the lab's requests (and its probes), all served
    assert (out / "report.html").is_file()

    missing = CliRunner().invoke(app, ["run", str(lab), "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "x")])
    assert missing.exit_code == 1 and "--model and --tokenizer" in missing.output
    assert not (tmp_path / "x").exists()  # refused before anything was written


def test_a_record_is_named_when_its_run_started_and_never_overwrites(tmp_path: Path, monkeypatch) -> None:
    """`--record` files a run under data/results/<lab>/<timestamp>/ whatever `--out` named the run directory."""
    from pdlab.experiment import lab as lab_module

    run_dir = tmp_path / "my-run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"lab": "hol-blocking", "started": "2026-12-05T10:12:35+00:00"}))
    (run_dir / "environment.json").write_text("{}")
    monkeypatch.setattr(lab_module, "data_dir", lambda: tmp_path / "data")
    first, second = lab_module.record_run(run_dir), lab_module.record_run(run_dir)
    stamp = dt.datetime.fromisoformat("2026-12-05T10:12:35+00:00").astimezone().strftime("%Y%m%d-%H%M%S")
    assert first == tmp_path / "data" / "results" / "hol-blocking" / stamp
    assert second == first.with_name(f"{stamp}-2")
    assert sorted(p.name for p in first.iterdir()) == ["environment.json", "summary.json"]
