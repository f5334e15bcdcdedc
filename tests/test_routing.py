"""minivllm/routing.py (Chapter 18): the prefix tree, the choice rule, tenants kept apart. No Ray."""

from __future__ import annotations

import random

import pytest

from minivllm.routing import PrefixRouter, PrefixTree, choose, route_root

B = 4


def test_longest_prefix_in_whole_blocks():
    tree = PrefixTree(block_size=B)
    root = route_root(None)
    tree.insert(list(range(12)), root, "a")
    tree.insert(list(range(8)) + [99, 98, 97, 96], root, "b")
    assert tree.matches(list(range(12)) + [5], root) == {"a": 12, "b": 8}
    assert tree.matches(list(range(7)), root) == {"a": 4, "b": 4}     # the partial block is not matched
    assert tree.matches([7, 7, 7, 7], root) == {}


def test_salts_and_adapters_share_no_node():
    tree = PrefixTree(block_size=B)
    ids = list(range(16))
    tree.insert(ids, route_root("tenant-a"), "a")
    assert tree.matches(ids, route_root("tenant-b")) == {}
    assert tree.matches(ids, route_root("tenant-a", "sql-adapter")) == {}
    assert tree.matches(ids, route_root(None)) == {}
    assert tree.matches(ids, route_root("tenant-a")) == {"a": 16}


def test_size_is_capped_and_forget_drops_a_replica():
    tree = PrefixTree(block_size=B, max_nodes=5)
    root = route_root(None)
    tree.insert(list(range(40)), root, "a")   # 10 blocks, only the last 5 kept
    assert len(tree.nodes) == 5
    assert tree.matches(list(range(40)), root) == {}   # the path's start was evicted: nothing matches
    tree = PrefixTree(block_size=B)
    tree.insert(list(range(8)), root, "a")
    tree.insert(list(range(8)), root, "b")
    tree.forget("a")
    assert tree.matches(list(range(8)), root) == {"b": 8}
    with pytest.raises(ValueError):
        PrefixTree(block_size=0)


def test_choice_rule():
    loads = {"a": 3, "b": 0, "c": 1}
    assert choose({}, loads) == "b"                          # no prefix anywhere: the least loaded
    assert choose({"a": 32}, loads, imbalance=4) == "a"       # warm and not too busy
    assert choose({"a": 32}, loads, imbalance=2) == "b"       # warm but 3 > 0 + 2: the least loaded
    assert choose({"a": 32, "c": 32}, loads) == "c"           # equal matches: the less loaded
    assert choose({"a": 16, "c": 32}, loads) == "c"
    with pytest.raises(ValueError):
        choose({}, {})


def test_tenants_stick_to_replicas_and_beat_random():
    """8 tenants, each a system prompt, over 2 replicas: the router sends each tenant's later
    requests where its prompt went first; a random pick would find it warm only half the time."""
    rng = random.Random(0)
    systems = {t: [rng.randrange(1000) for _ in range(64)] for t in range(8)}
    router = PrefixRouter(block_size=B, imbalance=100)
    first: dict[int, str] = {}
    for n in range(48):
        tenant = n % 8
        ids = systems[tenant] + [rng.randrange(1000) for _ in range(10)]
        replica = router.route(ids, {"r0": 0, "r1": 0}, salt=f"key-{tenant}")
        first.setdefault(tenant, replica)
        assert replica == first[tenant]
    assert router.warm == 40 and router.routed == 48


def test_a_dead_replica_is_not_chosen():
    router = PrefixRouter(block_size=B)
    ids = list(range(16))
    assert router.route(ids, {"a": 0}) == "a"
    assert router.route(ids, {"b": 0, "c": 1}) == "b"   # "a" is gone from the loads: never picked
