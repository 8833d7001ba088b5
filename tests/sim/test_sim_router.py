"""The simulator routes with pdlab.router's own decision code: replaying its recorded choices through fresh
strategy objects gives the same answers, for every registered strategy."""

from __future__ import annotations

import pytest

from pdlab.config.sim import SimSpec
from pdlab.router.strategies import STRATEGIES, decide_path, make_strategy
from pdlab.sim.scenario import build, prepare
from pdlab.sim.workload import arrivals


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_simulated_decisions_replay_identically_through_the_router_strategies(name: str) -> None:
    spec = SimSpec.model_validate({
        "model": "Llama-3.1-8B", "hardware": "A100-SXM4-80GB", "pools": {"prefill": 3, "decode": 2},
        "router": {"threshold": 2048, "prefill_strategy": name, "decode_strategy": name},
        "workload": {"poisson": {"rate_rps": 30, "num_requests": 200, "long_fraction": 0.5, "seed": 3}},
    })
    sim = build(prepare(spec))
    sim.trace = []
    requests = sim.run(arrivals(spec.workload))

    for request in requests:
        assert request.path == decide_path(request.arrival.prompt_tokens, spec.router.threshold)
    replay = {"prefill": make_strategy(name), "decode": make_strategy(name)}
    assert sim.trace and {pool for pool, *_ in sim.trace} == {"prefill", "decode"}
    for pool, features, states, chosen in sim.trace:
        strategy = replay[pool]
        index = strategy.choose(features, states)
        strategy.observe(features, states[index])
        assert index == chosen


def test_roundrobin_spreads_evenly() -> None:
    spec = SimSpec.model_validate({
        "model": "Llama-3.1-8B", "hardware": "H100-SXM5-80GB", "pools": {"colocated": 4},
        "workload": {"poisson": {"rate_rps": 10, "num_requests": 100}},
    })
    sim = build(prepare(spec))
    sim.run(arrivals(spec.workload))
    counts = {}
    for _, _, _, decode in sim.decisions:
        counts[decode] = counts.get(decode, 0) + 1
    assert counts == {f"colocated-{i}": 25 for i in range(4)}
