# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 07 · At scale: the same questions on a GPU cluster, simulated
#
# **Learning objectives.** After this notebook you can
# - run pdlab's simulator (`pdlab.sim`) on a cluster deployment: Llama-3.1-70B on H200s, pools of prefill and
#   decode instances, the KV cache moved over EFA;
# - compare colocated and disaggregated serving on the same number of GPUs, under the same load;
# - explore threshold, pool sizes, rate, link and replica strategy interactively, and say which of the lab's local
#   conclusions carry over to a cluster.
#
# The simulator steps each instance's scheduler like vLLM's (decode tokens first, then prefill chunks within the
# token budget), with step times from a roofline of the GPU's datasheet figures (the H200's efficiencies measured
# on one H200), and routes with pdlab's own router code. KV transfers queue on a link of the catalog's bandwidth
# and latency. `docs/simulator.md` says what is modelled and how it was checked against the local measurements.
# A few thousand requests take well under a second, so every slider move re-simulates.

# %% tags=["parameters"]
from pdlab import course

SCENARIO = "llama70b-h200-efa"  # a spec under labs/sim/
NUM_REQUESTS = course.choose(4000, 600)  # simulated requests per run
THRESHOLDS = course.choose([0, 1024, 2048, 4096, 8192, 8193], [0, 4096, 8193])  # for the sweep (tokens)
PREFIX_SCENARIO = "llama8b-h200-shared-prefix"  # section 4: replica choice on a shared-prefix trace
PREFIX_REQUESTS = course.choose(2400, 800)  # of its 2,400 recorded requests

# %%
from pdlab.config.base import load_yaml
from pdlab.config.sim import SimSpec
from pdlab.settings import repo_root

spec = load_yaml(repo_root() / "labs" / "sim" / f"{SCENARIO}.yaml", SimSpec)
spec = spec.model_copy(update={"workload": spec.workload.model_copy(
    update={"poisson": spec.workload.poisson.model_copy(update={"num_requests": NUM_REQUESTS})})})
print(spec.model_dump_json(indent=1, include={"hardware", "model", "link", "pools", "engine", "router", "slo"}))

# %% [markdown]
# ## 0. Why trust it? The same simulator against the local labs
#
# Before asking it about H200s, check it on the machine in front of you. `pdlab sim validate` replays measured
# lab runs (hol-blocking, the threshold sweep) through the simulator with step costs fitted on *other* runs, and
# compares p50 and p99 TTFT and ITL per class. Each point below is one metric of one scenario, measured over two
# runs of the same load pooled together; the bars span the measured value's 95% sampling interval (a run has a few
# dozen requests, so its percentiles are estimates); the green band is +-10%. Hover a point for each of the three
# runs' own value: where a point misses the band, do the runs agree with each other? This is the recorded validation;
# `docs/dev/simulator-calibration.md` says which points miss and why. To fit and validate the simulator on *your*
# machine, run `pdlab sim probe` in a terminal: in about three minutes it times your machine's prefills, decode
# steps, mixed steps and KV transfers and fits the simulator's profile to them; `pdlab sim lab` and these notebooks
# then use it and say so. (`pdlab sim sitting`, about 1.5 hours on 2 cores, fits one from whole runs.) Before
# running any lab for real, `pdlab sim lab labs/hol-blocking.yaml` shows what it should measure, simulated in a second.

# %%
from pdlab.calibration.validate import latest_validation
from pdlab.report import validation_figure, validation_summary

recorded = latest_validation()
print(validation_summary(recorded))
validation_figure(recorded)

# %% [markdown]
# ## 1. Colocated against disaggregated, same GPUs
#
# The scenario's pools use `prefill + decode` instances of 2 GPUs each. The colocated twin runs as many colocated
# instances on the same GPUs, round-robin.

# %%
from pdlab.course_widgets import sim_table, sim_variant
from pdlab.model.catalog import load_catalog
from pdlab.sim.scenario import simulate
from pdlab.sim.worth import worth

catalog = load_catalog()
pools = spec.pools
instances = pools.prefill + pools.decode
settings = {"threshold": spec.router.threshold, "rate": spec.workload.poisson.rate_rps, "link": spec.link.name}
results = {
    f"{instances} colocated": simulate(sim_variant(spec, prefill=0, decode=instances, **settings), catalog=catalog)[0],
    f"{pools.prefill}P{pools.decode}D": simulate(spec, catalog=catalog)[0],
}
print("what these figures are worth:", worth(spec).text)
sim_table(results).round(3)

# %% [markdown]
# ## 2. The threshold on a cluster

# %%
import pandas as pd

from pdlab.report import sweep_figure

lines = []
for threshold in THRESHOLDS:
    summary, _ = simulate(spec.model_copy(update={"router": spec.router.model_copy(update={"threshold": threshold})}),
                          catalog=catalog)
    lines.append({"scenario": spec.name, "threshold": threshold, "short_itl_p99_ms": summary["short"]["itl_ms"]["p99"],
                  "long_ttft_p50_ms": summary["long"]["ttft_ms"]["p50"],
                  "attainment": summary["goodput"]["attainment"]})
sweep = pd.DataFrame(lines)
sweep_figure(sweep, x="threshold", y="attainment", title="SLO attainment against the routing threshold", target=0.9)

