"""`decoding.prefix.PrefixCache`, the prefix cache's index (no TensorFlow): blocks keyed by
their tokens and every token before them, found again by a prompt that starts the same way,
and given up least recently used first, a prefix's later blocks before the ones that lead to
them."""
import random

from tfgpt2.decoding.cache import BLOCK
from tfgpt2.decoding.prefix import PrefixCache, keys


def prompt_of(*blocks, tail=5):
    """A prompt of whole blocks, block b filled with token b, then `tail` more tokens."""
    return [t for b in blocks for t in [b] * BLOCK] + [999] * tail


def test_a_prompt_finds_the_blocks_of_the_prompts_that_started_the_same_way():
    cache = PrefixCache(8)
    assert cache.lookup(prompt_of(1, 2, 3), 3) == [] and (cache.queries, cache.hits) == (3 * BLOCK + 5, 0)
    assert cache.store(prompt_of(1, 2, 3), 0, 3) == [(0, 0), (1, 1), (2, 2)]
    assert cache.store(prompt_of(1, 2, 3), 1, 3) == []  # kept already
    assert cache.lookup(prompt_of(1, 2, 7), 3) == [0, 1] and cache.hits == 2 * BLOCK
    assert cache.lookup(prompt_of(1, 2, 3), 2) == [0, 1]  # at most `limit`
    assert cache.lookup(prompt_of(9, 2, 3), 3) == []  # block 2 and 3 hold the same tokens, after others
    assert cache.store(prompt_of(1, 2, 7), 2, 3) == [(2, 3)]


def test_keys_chain_over_every_token_before_a_block():
    rng = random.Random(0)
    tokens = [rng.randrange(50257) for _ in range(3 * BLOCK + 7)]
    chain = keys(tokens, 10)
    assert len(chain) == 3 and len(set(chain)) == 3
    changed = list(tokens)
    changed[BLOCK + 5] += 1  # a token of block 1: blocks 1 and 2 change, block 0 does not
    assert [a == b for a, b in zip(chain, keys(changed, 10))] == [True, False, False]
    assert keys(tokens[:2 * BLOCK + 63], 10) == chain[:2]


def test_the_least_recently_used_blocks_leave_first_a_prefix_s_later_ones_before_its_first():
    cache = PrefixCache(4)
    cache.store(prompt_of(1, 2), 0, 2)  # pool 0, 1
    cache.store(prompt_of(3, 4), 0, 2)  # pool 2, 3
    cache.lookup(prompt_of(1, 2), 2)  # 1, 2 used last
    assert cache.store(prompt_of(5), 0, 1) == [(0, 3)]  # block 4 of the other prompt goes first
    assert cache.lookup(prompt_of(3, 4), 2) == [2] and cache.lookup(prompt_of(1, 2), 2) == [0, 1]
    assert cache.store(prompt_of(6, 7, 8), 0, 3) == [(0, 3), (1, 2), (2, 1)]  # 5, then 3, then 2 give way
    assert cache.lookup(prompt_of(6, 7, 8), 3) == [3, 2, 1] and cache.lookup(prompt_of(1), 1) == [0]
    small = PrefixCache(2)
    assert small.store(prompt_of(6, 7, 8), 0, 3) == [(0, 0), (1, 1)]  # a prompt longer than the pool keeps its
    assert small.lookup(prompt_of(6, 7, 8), 3) == [0, 1]  # first blocks: never its own for its later ones


def test_no_pool_keeps_nothing():
    cache = PrefixCache(0)
    assert cache.store(prompt_of(1), 0, 1) == [] and cache.lookup(prompt_of(1), 1) == []
