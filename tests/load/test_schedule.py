"""Workload specs, exact-length prompts for the served model's tokenizer, and the precomputed schedule."""

from __future__ import annotations

import json

import pytest

from pdlab.config import ConfigError, LabSpec, MixedWorkload, TraceWorkload, parse_workload, validate
from pdlab.load import PromptBuilder, build_schedule, read_schedule, write_schedule
from pdlab.model import resolve


@pytest.fixture(scope="module")
def builder() -> PromptBuilder:
    return PromptBuilder(resolve("pdlab-tiny"))


def test_workload_kind_picks_the_class_and_errors_name_the_field():
    assert isinstance(parse_workload({"kind": "mixed", "num_requests": 3}), MixedWorkload)
    assert isinstance(parse_workload({"kind": "trace", "path": "t.jsonl"}), TraceWorkload)
    with pytest.raises(ConfigError) as caught:
        parse_workload({"kind": "mixed", "num_requests": 3, "long_fraction": 1.5})
    assert "mixed.long_fraction" in dict(caught.value.problems)
    with pytest.raises(ConfigError) as caught:
        parse_workload({"kind": "bursty"})
    assert "kind" in str(caught.value)
    with pytest.raises(ConfigError, match="duration_s"):
        parse_workload({"kind": "mixed"})


def test_lab_spec_accepts_a_workload():
    lab = validate(LabSpec, {"name": "l", "deployment": {"instances": [{"name": "c-0", "role": "colocated"}]},
                             "workload": {"kind": "probe", "rate": 4, "duration_s": 10}})
    assert lab.workload.kind == "probe"


@pytest.mark.parametrize("api", ["completions", "chat"])
@pytest.mark.parametrize("tokens", [16, 17, 64, 513, 4096])
def test_prompts_have_the_exact_token_count(builder, api, tokens):
    prompt = builder.prompt(tokens, key=f"t{tokens}", api=api)
    if api == "completions":  # what vLLM counts: the text plus the one BOS token the post-processor adds
        ids = builder.tokenizer.encode(prompt).ids
        assert ids[0] == builder.tokenizer.token_to_id("<s>")
        assert len(ids) == tokens
    else:
        assert builder.count(prompt, "chat") == tokens


def test_schedule_is_seeded_and_mixed_as_asked(builder, tmp_path):
    spec = parse_workload({"kind": "mixed", "seed": 7, "rate": 4, "num_requests": 200, "short_tokens": 32,
                           "long_tokens": 300, "long_fraction": 0.25, "short_output_tokens": 8,
                           "long_output_tokens": 2})
    first = write_schedule(build_schedule(spec, builder), tmp_path / "a.jsonl")
    second = write_schedule(build_schedule(spec, builder), tmp_path / "b.jsonl")
    assert first.read_bytes() == second.read_bytes()
    other = build_schedule(spec.model_copy(update={"seed": 8}), builder)
    assert [i.offset_s for i in other] != [i.offset_s for i in read_schedule(first)]

    items = read_schedule(first)
    assert len(items) == 200
    offsets = [i.offset_s for i in items]
    assert offsets == sorted(offsets) and offsets[0] > 0
    longs = [i for i in items if i.cls == "long"]
    assert 30 <= len(longs) <= 70  # 25% of 200, binomial spread
    assert {(i.prompt_tokens, i.max_tokens) for i in longs} == {(300, 2)}
    assert {(i.prompt_tokens, i.max_tokens) for i in items if i.cls == "short"} == {(32, 8)}
    assert all(len(builder.tokenizer.encode(i.prompt).ids) == i.prompt_tokens for i in items)
    assert len({i.request_id for i in items}) == 200


def test_duration_bounds_arrivals_and_probes_run_alongside(builder):
    spec = parse_workload({"kind": "mixed", "rate": 5, "duration_s": 4, "arrival": "uniform", "short_tokens": 16,
                           "long_fraction": 0, "probe": {"rate": 2, "prompt_tokens": 8, "output_tokens": 4}})
    items = build_schedule(spec, builder)
    main = [i.offset_s for i in items if i.cls == "short"]
    probes = [i for i in items if i.cls == "probe"]
    assert main == pytest.approx([0.2 * n for n in range(20)])
    assert [p.offset_s for p in probes] == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5])
    assert {(p.prompt_tokens, p.max_tokens) for p in probes} == {(8, 4)}


