"""The one seed rule: one range (`SEEDS`: the SavedModel's int64, [0, 2**63)), one draw where none
is given (`draw`), and one derivation (`seed_of`): sample k of a run seeded s is generated with
seed s + k, wrapped into the range, and token j of a sample draws its uniform from the pair
(its seed, j) (`decoding.sampler.choose`). So row r of a call, choice r of a request, sample r
of a command and row r of a bulk batch are each the same text as the prompt generated alone
with seed s + r, and batch b of n rows starts at sample b * n. The library, the commands, bulk
generation, the server, training's samples and `make-checkpoint` all ask it."""
import numbers
import secrets

from .ranges import Range

SEEDS = Range(int, 0, 2**63 - 1)
_SPAN = 2**63  # the seeds in the range


def draw():
    """A seed drawn at random from the whole range, for a request that gives none."""
    return secrets.randbelow(_SPAN)


def seed_of(seed, k):
    """The seed of sample `k` (>= 0) of a run seeded `seed`: seed + k, wrapped into the range.
    Python ints, or int64 tensors (no overflow: seed + k is never formed where it would wrap)."""
    if isinstance(seed, numbers.Integral) and isinstance(k, numbers.Integral):
        return (int(seed) + int(k)) % _SPAN
    import tensorflow as tf
    seed, k = tf.cast(seed, tf.int64), tf.cast(k, tf.int64)
    room = (_SPAN - 1) - seed  # how far seed is from the top; k > room wraps
    return tf.where(k > room, k - room - 1, seed + tf.minimum(k, room))
