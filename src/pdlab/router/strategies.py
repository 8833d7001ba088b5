"""Routing decisions, kept pure: request features and a snapshot of a pool in, a choice out.

The live router (pdlab.router) and the simulator (pdlab.sim) both call these, so what the simulator predicts is
what the router does. No I/O here; the router gathers state (in-flight counts, scraped vLLM metrics) at its edges.
"""

from __future__ import annotations

import bisect
import hashlib
import sys
from abc import ABC, abstractmethod
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from pdlab.config.router import Strategy as StrategyName
from pdlab.config.router import ThresholdBasis

Path = Literal["disaggregated", "direct"]


def decide_path(prompt_tokens: int, threshold: int) -> Path:
    """HyperPod's rule: prompts with at least `threshold` tokens are prefilled remotely; 0 disaggregates all.
    (With `threshold_basis: uncached`, `prompt_tokens` is the uncached part: see `decide`.)"""
    return "disaggregated" if prompt_tokens >= threshold else "direct"


@dataclass(frozen=True)
class Decision:
    """A path and why it was taken (the router's `x-pdlab-reason` header and `pdlab_router_decisions_total`)."""

    path: str
    """`disaggregated` or `direct` (the router also serves on a prefill instance, `prefill`, or refuses, `none`)."""
    reason: str
    """`over_threshold`, `under_threshold`, or `cached_prefix` (long prompt, short uncached part); the router adds
    `no_prefill_pool`, `breaker_open`, `prefill_down`, `prefill_error`, `decode_empty` and `decode_down`."""
    counted_tokens: int
    """The tokens compared with the threshold."""


def decide(prompt_tokens: int, cached_tokens: int, threshold: int, basis: ThresholdBasis) -> Decision:
    """The P/D decision by `basis`: `prompt` compares the whole prompt with the threshold; `uncached` only the
    tokens past `cached_tokens` (the prefix the chosen decode replica is expected to hold)."""
    counted = prompt_tokens - min(cached_tokens, prompt_tokens) if basis == "uncached" else prompt_tokens
    path = decide_path(counted, threshold)
    if path == "disaggregated":
        return Decision(path, "over_threshold", counted)
    if basis == "uncached" and decide_path(prompt_tokens, threshold) == "disaggregated":
        return Decision(path, "cached_prefix", counted)
    return Decision(path, "under_threshold", counted)


