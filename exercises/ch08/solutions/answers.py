"""Chapter 8 exercises: prefix caching (minivllm/prefix_cache.py) (solutions)."""


# Exercise 8.1 (predict, then measure). Blocks of 16 tokens. A 50-token prompt is allocated and
# computed (cache_computed), then freed; a second 50-token prompt shares its first 40 tokens.
# How many of the second prompt's tokens come from the cache? Tolerance: exact.
# why: only full blocks are findable: 40 shared tokens fill 2 blocks of 16, the third differs.
CACHED_SHARED_40 = 32


# Exercise 8.2 (predict, then measure). The same, but the second prompt is identical to the
# first and both are 48 tokens: exactly three full blocks. Tolerance: exact.
# why: the block holding the last prompt token is always computed, since its logits give the
# first output token: 2 blocks.
CACHED_IDENTICAL_48 = 32


def check_salts_isolate(manager_class) -> None:
    """Exercise 8.3 (find the bug): raise AssertionError if a prompt cached under one cache_salt
    is shared with a request of another salt (one tenant learning another's prompt). Called with
    the real PrefixCachingBlockManager and with one that has a defect planted."""
    m = manager_class(16, 4)
    prompt = list(range(20))
    m.allocate_prompt(0, prompt, salt="tenant-a")
    m.cache_computed(0, prompt)
    m.free(0)
    assert m.allocate_prompt(1, prompt, salt="tenant-b") == 0, "tenant-b got tenant-a's blocks"
    m.free(1)
    assert m.allocate_prompt(2, prompt, salt="tenant-a") > 0, "the same tenant should hit"
