"""Chapter 8's exercises, on the real PrefixCachingBlockManager."""

from harness import catches, patched, within
from minivllm.prefix_cache import PrefixCachingBlockManager


def cached_second(first: list[int], second: list[int]) -> int:
    m = PrefixCachingBlockManager(16, 16)
    m.allocate_prompt(0, first)
    m.cache_computed(0, first)
    m.free(0)
    return m.allocate_prompt(1, second)


def test_8_1_shared_prefix(answers):
    first = list(range(50))
    second = list(range(40)) + list(range(1000, 1010))
    within(answers.CACHED_SHARED_40, cached_second(first, second), what="CACHED_SHARED_40")


def test_8_2_identical(answers):
    within(answers.CACHED_IDENTICAL_48, cached_second(list(range(48)), list(range(48))), what="CACHED_IDENTICAL_48")


# --- the planted defect (read it after you have tried) ---------------------------------------
def salt_ignored(original):
    return lambda salt: original(None)


def test_8_3_find_the_bug(answers):
    catches(answers.check_salts_isolate, lambda: patched("minivllm.prefix_cache:root_hash", salt_ignored),
            lambda: PrefixCachingBlockManager, what="check_salts_isolate")
