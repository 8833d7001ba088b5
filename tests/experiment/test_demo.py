"""The demo's verdict and README's table, from hand-made summaries: what the words and cells must say."""

from __future__ import annotations

import json
import re

import pytest

from pdlab.config.base import ConfigError
from pdlab.config.workload import MixedWorkload, parse_workload
from pdlab.report import verdict
from pdlab.report.readme import headline_markdown, render


def block(itl99: float, ttft99: float, share: float, worst99: float, long50: float | None = None,
          long99: float | None = None) -> dict:
    out = {"short": {"itl_ms": {"p50": 14.0, "p99": itl99}, "ttft_ms": {"p99": ttft99},
                     "stalled": {"requests": int(share * 100), "of": 100, "share": share},
                     "worst_gap_ms": {"p50": worst99 / 2, "p99": worst99}}}
    if long50 is not None:
        out["long"] = {"ttft_ms": {"p50": long50, "p99": long99}}
    return out


SUMMARY = {
    "scenarios": {"colocated": block(420, 1000, 0.98, 717, 437, 1055),
                  "colocated_chunked": block(232, 547, 0.95, 329, 490, 1041),
                  "disaggregated": block(38, 83, 0.0, 61, 1054, 3865)},
    "baseline": block(39, 87, 0.0, 60),
    "kv_transfer": {"disaggregated": {"transfers": 131, "mean_xfer_ms": 325.9}},
}


def test_the_verdict_says_each_scenario_against_alone_and_what_long_prompts_paid():
    lines = verdict(SUMMARY)
    assert lines[0].startswith("colocated: short requests' ITL p99 420 ms (10.8x alone), TTFT p99 1.00 s (11.5x")
    assert "98% of them stalled at least once, the worst gap 717 ms" in lines[0]
    assert lines[1].startswith("chunked prefill:") and lines[2].startswith("disaggregated:")
    assert "(1.0x alone)" in lines[2] and "0% of them stalled" in lines[2]
    assert lines[3] == "alone (no long prompts): ITL p99 39 ms, TTFT p99 87 ms."
    assert lines[4].startswith("the price: long prompts waited 2.4x longer for their first token disaggregated "
                               "(TTFT p50 1.05 s vs 437 ms colocated; p99 3.87 s vs 1.05 s)")
    assert lines[4].endswith("one prefill core instead of two, plus the KV transfer (mean 326 ms).")


def test_a_verdict_leaves_out_what_the_run_did_not_measure():
    lines = verdict({"scenarios": {"disaggregated": block(38, 83, 0.0, 61)}, "baseline": None})
    assert len(lines) == 1 and "(- alone)" in lines[0]


def test_the_verdict_sets_lmcaches_push_against_nixls_pull():
    def pd_block(after50: float, long50: float, long99: float) -> dict:
        return {**block(30, 60, 0.0, 40, long50, long99),
                "by_path": {"disaggregated": {"after_prefill_ms": {"p50": after50}}}}

    summary = {"scenarios": {"disaggregated": pd_block(1626, 5143, 9100),
                             "disaggregated_lmcache": pd_block(75, 4074, 8130)}, "baseline": None}
    lines = verdict(summary)
    assert lines[0].startswith("disaggregated:") and lines[1].startswith("disaggregated, LMCache's push:")
    assert len(lines) == 3, "each scenario once, then the comparison"
    assert lines[2] == ("push against pull: the long prompts' first token came 75 ms after prefill's answer with "
                        "LMCache's push, 1.63 s with NIXL's pull (medians); their TTFT p50 4.07 s vs 5.14 s, p99 "
                        "8.13 s vs 9.10 s.")
    del summary["scenarios"]["disaggregated"]
    assert not any(line.startswith("push against pull") for line in verdict(summary))