# %% [markdown]
# ## 3. Your turn: the panel
#
# Every control re-simulates. `prefill` at 0 turns the deployment into `decode` colocated instances; `GPUs per
# instance` is each instance's tensor parallelism (a size the simulator refuses is said under the controls).

# %%
from pdlab.course_widgets import SimPanel

panel = SimPanel(spec, catalog)
panel.widget

# %% [markdown]
# ## 4. Replica choice at cluster scale
#
# Notebook 04 moved the strategy on two replicas. Here the same router code chooses among 8 colocated
# Llama-3.1-8B instances, one H200 each, with prefix caching, replaying 80 questions a second about 400 documents
# of 4,096 tokens (`labs/sim/llama8b-h200-shared-prefix.yaml`). The documents' KV (about 215 GB in bf16) is more
# than one instance's cache holds (about 120 GB) but fits across the eight: where each document is sent decides
# how often its KV is found instead of computed. Switch `decode pool` between `roundrobin` and `prefixaware`: the
# grey bars are the setting before the switch. The right-hand bars are shares: SLO attainment, and the prompt
# tokens found in a prefix cache.

# %%
prefix_spec = load_yaml(repo_root() / "labs" / "sim" / f"{PREFIX_SCENARIO}.yaml", SimSpec)
prefix_spec = prefix_spec.model_copy(update={"workload": prefix_spec.workload.model_copy(update={
    "trace": prefix_spec.workload.trace.model_copy(update={"num_requests": PREFIX_REQUESTS})})})
replicas = SimPanel(prefix_spec, catalog)
spread = replicas.summary
replicas.decode_strategy.value = "prefixaware"
kept = replicas.wait()
replicas.widget

# %%
sim_table({"roundrobin": spread, "prefixaware": kept}).round(3)

# %% [markdown]
# ## Check: does your simulation show the effect?

# %%
colocated, disaggregated = results.values()
course.check(
    colocated["short"]["ttft_ms"]["p99"] > 2 * disaggregated["short"]["ttft_ms"]["p99"],
    f"on the same GPUs, disaggregation takes the short requests' p99 TTFT from "
    f"{colocated['short']['ttft_ms']['p99']:,.0f} ms to {disaggregated['short']['ttft_ms']['p99']:,.0f} ms "
    f"(want < 1/2), and their longest inter-token gap from {colocated['short']['itl_ms']['max']:,.0f} ms to "
    f"{disaggregated['short']['itl_ms']['max']:,.0f} ms",
    "the scenario needs long prompts (long_fraction > 0) above the threshold; raise NUM_REQUESTS",
)
course.check(
    kept["prefix_cache"]["hit_rate"] > spread["prefix_cache"]["hit_rate"] + 0.2
    and kept["goodput"]["attainment"] > spread["goodput"]["attainment"],
    f"on 8 replicas, prefix-aware routing finds {kept['prefix_cache']['hit_rate']:.0%} of prompt tokens in a cache "
    f"against {spread['prefix_cache']['hit_rate']:.0%} round-robin, and {kept['goodput']['attainment']:.0%} of "
    f"requests meet the SLOs against {spread['goodput']['attainment']:.0%}",
    "raise PREFIX_REQUESTS: the caches need a few visits per document to fill",
)

# %% [markdown]
# ## Exercises
#
# 1. In the panel, keep 8 instances and try 2P6D, 4P4D, 6P2D. Which split gives the highest attainment at 8
#    req/s? `pdlab sim search labs/sim/llama70b-h200-efa.yaml --gpus 16` searches every split.
# 2. Switch the link from `efa-p5en` to `tcp-10gbe`. At which threshold does disaggregating stop paying now?
#    Compare with what you measured on loopback in notebook 06.
# 3. Raise the rate until attainment falls under 90% for the best split: that is this cluster's goodput. What
#    limits it: the prefill pool (long TTFT) or the decode pool (ITL)?
# 4. Fewer, wider instances: in the panel set `GPUs per instance` to 8, then try 1P1D and 2 colocated (the same
#    16 GPUs). Each step is faster, but a slice of it is the GPUs' all-reduces over NVLink (docs/simulator.md,
#    "Roofline"). Which wins at 8 req/s now, colocated or disaggregated, and why does the answer differ from
#    2 GPUs per instance?
# 5. When the KV cache runs out: `pdlab sim run labs/sim/kv-pressure.yaml` puts 2,048-token prompts with
#    1,024-token answers on one L40S whose cache holds 65,536 tokens. vLLM admits a prompt when the prompt fits,
#    so the answers can outgrow the cache; then it preempts the request admitted last and later computes its
#    prompt and its tokens again. Raise `rate_rps` from 0.3 to 0.6: where do preemptions start, and what do
#    they do to TPOT p99? Would a second instance or a cache twice as large buy more? The same effect, measured
#    on your machine: `pdlab run labs/kv-pressure.yaml` (about 5 minutes) prints how many requests vLLM preempted.
# 6. In section 4's panel, try `kvaware` and `leastloaded`, then lower the rate to 40 req/s. Which strategies
#    keep documents on one instance? At what rate does round-robin meet the SLOs again, and why does prefix-aware
#    routing matter more the busier the cluster is?