def test_trace_replay_scales_and_shares_prefixes(builder, tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 1200, "output_length": 40, "hash_ids": [1, 2, 3]},
        {"timestamp": 3000, "input_length": 1100, "output_length": 20, "hash_ids": [1, 2, 4]},
        {"timestamp": 5000, "input_length": 600, "output_length": 10, "hash_ids": [5, 6]},
    ]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    spec = parse_workload({"kind": "trace", "path": str(trace), "time_scale": 0.5, "length_scale": 0.5,
                           "long_threshold_tokens": 500})
    items = build_schedule(spec, builder)
    assert [i.offset_s for i in items] == pytest.approx([0.0, 1.0, 2.0])
    assert [i.prompt_tokens for i in items] == [600, 550, 300]
    assert [i.max_tokens for i in items] == [20, 10, 5]
    assert [i.cls for i in items] == ["long", "long", "short"]
    # blocks of 512 * 0.5 = 256 tokens: the first two requests share hash ids 1 and 2, i.e. 512 tokens
    first, second, third = (builder.tokenizer.encode(i.prompt).ids for i in items)
    assert first[:513] == second[:513]  # BOS + two shared blocks
    assert first[513:550] != second[513:550]  # hash ids 3 and 4 differ
    assert [i.shared_prefix_tokens for i in items] == [0, 512, 0]
    assert [i.prefix_id for i in items] == ["1", "1", "5"]
    assert len(third) == 300


def test_trace_ties_are_spread_over_the_gap_to_the_next_timestamp_when_asked(builder, tmp_path):
    trace = tmp_path / "trace.jsonl"
    stamps = [0, 0, 0, 0, 3000, 6000, 6000]
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": 100 + i, "output_length": 4}) + "\n"
                             for i, t in enumerate(stamps)))
    as_recorded = build_schedule(parse_workload({"kind": "trace", "path": str(trace), "time_scale": 2}), builder)
    assert [i.offset_s for i in as_recorded] == pytest.approx([0, 0, 0, 0, 6, 12, 12])
    spread = build_schedule(parse_workload({"kind": "trace", "path": str(trace), "time_scale": 2,
                                            "spread_ties": True}), builder)
    # four requests over the 3 s (x2) gap, one alone, and the last pair over the median gap (3 s x2)
    assert [i.offset_s for i in spread] == pytest.approx([0, 1.5, 3, 4.5, 6, 12, 15])
    assert [i.prompt_tokens for i in spread] == [i.prompt_tokens for i in as_recorded]  # trace order kept


def test_probe_only_workload(builder):
    items = build_schedule(parse_workload({"kind": "probe", "rate": 4, "duration_s": 2, "prompt_tokens": 12,
                                           "output_tokens": 3}), builder)
    assert [i.offset_s for i in items] == pytest.approx([0.25 * n for n in range(8)])
    assert {(i.cls, i.prompt_tokens, i.max_tokens) for i in items} == {("probe", 12, 3)}


def test_a_measured_rate_stretches_one_pattern_and_a_given_rate_draws_its_own(builder):
    """A load sized to the machine (`prefill_load`) sends the same requests in the same order on every machine: the
    Poisson gaps scale with 1/rate, nothing else changes. A rate the spec gives keys the draws (a sweep's rates)."""
    fields = {"kind": "mixed", "num_requests": 30, "short_tokens": 16, "long_tokens": 40, "long_fraction": 0.5,
              "seed": 3}

    def sized(prefill_s: float) -> list:
        return build_schedule(parse_workload({**fields, "prefill_load": 0.5}).sized(prefill_s), builder)

    slow, fast = sized(1.0), sized(0.4)  # rates 1.0 and 2.5 requests/s
    assert [(i.cls, i.prompt) for i in fast] == [(i.cls, i.prompt) for i in slow]
    assert [i.offset_s for i in fast] == pytest.approx([i.offset_s / 2.5 for i in slow], abs=2e-6)
    assert len({round(b.offset_s - a.offset_s, 3) for a, b in zip(slow, slow[1:], strict=False)}) > 20  # Poisson
    given = [build_schedule(parse_workload({**fields, "rate": rate}), builder) for rate in (1.0, 2.5)]
    assert [i.offset_s for i in given[1]] != pytest.approx([i.offset_s / 2.5 for i in given[0]], abs=2e-6)
