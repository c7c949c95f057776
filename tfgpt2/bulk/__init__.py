"""Bulk generation: the prompts of a JSONL file continued in batches.

- `lines`: the JSONL plan: reading and checking each line, its generation controls, and the
  batches (one length bucket and one set of controls each).
- `pool`: the local engine, one process or several on one machine, appending to one file and
  resuming.
- `beam`: the Apache Beam engine (the optional extra `tfgpt2[beam]`): RunInference model
  handlers and the pipeline, for the DirectRunner, Dataflow, Flink or Spark.

Nothing here imports Apache Beam until `beam` is imported.
"""
