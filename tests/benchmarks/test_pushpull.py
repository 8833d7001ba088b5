"""`pdlab bench push-pull`'s figures from a load's rows and summary, and LMCache's over NIXL's (pure functions; the
benchmark itself deploys two P/D pairs, too slow for make test: its record is what runs it)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from pdlab.benchmarks.pushpull import load_figures, ratios


def scenario(long_ttft_p50: float, after_prefill_s: float) -> dict:
    rows = pd.DataFrame({"cls": ["long", "long", "short"], "status": ["ok", "ok", "ok"],
                         "token_times": [[0.5 + after_prefill_s, 0.6], [0.5 + after_prefill_s], [0.01]],
                         "prefill_ms": [500.0, 500.0, float("nan")]})
    summary = {"requests": {"completed": 3}, "long": {"ttft_ms": {"p50": long_ttft_p50, "p99": 2 * long_ttft_p50}},
               "short": {"ttft_ms": {"p50": 10.0, "p99": 20.0}, "itl_ms": {"p50": 5.0, "p99": 9.0, "max": 30.0}},
               "stalls": {"count": 1}}
    kv = {"transfers": 2, "connector_hit_tokens": 0, "unrelated": 1}
    probe = {"ttft_ms": {"median": long_ttft_p50}, "after_prefill_ms": {"median": after_prefill_s * 1e3}}
    return {"load": load_figures(rows, summary, kv), "probes": {"idle": probe, "prefill-busy": probe}}


def test_load_figures_time_after_prefill_from_each_long_prompts_first_token():
    figures = scenario(800.0, 0.2)["load"]
    assert figures["long_after_prefill_ms"]["median"] == pytest.approx(200.0)
    assert figures["long_after_prefill_ms"]["count"] == 2  # the short request has no prefill leg
    assert figures["short_itl_ms"] == {"p50": 5.0, "p99": 9.0, "max": 30.0} and figures["stalls"] == 1
    assert set(figures["kv"]) == {"transfers", "mean_xfer_ms", "post_seconds", "connector_hit_tokens", "preemptions"}
    json.dumps(figures)  # it goes into the result file as it is


def test_ratios_are_lmcache_over_nixl():
    out = ratios(scenario(600.0, 0.1), scenario(800.0, 0.4))
    assert out["long_ttft_p50"] == pytest.approx(0.75) and out["long_after_prefill_median"] == pytest.approx(0.25)
    assert out["probe_prefill-busy_after_prefill_ms_median"] == pytest.approx(0.25)
    assert out["short_itl_p99"] == pytest.approx(1.0)
