"""Automatic prefix caching, vLLM's: the keys and values of whole cache blocks of prompts
already read are kept in a pool (`Slots.pool`), each block keyed by the tokens it holds and
every token before it, so that a later prompt that starts the same way copies them into its
slot instead of reading them again; the least recently used block leaves the pool first.

`PrefixCache` is the index alone (no TensorFlow): which pool block holds which prefix. A block
is keyed by a hash chained over the blocks before it (SHA-256 of the key before it and its
tokens' bytes), so that two prompts share a key exactly where they share every token up to the
block's end. Only blocks that a prompt's prefill wrote whole are kept, so that a copied block
holds the very numbers the prompt's own prefill would have written.
"""
import collections
import hashlib

import numpy as np

from .cache import BLOCK


class PrefixCache:
    """An index of `blocks` pool blocks: `lookup` the pool blocks that hold a prompt's first
    blocks, `store` places for the blocks a prompt's prefill has written. `queries` and `hits`
    count prompt tokens looked up and found (vLLM's prefix_cache_queries and _hits)."""

    def __init__(self, blocks):
        self.blocks = blocks
        self.where = collections.OrderedDict()  # key -> pool block, least recently used first
        self.queries = self.hits = 0

    def lookup(self, prompt, limit):
        """The pool blocks holding `prompt`'s first whole blocks, in order, at most `limit`
        of them (each now the most recently used)."""
        found = []
        for key in keys(prompt, limit):
            if key not in self.where:
                break
            found.append(key)
        self._touch(found)
        self.queries += len(prompt)
        self.hits += len(found) * BLOCK
        return [self.where[key] for key in found]

    def store(self, prompt, start, end):
        """(block, pool block) for each block j in [start, end) of `prompt` not yet in the pool,
        a pool block taken for it: a free one, or the least recently used one of another
        prompt's (its key leaves the index); the caller copies the slot's block j there. A
        prompt longer than the pool keeps its first blocks."""
        chain = keys(prompt, end)
        self._touch(chain[:start])
        places = []
        for j in range(start, end):
            if chain[j] in self.where:
                continue
            if len(self.where) < self.blocks:
                pool = len(self.where)
            else:
                mine = set(chain[:j])
                old = next((key for key in self.where if key not in mine), None)
                if old is None:
                    break
                pool = self.where.pop(old)
            self.where[chain[j]] = pool
            places.append((j, pool))
        self._touch(chain[:end])
        return places

    def _touch(self, chain):
        """A prompt's blocks become the most recently used, its first block last: the pool gives
        up a prefix's later blocks before the blocks that lead to them."""
        for key in reversed(chain):
            if key in self.where:
                self.where.move_to_end(key)


def keys(prompt, limit):
    """The keys of `prompt`'s first whole blocks, at most `limit`: each the SHA-256 of the key
    before it and the block's tokens."""
    keys, key = [], b""
    for j in range(min(len(prompt) // BLOCK, limit)):
        key = hashlib.sha256(key + np.asarray(prompt[j * BLOCK:(j + 1) * BLOCK], np.int64).tobytes()).digest()
        keys.append(key)
    return keys
