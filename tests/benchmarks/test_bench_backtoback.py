"""`pdlab bench backtoback` against two stand-in servers (real processes on loopback): a prefill instance whose
streamed prefills hold its event loop (one at a time, as an engine's steps) and whose unstreamed ones overlap, and
a decode instance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdlab.benchmarks.backtoback import CONDITIONS, run
from pdlab.cli import app
from tests.standin_process import free_port, standin

US_PER_TOKEN = 4000.0  # 4 ms per prompt token
TOKENS, PROMPTS = 50, 3  # 0.2 s a prompt


@pytest.fixture(scope="module")
def pair() -> tuple[str, str]:
    with standin(free_port(), "--prefill-us-per-token", str(US_PER_TOKEN), "--blocking-prefill",
                 "--event-loop", "asyncio", "--name", "prefill-standin") as prefill, \
            standin(free_port(), "--prefill-us-per-token", str(US_PER_TOKEN), "--token-ms", "5") as decode:
        yield prefill, decode


def test_every_condition_is_timed_against_its_rounds_alone(pair: tuple[str, str], tmp_path: Path) -> None:
    prefill, decode = pair
    out = tmp_path / "backtoback.json"
    result = run(prefill, decode, out=out, prompts=PROMPTS, tokens=TOKENS, rounds=2, settle_s=0.1, progress=False)
    rows = result["rounds_measured"]
    assert len(rows) == 2 and all(set(CONDITIONS) <= set(row) for row in rows)
    one_prompt_s = TOKENS * US_PER_TOKEN / 1e6
    for row in rows:
        assert row["alone"] >= PROMPTS * one_prompt_s
        # streamed prefills run one at a time on this server: a queue takes as long as the prompts alone
        assert 0.8 < row["ratio_to_alone"]["queued"] < 1.3
        assert 0.8 < row["ratio_to_alone"]["queued-beside-prefill"] < 1.3
        # the P/D legs are not streamed, and this server overlaps those: the queue clears in about one prompt's time
        assert row["ratio_to_alone"]["queued-pd"] < 0.7
    summary = result["summary"]
    assert summary["queued"]["ratio_min"] <= summary["queued"]["ratio_median"] <= summary["queued"]["ratio_max"]
    simulated = result["simulated"]["ratio_to_alone"]
    assert set(simulated) == {"queued", "queued-pd"} and all(0.5 < r < 1.5 for r in simulated.values())
    written = json.loads(out.read_text())
    assert written["benchmark"] == "backtoback" and "git" in written["environment"]
    with pytest.raises(FileExistsError, match="does not overwrite"):
        run(prefill, decode, out=out, prompts=PROMPTS, tokens=TOKENS, rounds=1, progress=False)


def test_cli_refuses_bad_conditions_and_half_a_pair(pair: tuple[str, str], tmp_path: Path) -> None:
    prefill, decode = pair
    runner = CliRunner()
    bad = runner.invoke(app, ["bench", "backtoback", "--prefill-url", prefill, "--decode-url", decode,
                              "--conditions", "alone,sideways"])
    assert bad.exit_code == 2 and "unknown sideways" in bad.output
    no_alone = runner.invoke(app, ["bench", "backtoback", "--prefill-url", prefill, "--decode-url", decode,
                                   "--conditions", "queued"])
    assert no_alone.exit_code == 2 and "`alone` is missing" in no_alone.output
    half = runner.invoke(app, ["bench", "backtoback", "--prefill-url", prefill])
    assert half.exit_code == 2 and "--decode-url" in half.output
    unknown_profile = runner.invoke(app, ["bench", "backtoback", "--prefill-url", prefill, "--decode-url", decode,
                                          "--profile", "no-such-profile", "--out", str(tmp_path / "x.json")])
    assert unknown_profile.exit_code == 1 and "no-such-profile" in unknown_profile.output
    assert not (tmp_path / "x.json").exists()


def test_cli_prints_each_condition_beside_the_simulator(pair: tuple[str, str], tmp_path: Path) -> None:
    prefill, decode = pair
    out = tmp_path / "cli.json"
    result = CliRunner().invoke(app, ["bench", "backtoback", "--prefill-url", prefill, "--decode-url", decode,
                                      "--prompts", "2", "--tokens", str(TOKENS), "--rounds", "1",
                                      "--conditions", "alone,queued", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "x alone" in result.output and "simulated" in result.output and out.exists()
