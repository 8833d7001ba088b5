"""A pool of replicas (the prefill or the decode instances): what the router knows about each, and the choice
among them through a pure `RoutingStrategy`."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pdlab.config.router import Strategy
from pdlab.router.strategies import NEEDS_BLOCK_HASHES, ReplicaState, RequestFeatures, make_strategy

#: Seconds a replica that refused a connection is left out of choices (then tried again).
DOWN_COOLDOWN_S = 2.0


@dataclass
class Replica:
    url: str
    in_flight: int = 0
    running: int | None = None
    waiting: int | None = None
    down_until: float = 0.0

    def state(self, now: float) -> ReplicaState:
        return ReplicaState(url=self.url, in_flight=self.in_flight, running=self.running, waiting=self.waiting,
                            healthy=now >= self.down_until)


class Pool:
    """Replicas of one role plus the strategy that picks among them. Not thread-safe: one event loop owns it."""

    def __init__(self, role: str, urls: list[str], strategy: Strategy):
        self.role = role
        self.replicas = [Replica(url.rstrip("/")) for url in urls]
        self.strategy_name: Strategy = strategy
        self.strategy = make_strategy(strategy)

    def set_strategy(self, name: Strategy) -> None:
        if name != self.strategy_name:  # a new strategy starts with no history
            self.strategy_name = name
            self.strategy = make_strategy(name)

    @property
    def needs_block_hashes(self) -> bool:
        return self.strategy_name in NEEDS_BLOCK_HASHES

    def all_down(self) -> bool:
        now = time.monotonic()
        return all(now < r.down_until for r in self.replicas)

    def choose(self, features: RequestFeatures, exclude: set[str] = frozenset()) -> Replica | None:
        """The replica for this request: among healthy ones not in `exclude` (all not excluded when none is
        healthy, since a cooldown is only a guess). None when the pool is empty or everything is excluded."""
        now = time.monotonic()
        candidates = [r for r in self.replicas if r.url not in exclude]
        healthy = [r for r in candidates if now >= r.down_until]
        candidates = healthy or candidates
        if not candidates:
            return None
        states = [r.state(now) for r in candidates]
        chosen = candidates[self.strategy.choose(features, states)]
        self.strategy.observe(features, states[candidates.index(chosen)])
        return chosen

    @staticmethod
    def mark_down(replica: Replica) -> None:
        replica.down_until = time.monotonic() + DOWN_COOLDOWN_S

    async def scrape(self, client: aiohttp.ClientSession) -> None:
        """Refresh vLLM's running/waiting gauges of every replica (None where the scrape fails)."""
        for replica in self.replicas:
            try:
                async with client.get(replica.url + "/metrics") as response:
                    response.raise_for_status()
                    replica.running, replica.waiting = parse_load(await response.text())
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                replica.running = replica.waiting = None


def parse_load(exposition: str) -> tuple[int | None, int | None]:
    """`vllm:num_requests_running` and `vllm:num_requests_waiting` from a Prometheus text page (summed over label
    sets, e.g. several model names)."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        if family.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            found[family.name] = sum(sample.value for sample in family.samples)
    running = found.get("vllm:num_requests_running")
    waiting = found.get("vllm:num_requests_waiting")
    return (None if running is None else int(running)), (None if waiting is None else int(waiting))
