# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# Reference answers to notebook 02 (head-of-line blocking). They run after the notebook, in its kernel: `run`,
# `lab`, `colocated` and `causes` are the notebook's. Exercises 1 and 2 change the lab spec; instead of running
# each variation for minutes, they ask the simulator (`pdlab sim lab` does the same from a terminal), which replays
# the lab's own schedule on costs fitted to pdlab-small, in seconds.

# %% [markdown]
# ## Exercise 1
# A smaller token budget trades the short streams' freezes for the long prompts' wait. At 64 tokens a document is
# cut into many small chunks, each riding along with the streams' decode tokens: no gap is much longer than the
# others, so almost no short request stalls and the worst gap shrinks to a fraction of the 256-token budget's. But
# each document's prefill is now spread over many steps shared with the streams, so the long prompts' TTFT grows:
# the documents' users pay for a smaller budget (the streams' ordinary gaps barely move). At 1,024 tokens a
# 384-token document fits in one step again, and the worst gaps move back towards colocated's. What a real run
# shows at the shipped 256-token budget: in the recorded full run the chunked scenario's worst gap p99 was 259 ms
# against 1,549 ms colocated, while as many short requests stalled at least once, 83% against 83%
# <!-- cite data/results/hol-blocking/20261206-093310/summary.json: -, -, -, -, -,
# scenarios.colocated_chunked.short.worst_gap_ms.p99, scenarios.colocated.short.worst_gap_ms.p99,
# scenarios.colocated_chunked.short.stalled.share * 100, scenarios.colocated.short.stalled.share * 100 -->:
# chunking turns one freeze into several medium gaps, it does not remove them.

# %%
import json
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from pdlab.calibration.lab import DEFAULT_LAB_PROFILE, lab_points, lab_requests
from pdlab.metrics import DEFAULT_STALL_K
from pdlab.model import resolve
from pdlab.settings import repo_root
from pdlab.sim.scenario import build, prepare
from pdlab.sim.summary import per_request_rows
from pdlab.sim.workload import arrivals

SPEC = repo_root() / "labs" / "hol-blocking.yaml"


def lab_copy(edit):
    """A copy of labs/hol-blocking.yaml in a temporary directory, changed by `edit(raw_yaml_dict)`, loaded as the
    notebook loads the lab (at pdlab-small, the model the simulator's costs were fitted on)."""
    raw = yaml.safe_load(SPEC.read_text())
    edit(raw)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "hol-blocking.yaml"
        path.write_text(yaml.safe_dump(raw))
        return course.lab_spec(path, "pdlab-small")


def simulated(lab, only=(), seeds=2):
    """Each scenario of `lab` in the simulator, on the schedule `pdlab run` would send: the short requests' share
    stalled, stalls per request and worst gap, and the long prompts' TTFT (mean of `seeds` simulations)."""
    requests = lab_requests(lab, model_dir=resolve(MODEL), profile=DEFAULT_LAB_PROFILE)  # same tokenizer for both
    table = {}
    for point in lab_points(lab, requests, profile=DEFAULT_LAB_PROFILE, only=only):
        if point.name == "baseline":
            continue
        prepared, figures = prepare(point.spec), []
        for seed in range(seeds):
            rows = per_request_rows(build(prepared, seed).run(arrivals(point.spec.workload)))
            gaps = [r["itl_s"] for r in rows if r["cls"] == "short" and r["ttft_s"] is not None]
            stalls = np.array([(g > DEFAULT_STALL_K * np.median(g)).sum() for g in gaps])  # pdlab's stall definition
            worst = np.array([g.max() for g in gaps]) * 1e3
            long_ttft = np.array([r["ttft_s"] for r in rows if r["cls"] == "long"]) * 1e3
            figures.append({"short stalled share": (stalls > 0).mean(), "stalls per short request": stalls.mean(),
                            "short ITL p50 ms": np.median(np.concatenate(gaps)) * 1e3,
                            "worst gap p50 ms": np.percentile(worst, 50), "worst gap p99 ms": np.percentile(worst, 99),
                            "long TTFT p50 ms": np.percentile(long_ttft, 50),
                            "long TTFT p99 ms": np.percentile(long_ttft, 99)})
        table[point.name] = pd.DataFrame(figures).mean()
    return pd.DataFrame(table).T


def with_budget(tokens):
    def edit(raw):
        for instance in raw["scenarios"]["colocated_chunked"]["instances"]:
            instance["engine"]["max_num_batched_tokens"] = tokens
    return edit


budgets = pd.concat({tokens: simulated(lab_copy(with_budget(tokens)), only=["colocated_chunked"]).iloc[0]
                     for tokens in (64, 256, 1024)}, axis=1).T.rename_axis("token budget")
assert budgets["worst gap p99 ms"].is_monotonic_increasing, "a smaller budget should shorten the worst gap"
assert budgets["long TTFT p50 ms"].is_monotonic_decreasing, "a smaller budget should delay the long prompts"
assert budgets.loc[64, "long TTFT p99 ms"] > budgets.loc[256, "long TTFT p99 ms"]
assert budgets.loc[64, "short stalled share"] < budgets.loc[256, "short stalled share"] / 2
RECORD = repo_root() / "data/results/hol-blocking/20261206-093310/summary.json"
recorded = json.loads(RECORD.read_text())["scenarios"]
print("recorded full run (256-token budget): chunked worst gap p99 "
      f"{recorded['colocated_chunked']['short']['worst_gap_ms']['p99']:,.0f} ms vs colocated "
      f"{recorded['colocated']['short']['worst_gap_ms']['p99']:,.0f} ms; share stalled "
      f"{recorded['colocated_chunked']['short']['stalled']['share']:.0%} vs "
      f"{recorded['colocated']['short']['stalled']['share']:.0%}")
