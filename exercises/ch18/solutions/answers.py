"""Chapter 18 exercises: the prefix-aware router (minivllm/routing.py) (the shipped solutions)."""


# 18.1: the tree keeps whole blocks only. The 50-token prompt left 3 blocks (48 tokens; the last
# 2 tokens are no block); the new prompt agrees on tokens 0-39: blocks 0 and 1 (0-31) match,
# block 2 (32-47) differs at token 40. So 32, not 40: a router, like the cache, counts blocks.
MATCHED_TOKENS = 32


# 18.2: each tenant's first request finds nothing and goes to the least loaded replica; its
# five later ones find its system prompt (four whole blocks) where the first went. 8 cold, 40 warm.
WARM_REQUESTS = 40


def pow2(loads: dict, rng) -> str:
    # Two random candidates, the shorter queue: most of the benefit of asking every replica
    # (Mitzenmacher's result) for the price of two questions. It never looks at the prompt,
    # which is why it spreads a tenant's prefix over every replica.
    names = sorted(loads)
    if len(names) == 1:
        return names[0]
    a, b = rng.sample(names, 2)
    return b if loads[b] < loads[a] else a


def check_salts_apart(router) -> None:
    # Tenant a's prompt goes to x (the least loaded). Then tenant b sends the same ids while x is
    # busier than y but within the imbalance: a router that sees a warm prefix on x picks x,
    # one that keeps salts apart sees nothing warm and takes the least loaded, y.
    ids = list(range(64))
    assert router.route(ids, {"x": 0, "y": 3}, salt="tenant-a") == "x"
    chosen = router.route(ids, {"x": 3, "y": 0}, salt="tenant-b")
    assert chosen == "y", "tenant-b's prompt was routed to where tenant-a's prefix is cached"