def test_the_demo_runs_its_labs_headline_and_pdlab_run_all_of_it():
    """`pdlab demo` runs the demo lab's `experiment.demo_scenarios` (the quick demo in make test checks what it
    ran); the LMCache scenario is the lab's, for `pdlab run`. A name that is not a scenario is refused by field."""
    from pdlab.config import load_lab, parse_lab
    from pdlab.experiment.cli import DEMO_LAB
    from pdlab.settings import labs_dir

    lab = load_lab(labs_dir() / DEMO_LAB)
    assert lab.experiment.demo_scenarios == ["colocated", "colocated_chunked", "disaggregated"]
    assert "disaggregated_lmcache" in lab.scenarios
    assert lab.scenarios["disaggregated_lmcache"].connector.kind == "lmcache"
    # beside the NIXL one: the same cores, model and router
    nixl, pushed = lab.scenarios["disaggregated"], lab.scenarios["disaggregated_lmcache"]
    assert [(i.role, i.cores) for i in nixl.instances] == [(i.role, i.cores) for i in pushed.instances]
    assert nixl.model == pushed.model and nixl.router == pushed.router
    text = (labs_dir() / DEMO_LAB).read_text().replace("demo_scenarios: [colocated,", "demo_scenarios: [coloc,")
    with pytest.raises(ConfigError, match="experiment.demo_scenarios"):
        parse_lab(text, source="hol-blocking")


def test_the_readme_table_comes_from_the_record_and_is_checked_against_it(tmp_path):
    table = headline_markdown(SUMMARY)
    lines = table.splitlines()
    assert lines[0] == "| | colocated | chunked prefill | disaggregated | alone |"
    assert lines[2] == "| short ITL p99 (ms) | 420 | 232 | 38.0 | 39.0 |"
    assert "| short requests that stalled | 98% | 95% | 0% | 0% |" in lines
    assert "| long TTFT p50 (ms) | 437 | 490 | 1,054 | - |" in lines
    (tmp_path / "rec").mkdir()
    (tmp_path / "rec" / "summary.json").write_text(json.dumps(SUMMARY))
    readme = "intro\n<!-- headline: rec/summary.json -->\nstale\n<!-- /headline -->\nafter\n"
    fresh = render(readme, tmp_path)
    words = "".join(f"- {line}\n" for line in verdict(SUMMARY))
    assert fresh == (f"intro\n<!-- headline: rec/summary.json -->\n{table}\nThe verdict it printed:\n\n{words}"
                     "<!-- /headline -->\nafter\n")
    with pytest.raises(ValueError, match="no <!-- headline"):
        render("no block here", tmp_path)


def test_a_prefill_load_workload_is_sized_by_the_measured_prefill():
    spec = MixedWorkload(prefill_load=0.5, long_fraction=0.5, long_tokens=640, duration_s=10)
    assert spec.needs_sizing
    sized = spec.sized(0.4)  # 0.5 of a core / (0.5 long x 0.4 s) = 2.5 requests/s
    assert sized.rate == pytest.approx(2.5) and sized.prefill_s == 0.4 and not sized.needs_sizing
    # what the run records reads back as the same sized workload
    assert parse_workload(sized.model_dump(mode="json")) == sized


def test_rate_and_prefill_load_together_or_without_long_prompts_are_refused():
    with pytest.raises(ConfigError, match="rate.*prefill_load"):
        parse_workload({"kind": "mixed", "rate": 2, "prefill_load": 0.5, "duration_s": 5})
    with pytest.raises(ConfigError, match="long_fraction"):
        parse_workload({"kind": "mixed", "prefill_load": 0.5, "long_fraction": 0, "duration_s": 5})
    with pytest.raises(ConfigError, match="prefill_load"):
        parse_workload({"kind": "mixed", "prefill_load": 1.5, "duration_s": 5})


def test_an_unsized_workload_cannot_be_scheduled():
    from pdlab.load.prompts import PromptBuilder
    from pdlab.load.schedule import build_schedule
    from pdlab.model import resolve

    with pytest.raises(ValueError, match="size it first"):
        build_schedule(MixedWorkload(prefill_load=0.5, duration_s=5), PromptBuilder(resolve("pdlab-tiny")))


