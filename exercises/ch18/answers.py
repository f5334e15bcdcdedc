"""Chapter 18 exercises: the prefix-aware router (minivllm/routing.py) (your answers).

They run without Ray: the rule is plain Python, and so are these checks.
"""

# Write your answers in this file, then check them: pytest exercises/ch18
# (the shipped solutions are in solutions/answers.py: try first)


# Exercise 18.1 (predict, then measure). PrefixTree(block_size=16): a 50-token prompt was sent to
# replica "a". A new prompt shares its first 40 tokens, then differs. How many tokens does
# tree.matches report for "a"? Tolerance: exact.
MATCHED_TOKENS = None


# Exercise 18.2 (predict, then measure). PrefixRouter(block_size=16, imbalance=100), 2 replicas
# whose loads stay 0, 8 tenants each with its own salt and a 64-token system prompt, 48 requests
# (tenant n % 8 for request n, the system prompt then 10 tokens of its own). How many requests
# go where their prefix was held (router.warm)? Tolerance: exact.
WARM_REQUESTS = None


def pow2(loads: dict, rng) -> str:
    """Exercise 18.3 (extend the code): power of two choices, the rule Ray Serve routes by
    default. Draw two distinct replicas with rng.sample(sorted(loads), 2) and return the one with
    the shorter queue (a tie: the first drawn); one replica alone: that one. The check compares
    your choices with the rule's over many seeded draws, then measures the cached share of your
    rule and of PrefixRouter on a tenants' workload."""
    raise NotImplementedError


def check_salts_apart(router) -> None:
    """Exercise 18.4 (find the bug): raise AssertionError unless `router` (a fresh
    PrefixRouter(block_size=4, imbalance=4)) keeps tenants apart: a prompt that one salt sent to
    a replica must not make that replica warm for another salt's identical prompt. Use only
    router.route(ids, loads, salt=...). Called once as it is, once with a defect planted."""
    raise NotImplementedError
