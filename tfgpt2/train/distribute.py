"""tf.distribute for fine-tuning: the strategy that `--strategy` names, the global batch split
over its replicas, each replica's rows of every batch, and which process writes the run.

- `auto`: `multiworker` where TF_CONFIG names a cluster of several tasks, else `mirrored`
  where several GPUs are visible, else `one`.
- `one`: TensorFlow's default strategy, one device.
- `mirrored`: `MirroredStrategy` over every visible GPU (over the logical CPUs where there is
  no GPU, as tests split a CPU).
- `multiworker`: `MultiWorkerMirroredStrategy` across the processes TF_CONFIG lists, each
  running the same command; worker 0 (or the chief) writes the run folder, which every
  worker must be able to read to resume.
- `tpu`: `TPUStrategy` on the TPU that `--tpu` names (a name or grpc:// address; empty on a
  TPU VM).
"""
import json
import os

import tensorflow as tf

STRATEGIES = ("auto", "one", "mirrored", "multiworker", "tpu")


def cluster_size():
    """The number of tasks TF_CONFIG lists (0 without TF_CONFIG)."""
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    return sum(len(tasks) for tasks in config.get("cluster", {}).values())


def make_strategy(name="auto", tpu=None):
    """The tf.distribute strategy for `--strategy name` (see the module's docstring)."""
    if name == "auto":
        gpus = tf.config.list_logical_devices("GPU")
        name = "multiworker" if cluster_size() > 1 else "mirrored" if len(gpus) > 1 else "one"
    if name == "one":
        return tf.distribute.get_strategy()
    if name == "mirrored":
        devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
        return tf.distribute.MirroredStrategy([d.name for d in devices])
    if name == "multiworker":
        if not cluster_size():
            raise ValueError("--strategy multiworker needs TF_CONFIG, e.g. '{\"cluster\": {\"worker\": "
                             "[\"host1:2222\", \"host2:2222\"]}, \"task\": {\"type\": \"worker\", \"index\": 0}}'")
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "tpu":
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu or "")
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return tf.distribute.TPUStrategy(resolver)
    raise ValueError(f"--strategy {name}: expected one of {', '.join(STRATEGIES)}")


def check_batch(batch_size, strategy):
    """`batch_size` windows per (micro-)batch in all, split evenly over the replicas."""
    replicas = strategy.num_replicas_in_sync
    if batch_size % replicas:
        raise ValueError(f"--batch_size {batch_size} (the global batch) does not divide over {replicas} "
                         f"replicas; use a multiple of {replicas}")


def is_chief(strategy):
    """Whether this process writes the run folder: always, except for the workers of a
    cluster other than its chief (the task "chief", else worker 0)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.task_type or resolver.task_type == "chief":
        return True
    return resolver.task_type == "worker" and resolver.task_id == 0 and "chief" not in resolver.cluster_spec().jobs


def shard(strategy, dataset):
    """`dataset` of global batches [n, ...] as per-replica batches: of each batch, worker w of
    W (an input pipeline) reads rows [w n / W, (w + 1) n / W) and hands them in equal parts
    to its replicas in order, so every window of a batch is trained on by one replica."""
    # Without tf.data's autotuning thread: under the strategies' multi-device iterator, deleting
    # the iterator at a run's end waited for that thread's next wake-up (10 to 60 s on a CPU)
    options = tf.data.Options()
    options.autotune.enabled = False

    def replica_batches(context):
        workers, worker = context.num_input_pipelines, context.input_pipeline_id
        local = strategy.num_replicas_in_sync // workers
        shape = dataset.element_spec.shape.as_list()
        n = shape[0] // workers

        def rows(batch):
            return tf.reshape(batch[worker * n:(worker + 1) * n], [local, n // local] + shape[1:])
        return dataset.map(rows).unbatch().prefetch(tf.data.AUTOTUNE).with_options(options)
    return strategy.distribute_datasets_from_function(replica_batches)


def failure(error, run_dir, steps):
    """The message for a TensorFlow error that stopped training (a worker that died or cannot
    be reached, memory, ...): what failed and the checkpoint a rerun resumes from."""
    first = (error.message or str(error)).strip().splitlines()[0]
    where = f"{run_dir}/model-{max(steps)}" if steps else f"none in {run_dir}"
    return (f"error: training stopped: {type(error).__name__}: {first}\nThe last complete checkpoint is "
            f"{where}; run the same command again (on every worker) to resume from it.")