def test_the_load_is_sized_by_lone_prefills_timed_on_the_machine():
    """Against a stand-in server (a real process) that prefills at 0.5 ms per prompt token (as it counts them, about
    0.2-0.3 s for these prompts; an instant answer without the delay): the rate follows the time measured."""
    from pdlab.experiment.lab import size_workload
    from pdlab.model import resolve
    from tests.standin_process import free_port, standin

    spec = MixedWorkload(prefill_load=0.55, long_fraction=0.6, long_tokens=512, duration_s=5)
    with standin(free_port(), "--prefill-us-per-token", "500", "--model", "pdlab-tiny") as url:
        sized = size_workload(spec, url, "pdlab-tiny", resolve("pdlab-tiny"))
    assert 0.15 <= sized.prefill_s < 0.5, sized
    assert sized.rate == pytest.approx(0.55 / (0.6 * sized.prefill_s), rel=1e-3)


def test_a_long_tail_makes_a_share_of_the_long_prompts_longer_and_sizes_by_their_mean():
    from pdlab.load.prompts import PromptBuilder
    from pdlab.load.schedule import build_schedule
    from pdlab.model import resolve

    plain = MixedWorkload(rate=4.0, long_fraction=0.5, long_tokens=64, short_tokens=8, duration_s=60, seed=3)
    tail = plain.model_copy(update={"long_tail": {"tokens": 96, "share": 0.25}})
    tail = parse_workload(tail.model_dump(mode="json"))
    builder = PromptBuilder(resolve("pdlab-tiny"))
    before, after = build_schedule(plain, builder), build_schedule(tail, builder)
    # the same arrivals and classes; a quarter of the long ones (by the seed) are the tail's length
    assert [(r.offset_s, r.cls) for r in before] == [(r.offset_s, r.cls) for r in after]
    longs = [r.prompt_tokens for r in after if r.cls == "long"]
    assert set(longs) == {64, 96} and 0.15 < longs.count(96) / len(longs) < 0.35
    assert tail.long_lengths() == {64: 0.75, 96: 0.25}
    assert tail.mean_prefill_s({64: 0.2, 96: 0.6}) == pytest.approx(0.3)
    with pytest.raises(ConfigError, match="share"):
        parse_workload({"kind": "mixed", "rate": 1, "duration_s": 5, "long_tail": {"tokens": 96, "share": 1.5}})


def test_readmes_table_is_what_its_record_gives():
    """README's headline table equals what the recorded demo run it names gives (regenerate it with
    `python -m pdlab.report.readme RECORD`, never by hand), and that record is a complete demo run with its
    environment."""
    from tests.conftest import REPO

    readme = (REPO / "README.md").read_text()
    assert render(readme, REPO) == readme, "README's headline table differs from its record: regenerate it"
    record = REPO / re.search(r"<!-- headline: (\S+) -->", readme).group(1)
    assert record.parent.parent == REPO / "data" / "results" / "hol-blocking"
    summary = json.loads(record.read_text())
    assert summary["complete"] and (record.parent / "environment.json").is_file()
    assert set(summary["scenarios"]) == {"colocated", "colocated_chunked", "disaggregated"}


def test_a_quick_run_of_the_demo_sends_a_fixed_number_of_requests():
    """The demo's quick load is the schedule's first `quick_requests` requests, not what a duration lets arrive at
    the measured rate; `--duration` still cuts by time, and a lab with timed events cannot be cut by count."""
    from pdlab.config import load_lab
    from pdlab.config.lab import ExperimentSpec
    from pdlab.experiment.lab import quick_workload
    from pdlab.settings import repo_root

    lab = load_lab(repo_root() / "labs" / "hol-blocking.yaml")
    quick = quick_workload(lab)
    assert quick.num_requests == lab.experiment.quick_requests and quick.duration_s is None
    assert quick.model_copy(update={"num_requests": None, "duration_s": None}) == \
        lab.workload.model_copy(update={"num_requests": None, "duration_s": None})
    timed = quick_workload(lab, duration_s=3)
    assert timed.duration_s == 3 and timed.num_requests is None
    with pytest.raises(ValueError, match="quick_requests.*events"):
        ExperimentSpec.model_validate({"quick_requests": 10,
                                       "events": [{"at_s": 1, "action": "kill", "instance": "prefill-0"}]})
