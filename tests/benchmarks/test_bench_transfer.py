"""`pdlab bench transfer`'s watch on the sender's idle-class threads, on a real process (the end-to-end use, on a
real prefill instance, is in test_deploy_e2e.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdlab.benchmarks.transfer import SenderWatch, after_last_slice, load_gap_cv, slice_gaps

SPINNER = """
import os, threading, time
def spin():
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while True:
        pass
threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


def test_the_watch_sees_an_idle_class_thread_run_and_nothing_in_a_process_without_one() -> None:
    child = subprocess.Popen([sys.executable, "-c", SPINNER], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        time.sleep(0.1)  # (the thread has moved itself to the idle class by now)
        with SenderWatch(child.pid) as watch:
            began = time.perf_counter()
            # on a quiet core it spins on and on; on a busy one it still gets a turn every second or so
            deadline = began + 10
            while not watch.samples and time.perf_counter() < deadline:
                time.sleep(0.05)
        assert watch.available
        bursts = watch.bursts(began, time.perf_counter())
        assert bursts and all(run_ms > 0 for _, run_ms in bursts)
    finally:
        child.kill()
        child.wait()
    with SenderWatch(os.getpid()) as none:
        time.sleep(0.01)
    assert not none.available and none.samples == []
    assert not SenderWatch(None).available


def test_gaps_are_counted_between_slices_only_and_a_first_token_is_timed_from_the_last_slice() -> None:
    bursts = [(-300.0, 40.0), (100.0, 1.5), (600.0, 3.0), (700.0, 30.0), (1500.0, 2.0), (2100.0, 0.5)]
    assert slice_gaps(bursts) == [500.0, 600.0]  # the free run at 700 ms breaks the chain
    assert after_last_slice(bursts, 650.0) == pytest.approx(50.0)
    assert after_last_slice(bursts, 720.0) is None  # served while the sender had the core to itself
    assert after_last_slice(bursts, -400.0) is None


def test_the_gaps_spread_is_read_from_a_result_and_a_result_without_slices_is_refused(tmp_path: Path) -> None:
    gaps = [400.0, 600.0] * 6
    bursts, t = [], 0.0
    for gap in gaps:
        bursts.append((t, 2.0))
        t += gap
    result = {"benchmark": "transfer", "trials": [{"condition": "prefill-busy-alone", "sender_bursts_ms": bursts}]}
    path = tmp_path / "transfer.json"
    path.write_text(json.dumps(result))
    assert load_gap_cv(path) == pytest.approx(100.0 / 500.0, rel=0.05)
    result["trials"][0]["sender_bursts_ms"] = bursts[:3]
    path.write_text(json.dumps(result))
    with pytest.raises(ValueError, match="at least 10"):
        load_gap_cv(path)
    path.write_text(json.dumps({"benchmark": "prefill"}))
    with pytest.raises(ValueError, match="not a `pdlab bench transfer` result"):
        load_gap_cv(path)


def test_calibrate_takes_the_spread_from_transfer_results_and_says_what_is_wrong_with_one(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from pdlab.cli import app

    other = tmp_path / "prefill.json"
    other.write_text(json.dumps({"benchmark": "prefill", "points": []}))
    alone = CliRunner().invoke(app, ["sim", "calibrate", "--transfer-probe", str(other)])
    assert alone.exit_code == 2 and "--transfer-probe goes with --from-runs" in alone.output
    wrong = CliRunner().invoke(app, ["sim", "calibrate", "--from-runs", str(tmp_path), "--transfer-probe", str(other)])
    assert wrong.exit_code == 2 and "not a `pdlab bench transfer` result" in " ".join(wrong.output.split())
