"""A pool of replicas (the prefill or the decode instances): what the router knows about each (its circuit
breaker, requests in flight, scraped load), and the choice among them through a pure `RoutingStrategy`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pdlab.config.router import Strategy
from pdlab.router.strategies import NEEDS_BLOCK_HASHES, ReplicaState, RequestFeatures, make_strategy
from pdlab.router.upstream import Target, target

BreakerState = Literal["closed", "open", "half_open"]


@dataclass
class CircuitBreaker:
    """Closed (requests flow), open (none, for `open_s`), half-open (one trial: success closes, failure opens
    again). Fed by request outcomes and by active health checks. `clock` is injectable for tests."""

    failures_to_open: int = 3
    open_s: float = 2.0
    clock: Callable[[], float] = time.monotonic
    state: BreakerState = "closed"
    failures: int = 0
    opened_at: float = 0.0
    trial_out: bool = False
    """Half-open: a trial request is in flight (no other request goes until it ends)."""
    on_change: Callable[[BreakerState], None] | None = field(default=None, repr=False)

    def available(self) -> bool:
        """Whether a request may go now (a half-open breaker lets one trial through: call `allow` to take it)."""
        if self.state == "closed":
            return True
        if self.state == "open":
            return self.clock() - self.opened_at >= self.open_s
        return not self.trial_out

    def allow(self) -> None:
        """A request goes to the replica now (after `available` said yes)."""
        if self.state == "open":
            self._set("half_open")
        if self.state == "half_open":
            self.trial_out = True

    def success(self) -> None:
        self.failures = 0
        self.trial_out = False
        if self.state != "closed":
            self._set("closed")

    def failure(self, at_once: bool = False) -> None:
        """A failed request or health check; `at_once` (a refused connection: nothing listens) opens the breaker
        without waiting for more."""
        self.failures += 1
        self.trial_out = False
        if self.state == "half_open" or at_once or self.failures >= self.failures_to_open:
            self.opened_at = self.clock()
            if self.state != "open":
                self._set("open")

    def health(self, ok: bool, refused: bool = False) -> None:
        """An active health check's outcome: a failure counts like a failed request; a success closes an open
        breaker only once its open time is over (so a replica that answers /health but fails requests is not
        hammered), and is no news to a closed one."""
        if not ok:
            self.failure(at_once=refused)
        elif self.state != "closed" and self.clock() - self.opened_at >= self.open_s:
            self.success()

    def _set(self, state: BreakerState) -> None:
        self.state = state
        if self.on_change is not None:
            self.on_change(state)


@dataclass
class Replica:
    url: str
    breaker: CircuitBreaker
    in_flight: int = 0
    running: int | None = None
    waiting: int | None = None
    _endpoints: dict[str, Target] = field(default_factory=dict, repr=False)

    def endpoint(self, path: str) -> Target:
        """`url + path`, parsed once."""
        found = self._endpoints.get(path)
        if found is None:
            found = self._endpoints[path] = target(self.url + path)
        return found

    def state(self) -> ReplicaState:
        return ReplicaState(url=self.url, in_flight=self.in_flight, running=self.running, waiting=self.waiting,
                            healthy=self.breaker.state == "closed")


class Pool:
    """Replicas of one role plus the strategy that picks among them. Not thread-safe: one event loop owns it."""

    def __init__(self, role: str, urls: list[str], strategy: Strategy, failures_to_open: int = 3,
                 open_s: float = 2.0, on_breaker: Callable[[Replica, BreakerState], None] | None = None):
        self.role = role
        self.replicas = [Replica(url.rstrip("/"), CircuitBreaker(failures_to_open, open_s)) for url in urls]
        if on_breaker is not None:
            for replica in self.replicas:
                replica.breaker.on_change = lambda state, replica=replica: on_breaker(replica, state)
        self.strategy_name: Strategy = strategy
        self.strategy = make_strategy(strategy)

    def set_strategy(self, name: Strategy) -> None:
        if name != self.strategy_name:  # a new strategy starts with no history
            self.strategy_name = name
            self.strategy = make_strategy(name)

    @property
    def needs_block_hashes(self) -> bool:
        return self.strategy_name in NEEDS_BLOCK_HASHES

    def available(self) -> bool:
        """Whether some replica may take a request now (its breaker closed, or ready for a trial)."""
        return any(r.breaker.available() for r in self.replicas)

    def choose(self, features: RequestFeatures, exclude: set[str] | frozenset[str] = frozenset()
               ) -> Replica | None:
        """The replica for this request among those whose breaker lets it through and not in `exclude`; None when
        there is none. Takes a half-open breaker's trial when it picks that replica."""
        candidates = [r for r in self.replicas if r.url not in exclude and r.breaker.available()]
        if not candidates:
            return None
        states = [r.state() for r in candidates]
        index = self.strategy.choose(features, states)
        chosen, state = candidates[index], states[index]
        self.strategy.observe(features, state)
        chosen.breaker.allow()
        return chosen

    async def check_health(self, client: aiohttp.ClientSession) -> None:
        """`GET /health` on every replica, feeding each breaker."""
        async def check(replica: Replica) -> None:
            try:
                async with client.get(replica.url + "/health") as response:
                    await response.read()
                    replica.breaker.health(response.status == 200)
            except aiohttp.ClientConnectorError:
                replica.breaker.health(False, refused=True)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                replica.breaker.health(False)

        await asyncio.gather(*(check(replica) for replica in self.replicas))

    async def scrape(self, client: aiohttp.ClientSession) -> None:
        """Refresh vLLM's running/waiting gauges of every replica (None where the scrape fails)."""
        for replica in self.replicas:
            try:
                async with client.get(replica.url + "/metrics") as response:
                    response.raise_for_status()
                    replica.running, replica.waiting = parse_load(await response.text())
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                replica.running = replica.waiting = None

    def describe(self) -> list[dict[str, object]]:
        return [{"url": r.url, "breaker": r.breaker.state, "in_flight": r.in_flight} for r in self.replicas]


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
