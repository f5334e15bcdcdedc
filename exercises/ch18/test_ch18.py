"""Chapter 18's exercises: the router's tree in blocks, tenants that stick, pow2, salts apart."""

import random

from harness import catches, patched, within
from minivllm import routing
from minivllm.routing import PrefixRouter, PrefixTree, route_root


def test_18_1_whole_blocks(answers):
    tree = PrefixTree(block_size=16)
    first = list(range(50))
    tree.insert(first, route_root(None), "a")
    second = first[:40] + [999] * 20
    within(answers.MATCHED_TOKENS, tree.matches(second, route_root(None)).get("a", 0), what="MATCHED_TOKENS")


def tenants_workload(seed: int = 0):
    rng = random.Random(seed)
    systems = {t: [rng.randrange(1000) for _ in range(64)] for t in range(8)}
    return [(n % 8, systems[n % 8] + [rng.randrange(1000) for _ in range(10)]) for n in range(48)]


def test_18_2_warm_requests(answers):
    router = PrefixRouter(block_size=16, imbalance=100)
    for tenant, ids in tenants_workload():
        router.route(ids, {"r0": 0, "r1": 0}, salt=f"key-{tenant}")
    within(answers.WARM_REQUESTS, router.warm, what="WARM_REQUESTS")


def reference_pow2(loads, rng):
    names = sorted(loads)
    if len(names) == 1:
        return names[0]
    a, b = rng.sample(names, 2)
    return b if loads[b] < loads[a] else a


def warm_share(choose) -> float:
    """The share of requests sent where their tenant's prefix already went, over 4 replicas."""
    sent: dict[int, set] = {}
    warm = 0
    for tenant, _ in tenants_workload():
        replica = choose(tenant)
        warm += replica in sent.get(tenant, set())
        sent.setdefault(tenant, set()).add(replica)
    return warm / 48


def test_18_3_pow2(answers):
    for seed in range(200):
        loads = {f"r{i}": random.Random(seed * 10 + i).randrange(5) for i in range(1 + seed % 4)}
        assert answers.pow2(loads, random.Random(seed)) == reference_pow2(loads, random.Random(seed)), (seed, loads)
    rng, loads = random.Random(0), {f"r{i}": 0 for i in range(4)}
    mine = warm_share(lambda tenant: answers.pow2(loads, rng))
    router, jobs = PrefixRouter(block_size=16, imbalance=100), iter(tenants_workload())
    prefix = warm_share(lambda tenant: router.route(next(jobs)[1], loads, salt=f"key-{tenant}"))
    assert prefix > mine + 0.3, f"pow2 found {mine:.2f} of requests warm, the prefix router {prefix:.2f}"


# --- the planted defect (read it after you have tried) ---------------------------------------
def salt_forgotten(original):
    return lambda salt, adapter=None: original(None, adapter)   # every tenant shares one root


def test_18_4_find_the_bug(answers):
    catches(answers.check_salts_apart, lambda: patched("minivllm.routing:route_root", salt_forgotten),
            lambda: PrefixRouter(block_size=4, imbalance=4), what="check_salts_apart")
    assert routing.route_root("a") != routing.route_root("b")
