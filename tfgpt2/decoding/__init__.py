"""Generation's machinery: the rules a request must meet (`request`), the model's layers over a
fixed-size key/value cache (`cache`), the block weights in layouts that XLA on a CPU multiplies
faster (`layouts`), the length buckets (`buckets`), the controls past temperature, top-k and top-p
(`controls`), the sampler (`sampler`) and the compiled loops (`generator`, and `slots` for the
server). Nothing here imports `tfgpt2.sample`, the library's door above it."""
import logging


class ExpectedRetracing(logging.Filter):
    """Drops TensorFlow's "triggered tf.function retracing" warning for the generation loop and
    the server's slots, which compile once per length bucket by design."""

    def filter(self, record):
        message = record.getMessage()
        return not ("retracing" in message and ("Generator." in message or "Slots." in message))


def quiet_retracing():
    """TensorFlow's logger with `ExpectedRetracing` (once): what the loops set up when made."""
    tf_logger = logging.getLogger("tensorflow")
    if not any(isinstance(f, ExpectedRetracing) for f in tf_logger.filters):
        tf_logger.addFilter(ExpectedRetracing())
