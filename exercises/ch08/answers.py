"""Chapter 8 exercises: prefix caching (minivllm/prefix_cache.py) (your answers)."""

# Write your answers in this file, then check them: pytest exercises/ch08
# (the shipped solutions are in solutions/answers.py: try first)


# Exercise 8.1 (predict, then measure). Blocks of 16 tokens. A 50-token prompt is allocated and
# computed (cache_computed), then freed; a second 50-token prompt shares its first 40 tokens.
# How many of the second prompt's tokens come from the cache? Tolerance: exact.
CACHED_SHARED_40 = None


# Exercise 8.2 (predict, then measure). The same, but the second prompt is identical to the
# first and both are 48 tokens: exactly three full blocks. Tolerance: exact.
CACHED_IDENTICAL_48 = None


def check_salts_isolate(manager_class) -> None:
    """Exercise 8.3 (find the bug): raise AssertionError if a prompt cached under one cache_salt
    is shared with a request of another salt (one tenant learning another's prompt). Called with
    the real PrefixCachingBlockManager and with one that has a defect planted."""
    raise NotImplementedError
