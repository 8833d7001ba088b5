"""Routing decisions on scripted sequences: pure functions, no I/O."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdlab.router.strategies import (
    STRATEGIES,
    KVAware,
    LeastLoaded,
    PrefixAware,
    ReplicaState,
    RequestFeatures,
    RoundRobin,
    SessionAffinity,
    block_hashes,
    decide_path,
    make_strategy,
)

URLS = ["http://a", "http://b", "http://c"]


def pool(*loads: int) -> list[ReplicaState]:
    return [ReplicaState(url=u, in_flight=n) for u, n in zip(URLS, loads, strict=True)]


def route(strategy, request: RequestFeatures, replicas: list[ReplicaState]) -> int:
    index = strategy.choose(request, replicas)
    strategy.observe(request, replicas[index])
    return index


def prompt(*blocks: int, block_size: int = 4) -> RequestFeatures:
    """A prompt made of whole blocks; each argument picks the block's token values."""
    tokens = [b * 100 + i for b in blocks for i in range(block_size)]
    return RequestFeatures(prompt_tokens=len(tokens), block_hashes=block_hashes(tokens, block_size))


@pytest.mark.parametrize(("tokens", "threshold", "path"), [
    (4095, 4096, "direct"), (4096, 4096, "disaggregated"), (4097, 4096, "disaggregated"),
    (0, 0, "disaggregated"), (1, 0, "disaggregated"), (9, 10, "direct"), (10, 10, "disaggregated"),
])
def test_threshold_boundary(tokens, threshold, path):
    assert decide_path(tokens, threshold) == path


def test_block_hashes_are_chained_prefix_hashes():
    a = block_hashes(list(range(10)), 4)
    b = block_hashes(list(range(8)) + [99, 98], 4)
    c = block_hashes([7] + list(range(1, 10)), 4)
    assert len(a) == 2  # partial last block not hashed
    assert a == b  # same first 8 tokens
    assert a[0] != c[0] and a[1] != c[1]  # a change in block 0 changes every later hash
    assert block_hashes([1, 2, 3], 4) == ()


def test_roundrobin_takes_turns():
    strategy = RoundRobin()
    assert [route(strategy, RequestFeatures(1), pool(0, 0, 0)) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_session_sticks_and_spreads():
    strategy = SessionAffinity()
    replicas = pool(0, 0, 0)
    sessions = [f"user-{i}" for i in range(60)]
    first = {s: route(strategy, RequestFeatures(1, session_key=s), replicas) for s in sessions}
    again = {s: route(strategy, RequestFeatures(1, session_key=s), pool(5, 0, 9)) for s in sessions}
    assert first == again  # load does not move a session
    assert set(first.values()) == {0, 1, 2}  # sessions spread over all replicas


def test_session_consistent_hashing_moves_few_sessions_when_a_replica_leaves():
    strategy = SessionAffinity()
    sessions = [f"s{i}" for i in range(300)]
    before = {s: URLS[strategy.choose(RequestFeatures(1, session_key=s), pool(0, 0, 0))] for s in sessions}
    two = pool(0, 0, 0)[:2]
    after = {s: two[strategy.choose(RequestFeatures(1, session_key=s), two)].url for s in sessions}
    moved = [s for s in sessions if before[s] != after[s]]
    assert all(before[s] == "http://c" for s in moved)  # only the departed replica's sessions move
    assert all(after[s] == before[s] for s in sessions if before[s] != "http://c")


def test_session_without_key_takes_turns():
    strategy = SessionAffinity()
    assert [route(strategy, RequestFeatures(1), pool(0, 0, 0)) for _ in range(4)] == [0, 1, 2, 0]


def test_session_hash_does_not_depend_on_pythonhashseed():
    code = ("from pdlab.router.strategies import SessionAffinity, RequestFeatures, ReplicaState\n"
            "s = SessionAffinity(); r = [ReplicaState(url=f'http://r{i}') for i in range(5)]\n"
            "print([s.choose(RequestFeatures(1, session_key=f'k{i}'), r) for i in range(40)])")
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={"PYTHONHASHSEED": seed, "PYTHONPATH": ":".join(sys.path)}).stdout
               for seed in ("1", "2", "random")}
    assert len(outputs) == 1


def test_prefixaware_follows_the_longest_shared_prefix():
    strategy = PrefixAware()
    replicas = pool(0, 0, 0)
    assert route(strategy, prompt(1, 2, 3), replicas) == 0  # nothing seen: least loaded, first
    assert route(strategy, prompt(7, 8), replicas) == 1  # nothing shared: the tie rotates
    assert route(strategy, prompt(1, 2, 3, 4), replicas) == 0  # shares 3 blocks with replica a
    assert route(strategy, prompt(7, 8, 9), pool(5, 9, 0)) == 1  # prefix beats load
    assert route(strategy, prompt(1, 5), replicas) == 0  # one shared block still counts
    assert route(strategy, prompt(6), pool(3, 1, 2)) == 1  # no match: least loaded


def test_prefixaware_prefers_the_replica_with_the_longer_match():
    strategy = PrefixAware()
    assert route(strategy, prompt(1), pool(0, 9, 9)) == 0  # a has [1]
    assert route(strategy, prompt(5, 6, 7), pool(9, 0, 9)) == 1  # b has [5, 6, 7]
    assert route(strategy, prompt(5, 6), pool(0, 9, 0)) == 1  # prefix beats load
    assert strategy.choose(prompt(5, 6, 7, 8), pool(0, 0, 0)) == 1
    assert strategy.choose(prompt(1, 6), pool(0, 0, 0)) == 0
    without_a = [ReplicaState("http://b", in_flight=3), ReplicaState("http://c")]
    assert strategy.choose(prompt(1, 6), without_a) == 1  # a gone: no match among the rest, least loaded


def test_kvaware_forgets_evicted_blocks():
    def scenario(evict: bool) -> int:
        strategy = KVAware()
        strategy.cache_blocks = 3  # a small modelled cache: 3 blocks per replica
        assert route(strategy, prompt(1, 2), pool(0, 9, 9)) == 0  # a caches [1], [1, 2]
        if evict:
            assert route(strategy, prompt(7, 8), pool(0, 9, 9)) == 0  # a caches 2 more: [1] is evicted
        # Without block [1], a prefix cache cannot reuse [1, 2]: a has no hits, and the lighter replica wins.
        return strategy.choose(prompt(1, 2), pool(1, 0, 1))

    assert scenario(evict=False) == 0
    assert scenario(evict=True) == 1


def test_leastloaded_uses_in_flight_and_scraped_load():
    strategy = LeastLoaded()
    assert route(strategy, RequestFeatures(1), pool(3, 1, 2)) == 1
    scraped = [ReplicaState("http://a", in_flight=0, running=4, waiting=3),
               ReplicaState("http://b", in_flight=2, running=2, waiting=0),
               ReplicaState("http://c", in_flight=1, running=1, waiting=5)]
    assert route(strategy, RequestFeatures(1), scraped) == 1  # loads 7, 2, 6
    assert [route(strategy, RequestFeatures(1), pool(1, 0, 0)) for _ in range(4)] == [1, 2, 1, 2]  # ties rotate


def test_registry_names_every_strategy():
    assert set(STRATEGIES) == {"roundrobin", "session", "prefixaware", "kvaware", "leastloaded"}
    for name in STRATEGIES:
        assert make_strategy(name).name == name
    with pytest.raises(ValueError, match="unknown routing strategy 'nope'"):
        make_strategy("nope")
