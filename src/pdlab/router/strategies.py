"""Routing decisions, kept pure: request features and a snapshot of a pool in, a choice out.

The live router (pdlab.router) and the simulator (pdlab.sim) both call these, so what the simulator predicts is
what the router does. No I/O here; the router gathers state (in-flight counts, scraped vLLM metrics) at its edges.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from pdlab.config.router import Strategy as StrategyName

Path = Literal["disaggregated", "direct"]


def decide_path(prompt_tokens: int, threshold: int) -> Path:
    """HyperPod's rule: prompts with at least `threshold` tokens are prefilled remotely; 0 disaggregates all."""
    return "disaggregated" if prompt_tokens >= threshold else "direct"


def block_hashes(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Chained hashes of the prompt's full KV blocks: block i's hash covers tokens [0, (i+1)*block_size), so equal
    hashes mean equal prefixes (the way vLLM's prefix cache identifies blocks)."""
    hashes: list[int] = []
    running = hashlib.blake2b(digest_size=8)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        running.update(b"".join(t.to_bytes(4, "little") for t in token_ids[start:start + block_size]))
        hashes.append(int.from_bytes(running.copy().digest(), "little"))
    return tuple(hashes)


@dataclass(frozen=True)
class RequestFeatures:
    """What a strategy may know about a request."""

    prompt_tokens: int
    block_hashes: tuple[int, ...] = ()
    session_key: str | None = None


@dataclass(frozen=True)
class ReplicaState:
    """A snapshot of one replica in a pool."""

    url: str
    in_flight: int = 0
    """Requests the router has in flight to this replica."""
    running: int | None = None
    """vLLM's `vllm:num_requests_running`, when scraped."""
    waiting: int | None = None
    """vLLM's `vllm:num_requests_waiting`, when scraped."""
    healthy: bool = True


class RoutingStrategy(ABC):
    """Chooses one replica of a pool for a request. Subclasses set `name` and implement `choose`; those that
    learn from history also implement `observe`. Adding a strategy is one subclass plus one registry entry."""

    name: ClassVar[StrategyName]

    @abstractmethod
    def choose(self, request: RequestFeatures, replicas: Sequence[ReplicaState]) -> int:
        """Index into `replicas` (all of which the caller considers eligible; never empty)."""

    def observe(self, request: RequestFeatures, replica: ReplicaState) -> None:  # noqa: B027 (optional hook)
        """Record that `request` was sent to `replica` (history-based strategies)."""


class RoundRobin(RoutingStrategy):
    """Take turns."""

    name = "roundrobin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RequestFeatures, replicas: Sequence[ReplicaState]) -> int:
        index = self._next % len(replicas)
        self._next += 1
        return index


STRATEGIES: dict[str, type[RoutingStrategy]] = {cls.name: cls for cls in (RoundRobin,)}


def make_strategy(name: StrategyName) -> RoutingStrategy:
    try:
        return STRATEGIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing strategy {name!r}; known: {', '.join(STRATEGIES)}") from None