budgets.round(2)

# %% [markdown]
# ## Exercise 2
# Both, but mostly more frequent. A stall lasts one long prefill, so its length depends on the prompt, not on the
# rate: the worst gaps stay about where they were. With a higher `prefill_load` pdlab sizes a higher rate, so more
# long prefills start while a stream runs: more short requests stall, and each stalls more often. Disaggregated,
# the short streams still never stall, but the documents share one prefill core that is now nearly saturated (and
# slower under load than the lone prefills the rate was sized on): they queue, and their TTFT grows several-fold.
# No full run at 0.8 is recorded. At the shipped 0.55 the recorded run already shows the disaggregated long prompts
# paying: their TTFT p50 was 551 ms against 253 ms colocated
# <!-- cite data/results/hol-blocking/20261206-093310/summary.json: -, -, scenarios.disaggregated.long.ttft_ms.p50,
# scenarios.colocated.long.ttft_ms.p50 -->.

# %%
def with_prefill_load(load):
    def edit(raw):
        raw["workload"]["prefill_load"] = load
    return edit


loads = pd.concat({load: simulated(lab_copy(with_prefill_load(load))) for load in (0.55, 0.8)},
                  names=["prefill_load", "scenario"])
low, high = loads.loc[0.55], loads.loc[0.8]
colocated_both = ["colocated", "colocated_chunked"]
assert (high["stalls per short request"] > 1.5 * low["stalls per short request"])[colocated_both].all()
assert abs(high.loc["colocated", "worst gap p99 ms"] / low.loc["colocated", "worst gap p99 ms"] - 1) < 0.25, \
    "a stall lasts one prefill: its length should not follow the rate"
assert (loads.xs("disaggregated", level="scenario")["short stalled share"] == 0).all()
assert high.loc["disaggregated", "long TTFT p50 ms"] > 2 * low.loc["disaggregated", "long TTFT p50 ms"], \
    "the one prefill core should queue the documents"
print("recorded at 0.55: long TTFT p50 disaggregated "
      f"{recorded['disaggregated']['long']['ttft_ms']['p50']:,.0f} ms vs colocated "
      f"{recorded['colocated']['long']['ttft_ms']['p50']:,.0f} ms")
loads.round(2)

# %% [markdown]
# ## Exercise 3
# Group the stalls by request: a short request that stalled twice appears twice in `causes`. Each stall sits inside
# the prefill of the long prompt that overlapped it most. Usually the two stalls are two *different* documents
# (each prefill freezes the stream once: a document's prefill is one long step, or, chunked, several steps that
# are only medium gaps), unless one long prefill was cut into steps long enough to count twice. A short quick run
# may have no request that stalled twice: then look at the full run's timeline (`pdlab demo`), where most short
# requests stall at least once.

# %%
from pdlab.metrics.latency import request_metrics

per_short = request_metrics(colocated).query("cls == 'short'").set_index("request_id")["stalls"]
counted = causes["request_id"].value_counts()
assert counted.to_dict() == per_short[per_short > 0].to_dict(), "stall_causes lists each stall request_metrics counts"
twice = counted[counted >= 2].index
if len(twice) == 0:
    print("no short request stalled twice in this run; the stalls per request:", counted.to_dict())
for request in twice:
    mine = causes[causes["request_id"] == request].sort_values("t0_s")
    assert (mine["t0_s"].diff().dropna() > 0).all(), "two stalls of one stream are two different gaps"
    print(f"{request}: stalls at t=" + ", ".join(f"{t:.2f} s" for t in mine["t0_s"]) + " behind "
          + ", ".join(map(str, mine["long_request"])) + ("  (the same long prompt)" if mine["long_request"].nunique()
                                                         == 1 else "  (different long prompts)"))
causes[causes["request_id"].isin(twice)].sort_values(["request_id", "t0_s"]).round(3)

# %% [markdown]
# ## Exercise 4
# The ITL p99 is a percentile over *all* the short requests' gaps, and a stalled request has one or a few long gaps
# among a hundred ordinary ones: the stalls are a small share of the gaps. While they are fewer than one gap in a
# hundred, the p99 lands on an ordinary gap and does not see them at all; when they are a few more, it lands on the
# shortest of them. The worst gap is one number per request, so its p99 over the requests shows the long freezes
# whatever share of the gaps they are: that is the figure to read for head-of-line blocking.
#
# In the recorded full run, colocated, 83% of the short requests stalled, and their stalls were only 1.7% of their
# gaps: the ITL p99 (231 ms) lands on the shortest stalls (a 384-token prefill), while the worst gap p99
# (1,549 ms) shows the 2,048-token ones <!-- cite data/results/hol-blocking/20261206-093310/summary.json:
# scenarios.colocated.short.stalled.share * 100,
# scenarios.colocated.short.stalls / scenarios.colocated.short.itl_ms.count * 100,
# scenarios.colocated.short.itl_ms.p99, -, scenarios.colocated.short.worst_gap_ms.p99, - -->.

# %%
for name, block in run.summary["scenarios"].items():
    short = block["short"]
    stall_share_of_gaps = short["stalls"] / short["itl_ms"]["count"]
    print(f"{name:18s} ITL p99 {short['itl_ms']['p99']:7,.0f} ms   "
          f"worst gap p99 {short['worst_gap_ms']['p99']:7,.0f} ms"
          f"   stalled {short['stalled']['share']:4.0%} of requests, {stall_share_of_gaps:5.1%} of gaps")
    # a request-level share is always larger than the gap-level one: a stalled request has many ordinary gaps too
    assert stall_share_of_gaps <= (short["stalled"]["share"] or 0)
