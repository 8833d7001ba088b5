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
# Reference answers to notebook 05 (load and SLOs). They run after the notebook, in its kernel: `runs`, `per_request`,
# `table` and `workload` are the notebook's, and they send no more load. What a full run of the notebook measured comes
# from its recorded full run (`pdlab workshop time`), printed where it is used.

# %% [markdown]
# ## Exercise 1
# Tightening an SLO can only keep or lower attainment, at every rate. Which requests miss a 20 ms TPOT depends on how
# busy the decode instance was while they decoded: TPOT is the mean step time of the batches a request decoded in, and
# short and long requests decode side by side on the one decode core. On the tiny model of a quick run a decode step
# takes a few milliseconds and few requests (often none) miss <!-- stated: the exercise's SLO -->. On pdlab-small, in
# the recorded full run, many short requests at the highest rate decoded slower than 20 ms a token (the `tpot_s` column
# printed below) <!-- stated: the exercise's SLO -->: the short requests are the ones that miss, and they are most of
# the requests. The long prompts, at this rate, have mostly missed the TTFT objective already, so the tighter TPOT costs
# little more there.

# %%
import json

import pandas as pd

from pdlab.settings import repo_root

TIGHT_TPOT_S = 0.020
misses = per_request.assign(misses=per_request["tpot_s"] > TIGHT_TPOT_S).groupby("cls")["misses"].agg(["sum", "count"])
print(f"at {RATES[-1]:g} req/s, requests over a {TIGHT_TPOT_S * 1e3:g} ms TPOT, by class:\n{misses}")
tight = sweep_table({("1p1d", rate): rows for rate, rows in runs.items()}, TTFT_SLO_S, TIGHT_TPOT_S)
assert (tight["attainment"].to_numpy() <= table["attainment"].to_numpy()).all(), "a tighter SLO cannot be met more"
print(pd.DataFrame({"rate": table["rate"], "attainment, TPOT <= 100 ms": table["attainment"],
                    "attainment, TPOT <= 20 ms": tight["attainment"]}).round(3).to_string(index=False))
record = json.loads((repo_root() / "data/results/course-timings/20261205-122010-05.json").read_text())["notebooks"][0]
assert record["mode"] == "full" and record["complete"]
print("\nrecorded full run, per request at the highest rate:\n"
      + next(cell["output"] for cell in record["cells"] if cell["first_line"].startswith("from pdlab.metrics.latency")))

# %% [markdown]
# ## Exercise 2
# A stalled request's TPOT is its *mean* gap: one long gap among dozens of ordinary ones raises the mean only a little,
# so its TPOT stays close to the other requests' and far under the TPOT objective, while its largest gap is several
# times its median (that is what a stall is). Neither TTFT nor TPOT catches the user staring at a frozen answer: the SLO
# that does bounds each request's *largest* inter-token gap (an ITL-max or worst-gap objective, as in notebook 02's
# worst gap), or a high percentile of the ITLs read per request.

# %%
from pdlab.metrics.latency import DEFAULT_STALL_K, request_metrics

every = pd.concat([request_metrics(rows).assign(rate=rate) for rate, rows in runs.items()])
stalled = every[every["stalls"] > 0]
if stalled.empty:
    print("no request stalled in these runs: raise the highest rate or LONG_FRACTION")
else:
    assert (stalled["max_gap_s"] > DEFAULT_STALL_K * stalled["median_itl_s"]).all(), "a stall: a gap over k medians"
    assert (stalled["tpot_s"] < stalled["max_gap_s"]).all(), "the mean gap hides the longest one"
    worst = stalled.sort_values("max_gap_s").iloc[-1]
    print(f"{worst.request_id} at {worst.rate:g} req/s: TPOT {worst.tpot_s * 1e3:.0f} ms "
          f"(SLO {TPOT_SLO_S * 1e3:g} ms: {'met' if worst.tpot_s <= TPOT_SLO_S else 'missed'}), "
          f"largest gap {worst.max_gap_s * 1e3:.0f} ms, {worst.max_gap_s / worst.tpot_s:.1f}x its TPOT")
    print(f"{(stalled['tpot_s'] <= TPOT_SLO_S).mean():.0%} of the {len(stalled)} stalled requests met the TPOT SLO")
stalled[["rate", "request_id", "cls", "tpot_s", "median_itl_s", "max_gap_s", "stalls"]].head(10).round(4)

# %% [markdown]
# ## Exercise 3
# Each added rate is another load of `DURATION_S` seconds, so the answer shows the method on the rates this run
# measured, and asks the simulator for the rates in between (the same 1P1D of pdlab-small and the same mix, in a
# second): add rates until attainment falls under 90% <!-- stated: goodput's definition -->. With 4,000-token prompts
# and a 2-second TTFT objective the limit is set by the long prompts: a lone 4,000-token prefill of pdlab-small takes
# close to two seconds on one core, so any queueing at the prefill instance makes them miss, and the long share caps
# what the short requests can make up. In the recorded full run of the notebook on a 2-core AMD EPYC, attainment stayed
# under 90% <!-- stated: goodput's definition --> at every rate from the lowest, so no measured rate had goodput: that
# deployment's limit lay below the lowest rate, where the simulator, on its calibration machine's costs, puts it a few
# req/s higher. Notebook 07 finds the same limit for a GPU cluster.

# %%
from pdlab.calibration.lab import DEFAULT_LAB_PROFILE, lab_points, lab_requests
from pdlab.config.lab import LabSpec
from pdlab.config.sim import SLO
from pdlab.model import resolve
from pdlab.sim.scenario import simulate

under = table.loc[table["attainment"] < 0.9, "rate"]
print(f"measured: attainment first under 90% at {under.min():g} req/s" if len(under)
      else f"measured: attainment >= 90% up to {table['rate'].max():g} req/s: add higher rates")
spec = course.lab_deployment("local-1p1d-router")  # the lab spec, at pdlab-small (the simulator's fitted costs)
full_load = workload.model_copy(update={"duration_s": 40, "long_fraction": 0.2})
simulated, limit = {}, None
for rate in (0.5, 1.0, 2.0, 3.0, 4.0, 6.0):
    lab = LabSpec(name="slo", scenarios={"1p1d": spec}, workload=full_load.model_copy(update={"rate": rate}))
    (point,) = lab_points(lab, lab_requests(lab, model_dir=resolve(MODEL), profile=DEFAULT_LAB_PROFILE),
                          profile=DEFAULT_LAB_PROFILE)
    summary, _ = simulate(point.spec.model_copy(
        update={"slo": SLO(ttft_ms=TTFT_SLO_S * 1e3, tpot_ms=TPOT_SLO_S * 1e3)}))
    simulated[rate] = summary["goodput"]["attainment"]
    if simulated[rate] < 0.9:
        limit = rate
        break
print("simulated attainment:", {rate: round(a, 3) for rate, a in simulated.items()})
assert limit is not None and simulated[limit] < simulated[0.5], "more load, fewer requests within the SLOs"
print(f"simulated: under 90% from {limit:g} req/s")
print("\nrecorded full run:\n" + "\n".join(record["checks_passed"]))
print(next(cell["output"] for cell in record["cells"] if cell["first_line"].startswith("from pdlab.metrics.goodput")))
