"""The model's matrix products, in full float32 on every device unless TensorFloat-32 is asked for.

TensorFlow multiplies float32 matrices in TensorFloat-32 (10-bit mantissas) on NVIDIA GPUs from
Ampere on, a process-wide setting (`tf.config.experimental.enable_tensor_float_32_execution`)
that cuBLAS reads at run time and XLA's bridge at compile time: float32 logits then differ from
the original's far beyond float32's rounding. XLA's dot op carries its own precision, so a float32 product here is
that op at precision HIGHEST (full float32 whatever the setting, on a CPU the same numbers as
`tf.matmul`), with its gradient written out of the same products. With `tf32=True`, and in any
16-bit dtype (where TensorFloat-32 does not apply), it is `tf.matmul`, as precise as TensorFlow's
settings make it (docs/precision.md). So is a product run eagerly where TensorFlow sees only
CPUs: float32 there, and outside XLA faster than XLA's dot run op by op. A traced graph always
holds XLA's dot, as it may run elsewhere (a SavedModel exported on a CPU, served on a GPU).
"""
import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla
from tensorflow.compiler.xla import xla_data_pb2

HIGHEST = xla_data_pb2.PrecisionConfig.HIGHEST


def matmul(a, b, *, transpose_a=False, transpose_b=False, tf32=False):
    """`tf.matmul(a, b, transpose_a=, transpose_b=)` for a and b of the same rank (2 or more,
    the same batch dimensions, no broadcasting): full float32 for float32 operands, unless
    `tf32`."""
    a, b = tf.convert_to_tensor(a), tf.convert_to_tensor(b)
    if tf32 or a.dtype != tf.float32 or (tf.executing_eagerly() and cpus_only()):
        return tf.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
    return _exact(a, b, transpose_a, transpose_b)


def cpus_only():
    """Whether TensorFlow sees no device but CPUs (no GPU, no TPU), asked at each call."""
    return all(device.device_type == "CPU" for device in tf.config.list_logical_devices())


def _exact(a, b, transpose_a, transpose_b):
    """op(a) @ op(b) as XLA's dot at precision HIGHEST, differentiable (XLA's dot has no
    registered gradient): each gradient is two such products, as `tf.matmul`'s."""
    @tf.custom_gradient
    def run(a, b):
        def grad(dy):
            if not transpose_a and not transpose_b:
                return _exact(dy, b, False, True), _exact(a, dy, True, False)
            if not transpose_a:
                return _exact(dy, b, False, False), _exact(dy, a, True, False)
            if not transpose_b:
                return _exact(b, dy, False, True), _exact(a, dy, False, False)
            return _exact(b, dy, True, True), _exact(dy, a, True, True)
        return _dot(a, b, transpose_a, transpose_b), grad
    return run(a, b)


def _dot(a, b, transpose_a, transpose_b):
    rank = a.shape.rank
    if rank is None or rank < 2 or b.shape.rank != rank:
        raise ValueError(f"products of operands of one known rank >= 2 only; got shapes {a.shape} and {b.shape}")
    numbers = xla_data_pb2.DotDimensionNumbers()
    numbers.lhs_contracting_dimensions.append(rank - 2 if transpose_a else rank - 1)
    numbers.rhs_contracting_dimensions.append(rank - 1 if transpose_b else rank - 2)
    numbers.lhs_batch_dimensions.extend(range(rank - 2))
    numbers.rhs_batch_dimensions.extend(range(rank - 2))
    precision = xla_data_pb2.PrecisionConfig()
    precision.operand_precision.extend([HIGHEST, HIGHEST])
    return xla.dot_general(a, b, numbers, precision, use_v2=True)
