"""The fault drills (labs/fault-drills.yaml, labs/fault-drills-lmcache.yaml) in quick form: the real launcher, guard,
router and load generator, with stand-in servers in place of vLLM (what is drilled is everything around the
engine). Every scenario must lose no request, and each drill must have happened (the router's log shows the
breakers it tripped)."""

from __future__ import annotations

import json

from pdlab.config import load_lab
from pdlab.experiment.lab import run_lab
from tests.conftest import REPO, pdlab_processes


def test_fault_drills_lose_no_request(tmp_path):
    lab = load_lab(REPO / "labs" / "fault-drills.yaml")
    run_dir = run_lab(lab, quick=True, stand_ins=True, runs_root=tmp_path, progress=False)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["complete"]
    for name in ("prefill_killed", "decode_replica_killed", "instance_restarted"):
        requests = summary["scenarios"][name]["requests"]
        assert requests["sent"] >= 15 and requests["failed"] == 0 and requests["failures"] == {}, (name, requests)
    logs = {name: (run_dir / name / "deployment" / "router.log").read_text() for name in lab.scenarios}
    assert '"reason": "prefill_down"' in logs["prefill_killed"] or '"reason": "breaker_open"' in logs[
        "prefill_killed"]
    assert '"event": "breaker_open", "pool": "decode", "replica": "http://127.0.0.1:8193"' in logs[
        "decode_replica_killed"]
    restarted = logs["instance_restarted"]
    assert '"reason": "decode_empty"' in restarted or '"reason": "decode_down"' in restarted  # served by prefill
    assert '"event": "breaker_closed", "pool": "decode"' in restarted  # back after `restart`
    assert not pdlab_processes(str(run_dir))


def test_the_lmcache_drill_loses_no_request(tmp_path):
    """labs/fault-drills-lmcache.yaml in quick form: the stand-ins play LMCache's P/D (the sender pushes to the
    receiver's ports and reports each push to the router, which waits for the report), and the sender is killed."""
    lab = load_lab(REPO / "labs" / "fault-drills-lmcache.yaml")
    run_dir = run_lab(lab, quick=True, stand_ins=True, runs_root=tmp_path, progress=False)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["complete"]
    scenario = summary["scenarios"]["prefill_killed"]
    requests = scenario["requests"]
    assert requests["sent"] >= 15 and requests["failed"] == 0 and requests["failures"] == {}, requests
    # Long prompts went prefill -> push -> decode before the kill (the push was reported), directly after it.
    assert scenario["by_path"]["disaggregated"]["requests"] >= 1 and scenario["by_path"]["direct"]["requests"] >= 1
    log = (run_dir / "prefill_killed" / "deployment" / "router.log").read_text()
    assert '"reason": "prefill_down"' in log or '"reason": "breaker_open"' in log
    assert not pdlab_processes(str(run_dir))
