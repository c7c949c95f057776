"""The Apache Beam engine of bulk generation (`tfgpt2 generate-batch --engine beam`).

`generate_files` plans where it is called, with the local engine's plan (`bulk.lines`): it
reads and checks every line of the input, writes the bad lines with their line number and
what is wrong to <output>.errors-00000-of-00001, and the batches to <output>.plan.jsonl; then
it runs a pipeline that reads the batches, spreads them over the workers (a reshuffle),
generates each with RunInference (`bulk.handlers`) and writes the rows as the shards
<output>-SSSSS-of-NNNNN. The plan file is removed when the pipeline ends. Paths are anything
Beam's FileSystems open: local, gs://, s3://, hdfs://.

The batches and their seeds are the local engine's, so each row is the one the local engine
writes for that line, sampled or not, whatever the runner and the number of workers.
"""
import json

import apache_beam as beam
from apache_beam.internal.cloudpickle import cloudpickle
from apache_beam.io.filesystems import FileSystems
from apache_beam.ml.inference.base import RunInference
from apache_beam.options.pipeline_options import PipelineOptions

from . import handlers
from ..seeds import seed_of
from .lines import line_keywords, plan_batches, read_prompts


def requests(batches, enc, seed, batch_size):
    """The requests of `handlers` for each batch of `lines.plan_batches`, a list per batch:
    batch b of n rows samples with seed + b * n (`seeds.seed_of`) and has batch_size rows, unless it is one line
    with its own seed (then it is generated alone)."""
    for b, rows in enumerate(batches):
        size = 1 if len(rows) == 1 and "seed" in dict(rows[0][3]) else batch_size
        yield [dict(line=n, prompt=prompt, tokens=tokens, batch=b, row=i, rows=size, seed=seed_of(seed, b * batch_size),
                    options=line_keywords(fields)) for i, (n, prompt, tokens, fields) in enumerate(rows)]


def earlier_run(output):
    """The first file of an earlier run on `output` (rows, errors or plan), or None."""
    found = FileSystems.match([f"{output}-*-of-*", f"{output}.errors-*", f"{output}.plan.jsonl"])
    return next((m.path for result in found for m in result.metadata_list), None)


def leftovers(output):
    """What a run on `output` may leave, as patterns: the rows, the bad lines, the plan, and the
    folder of temporary shards that Beam makes beside them (beam-temp-<name>-<id>)."""
    folder, _, name = output.rpartition("/")
    return [f"{output}-*", f"{output}.errors-*", f"{output}.plan.jsonl",
            f"{folder}/beam-temp-{name}-*" if folder else f"beam-temp-{name}-*"]


def write_lines(path, lines):
    """Write the text lines to `path` under a temporary name, renamed once complete."""
    temp = path + ".incomplete"
    with FileSystems.create(temp, compression_type="uncompressed") as f:
        for line in lines:
            f.write((line + "\n").encode("utf-8"))
    FileSystems.rename([temp], [path])


def saved_model_sizes(path):
    """(n_ctx, n_vocab) of the SavedModel of `tfgpt2 export` at `path` (local or remote)."""
    from ..formats.saved_model import embedding_sizes
    return embedding_sizes(handlers.local_copy(path, ["variables/variables.index"]))


def generate_files(source, output, handler, enc, *, n_ctx, n_vocab, length, batch_size, seed, context_keep=None,
                   options=()):
    """Plan the JSONL file `source`, write the bad lines and run the pipeline with `handler`
    (`handlers.GPT2ModelHandler` or `GPT2SavedModelHandler`) and Beam's pipeline `options`
    (command-line flags). Returns (rows, bad): the count of rows written and the bad lines,
    (line number, what is wrong). Raises ValueError where files of an earlier run are there."""
    found = earlier_run(output)
    if found:
        *files, temp = leftovers(output)
        raise ValueError(f"{found} exists, from an earlier run: remove {', '.join(files)} and the folder {temp}, "
                         "or choose another --output")
    with FileSystems.open(source, compression_type="uncompressed") as f:
        batches, bad = plan_batches(read_prompts(f), enc, n_ctx=n_ctx, length=length, n_vocab=n_vocab,
                                    batch_size=batch_size, context_keep=context_keep)
    if bad:
        write_lines(f"{output}.errors-00000-of-00001", (json.dumps(dict(line=n, error=problem), ensure_ascii=False)
                                                        for n, problem in bad))
    plan = f"{output}.plan.jsonl"
    write_lines(plan, (json.dumps(batch) for batch in requests(batches, enc, seed, batch_size)))
    try:
        run(plan, output, handler, options)
    finally:
        FileSystems.delete([plan])
    return sum(map(len, batches)), bad


class PipelineError(RuntimeError):
    """The pipeline failed on its runner (the runner's log says where); no shard was written."""


def run(plan, output, handler, options):
    """Run the pipeline over the batches in the file `plan`, `handlers` sent by value (see
    there); the rows written as shards of `output`. Raises PipelineError where it fails."""
    cloudpickle.register_pickle_by_value(handlers)
    try:
        with beam.Pipeline(options=PipelineOptions(list(options))) as pipeline:
            _ = (pipeline
                 | "Plan" >> beam.io.ReadFromText(plan)
                 | "Batches" >> beam.Map(json.loads)
                 | "Spread" >> beam.Reshuffle()
                 | "Generate" >> RunInference(handler.with_no_batching())
                 | "Rows" >> beam.Map(json.dumps, ensure_ascii=False)
                 | "Write" >> beam.io.WriteToText(output))
    except Exception as e:  # whatever the runner raises for a failed job
        last = [line for line in str(e).splitlines() if line.strip()][-1:] or [type(e).__name__]
        raise PipelineError(f"the Beam pipeline failed: {last[0].strip()}; no rows were written to {output}-*") from e
    finally:
        cloudpickle.unregister_pickle_by_value(handlers)
