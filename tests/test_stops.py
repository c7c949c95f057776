"""Stop strings on text inside the loop (`tfgpt2.decoding.stops.advanced`): over random
vocabularies of short byte tokens and random stop strings (prefixes of one another, repeats,
strings inside one token and across several), the step ends a row at the first token after
which its text contains a stop string, and reports where the first one starts, exactly as
`bytes.find` on the whole text says (compiled by XLA, as in the loops)."""
import random

import numpy as np
import pytest
import tensorflow as tf

from tfgpt2.decoding.stops import NONE, Vocabulary, advanced, no_prefixes, stop_bytes


@pytest.mark.parametrize("seed", range(3))
def test_stops_match_find_on_the_text(seed):
    rng = random.Random(seed)
    alphabet = b"ab\n"
    vocabulary = Vocabulary(sorted({bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))
                                    for _ in range(120)}))
    step = tf.function(advanced, jit_compile=True, autograph=False)
    tensors, checked = vocabulary.tensors(), 0
    for _ in range(12):
        rows = [[bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 5))).decode()
                 for _ in range(rng.randint(1, 3))] for _ in range(8)]
        data, lengths = (tf.constant(a) for a in stop_bytes(rows))
        prefixes, texts, ended = no_prefixes(data), [b""] * 8, [False] * 8
        for _ in range(10):
            tokens = [rng.randrange(len(vocabulary.items)) for _ in rows]
            prefixes, (start, length) = step(prefixes, tf.constant(tokens), data, lengths, tensors)
            for row, token in enumerate(tokens):
                if ended[row]:
                    continue
                before = len(texts[row])
                texts[row] += vocabulary.items[token]
                found = sorted((texts[row].find(s.encode()), len(s.encode())) for s in rows[row]
                               if s.encode() in texts[row])
                want = (found[0][0] - before, found[0][1]) if found else (NONE, None)
                got = (int(start[row]), int(length[row]) if found else None)
                assert got == want, (rows[row], texts[row])
                ended[row], checked = bool(found), checked + bool(found)
    assert checked > 60  # most rows met a stop string, many across tokens


def test_stop_bytes_bucket_the_shapes():
    data, lengths = stop_bytes([["\n\n", "é"], ["Question:"]])
    assert data.shape == (2, 2, 16) and lengths.tolist() == [[2, 2], [9, 0]]
    assert data[0, 1, :3].tolist() == [0xC3, 0xA9, -1] and np.all(data[1, 1] == -1)
