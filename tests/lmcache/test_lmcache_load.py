"""LMCache's P/D under a minute of the demo's mixed load, real processes: the demo lab's LMCache scenario
(`labs/hol-blocking.yaml`, `disaggregated_lmcache`) run by `pdlab run` as a user types it, for 60 s of load. No
request fails or hangs, and every prompt the router sent through prefill -> decode was pushed and loaded whole by
the decode instance, by LMCache's own log lines: none silently recomputed. `make test` runs the same scenario and
checks for 3 s (tests/test_docs_commands.py); this minute is left out of it for time: `pytest -m extended`."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import PDLAB, REPO, pdlab_processes

pytestmark = [pytest.mark.e2e, pytest.mark.extended]

LOAD_S = 60


def test_a_minute_of_mixed_load_loses_nothing_and_loads_every_pushed_prompt_whole(tmp_path):
    argv = [*PDLAB, "run", "labs/hol-blocking.yaml", "--quick", "--only", "disaggregated_lmcache",
            "--duration", str(LOAD_S), "--out", str(tmp_path / "run")]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)  # a hang fails here
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["complete"], "the run was marked incomplete"
    block = summary["scenarios"]["disaggregated_lmcache"]
    requests = block["requests"]
    assert requests["completed"] == requests["sent"] > 0 and not requests.get("failed"), requests
    assert block["long"]["requests"]["completed"] > 0 and block["short"]["requests"]["completed"] > 0, \
        "the load was not mixed"
    account = summary["kv_transfer"]["disaggregated_lmcache"]["lmcache"]
    assert account["disaggregated"] == block["by_path"]["disaggregated"]["after_prefill_ms"]["count"] > 0, account
    assert account["pushed"] == account["loaded"] == account["loaded_in_full"] == account["disaggregated"], account
    assert account["recomputed"] == 0, account
    assert "LMCache pushed the KV of" in done.stdout
    assert not pdlab_processes("vllm.entrypoints"), "pdlab run left vLLM running"