def block_hashes(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Chained hashes of the prompt's full KV blocks: block i's hash covers tokens [0, (i+1)*block_size), so equal
    hashes mean equal prefixes (the way vLLM's prefix cache identifies blocks). Token ids are hashed as 4-byte
    little-endian integers; an `array('I')` of them (what the router's tokenizer keeps) is hashed from its memory
    directly."""
    if isinstance(token_ids, array) and token_ids.itemsize == 4 and token_ids.typecode == "I":
        data = token_ids.tobytes() if sys.byteorder == "little" else _swapped(token_ids)
    else:
        data = b"".join(int(t).to_bytes(4, "little") for t in token_ids)
    hashes: list[int] = []
    running = hashlib.blake2b(digest_size=8)
    step = 4 * block_size
    for start in range(0, len(data) - step + 1, step):
        running.update(data[start:start + step])
        hashes.append(int.from_bytes(running.copy().digest(), "little"))
    return tuple(hashes)


def _swapped(token_ids: array) -> bytes:
    copy = array("I", token_ids)
    copy.byteswap()
    return copy.tobytes()


class PrefixCacheModel:
    """What a replica's prefix cache is expected to hold, from the blocks sent to it: an LRU of block hashes,
    `capacity` blocks long (vLLM evicts least recently used free blocks too). Used by `kvaware` and by the
    `uncached` threshold basis."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def cached_blocks(self, url: str, blocks: Sequence[int]) -> int:
        """Leading blocks of `blocks` expected in `url`'s cache (a prefix cache reuses only a leading run)."""
        cached = self._blocks.get(url)
        if not cached:
            return 0
        hits = 0
        for block in blocks:
            if block not in cached:
                break
            hits += 1
        return hits

    def add(self, url: str, blocks: Sequence[int]) -> None:
        cached = self._blocks.setdefault(url, OrderedDict())
        for block in blocks:
            cached[block] = None
            cached.move_to_end(block)
        while len(cached) > self.capacity:
            cached.popitem(last=False)

    def forget(self, url: str) -> None:
        """The replica lost its cache (it restarted)."""
        self._blocks.pop(url, None)


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


def _stable_hash(text: str) -> int:
    """A 64-bit hash that is the same in every process (Python's `hash` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def replica_load(replica: ReplicaState) -> int:
    """How busy a replica looks: the router's own in-flight count, or vLLM's running + waiting when that is higher
    (it also sees requests that reached the replica another way). Taking the max, not the sum, avoids counting the
    router's own requests twice; the scraped figures lag by a scrape interval, the in-flight count does not."""
    scraped = (replica.running or 0) + (replica.waiting or 0)
    return max(replica.in_flight, scraped)


class _TieBreaker:
    """Rotates among equally good replicas, so ties spread load instead of always hitting the first one."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, candidates: Sequence[int]) -> int:
        choice = candidates[self._turn % len(candidates)]
        self._turn += 1
        return choice


class SessionAffinity(RoutingStrategy):
    """Consistent hashing of the session key (a session header or the request's `user` field) onto a ring of
    virtual nodes: a session sticks to one replica, and adding or removing a replica moves only ~1/n of the
    sessions. Requests without a session key take turns."""

    name = "session"
    virtual_nodes: ClassVar[int] = 64

    def __init__(self) -> None:
        self._rings: dict[tuple[str, ...], tuple[list[int], list[str]]] = {}
        self._keyless = RoundRobin()

    def _ring(self, urls: tuple[str, ...]) -> tuple[list[int], list[str]]:
        if urls not in self._rings:
            points = sorted((_stable_hash(f"{url}#{v}"), url) for url in urls for v in range(self.virtual_nodes))
            self._rings = {urls: ([p for p, _ in points], [u for _, u in points])}  # keep only the current pool
        return self._rings[urls]

    def choose(self, request: RequestFeatures, replicas: Sequence[ReplicaState]) -> int:
        if request.session_key is None:
            return self._keyless.choose(request, replicas)
        urls = tuple(r.url for r in replicas)
        points, owners = self._ring(urls)
        at = bisect.bisect_left(points, _stable_hash(request.session_key)) % len(points)
        return urls.index(owners[at])


class PrefixAware(RoutingStrategy):
    """Send a prompt where the longest prefix of it was sent before (by chained block hashes, so a match of k
    blocks means the first k*block_size tokens are equal). Remembers the most recent `max_entries` blocks; no
    match (or a prompt shorter than a block) falls back to the least loaded replica."""

    name = "prefixaware"
    max_entries: ClassVar[int] = 200_000

    def __init__(self) -> None:
        self._owner: OrderedDict[int, str] = OrderedDict()  # block hash -> replica url that last got it
        self._ties = _TieBreaker()

    def choose(self, request: RequestFeatures, replicas: Sequence[ReplicaState]) -> int:
        urls = [r.url for r in replicas]
        # Chained hashes: the longest matched prefix is the last block hash we have seen, scanning from the end.
        for block in reversed(request.block_hashes):
            owner = self._owner.get(block)
            if owner in urls:
                return urls.index(owner)
        return _least_loaded(replicas, self._ties)

    def observe(self, request: RequestFeatures, replica: ReplicaState) -> None:
        for block in request.block_hashes:
            self._owner[block] = replica.url
            self._owner.move_to_end(block)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)


class KVAware(RoutingStrategy):
    """Prefer the replica most likely to still hold the prompt's KV blocks, without piling onto one replica.

    Each replica's prefix cache is modelled from routing history as an LRU of block hashes, `cache_blocks` long
    (vLLM evicts least recently used free blocks too). The score is the number of leading prompt blocks in that
    model. When loads are unbalanced by more than `balance_abs` requests (SGLang's cache-aware rule), the least
    loaded replica wins regardless of cache; otherwise the best score wins, ties going to the least loaded."""

    name = "kvaware"
    cache_blocks: ClassVar[int] = 4096
    balance_abs: ClassVar[int] = 4

    def __init__(self) -> None:
        self._cache = PrefixCacheModel(self.cache_blocks)
        self._ties = _TieBreaker()

    def choose(self, request: RequestFeatures, replicas: Sequence[ReplicaState]) -> int:
        loads = [replica_load(r) for r in replicas]
        if max(loads) - min(loads) > self.balance_abs:
            return _least_loaded(replicas, self._ties)
        hits = [self._cache.cached_blocks(r.url, request.block_hashes) for r in replicas]
        best = max(hits)
        candidates = [i for i, h in enumerate(hits) if h == best]
        lightest = min(loads[i] for i in candidates)
        return self._ties.pick([i for i in candidates if loads[i] == lightest])

    def observe(self, request: RequestFeatures, replica: ReplicaState) -> None:
        self._cache.capacity = self.cache_blocks  # a class setting, which a test (or a subclass) may change
        self._cache.add(replica.url, request.block_hashes)


class LeastLoaded(RoutingStrategy):
    """Fewest requests in flight (see `replica_load`); ties take turns."""

    name = "leastloaded"

    def __init__(self) -> None:
        self._ties = _TieBreaker()

    def choose(self, request: RequestFeatures, replicas: Sequence[ReplicaState]) -> int:
        return _least_loaded(replicas, self._ties)


def _least_loaded(replicas: Sequence[ReplicaState], ties: _TieBreaker) -> int:
    loads = [replica_load(r) for r in replicas]
    lightest = min(loads)
    return ties.pick([i for i, load in enumerate(loads) if load == lightest])


STRATEGIES: dict[str, type[RoutingStrategy]] = {
    cls.name: cls for cls in (RoundRobin, SessionAffinity, PrefixAware, KVAware, LeastLoaded)
}

#: Strategies that need the prompt's block hashes (the router skips hashing for the others).
NEEDS_BLOCK_HASHES = frozenset({"prefixaware", "kvaware"})
#: Strategies that use scraped vLLM load figures.
NEEDS_LOAD_METRICS = frozenset({"leastloaded", "kvaware", "prefixaware"})


def make_strategy(name: StrategyName) -> RoutingStrategy:
    try:
        return STRATEGIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing strategy {name!r}; known: {', '.join(STRATEGIES)}") from None
