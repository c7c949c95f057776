"""Continue every prompt of a JSONL file, appending the results to another JSONL file:

    tfgpt2 generate-batch --model_name 124M --input prompts.jsonl --output out.jsonl \\
        --length 40 --top_k 40 --seed 1
    tfgpt2 generate-batch --model_dir checkpoint/run1 --input prompts.jsonl --output out.jsonl --workers 2
    tfgpt2 generate-batch --engine beam --model_dir gs://bucket/124M --input gs://bucket/in.jsonl \
        --output gs://bucket/out/rows --length 40 -- --runner DataflowRunner --project P --region R ...

(also `python -m tfgpt2 generate-batch`, with the same flags)

Each input line is a JSON object with a "prompt" (text; other keys are ignored, blank lines
skipped). Each output line is a JSON object {"line", "prompt", "text", "tokens"}: the input's
0-based line number, its prompt, the continuation and the continuation's token ids. Rows are
written as their batch finishes, not in input order: sort by "line" to restore it.

Batches: prompts are grouped by the generator's length bucket (`tfgpt2.decoding.buckets.bucket`
of their token count) and cut, in line order, into batches of --batch_size; a bucket's short
last batch is padded with copies of its first prompt, so XLA compiles once per bucket. Row r
of batch b of the plan (counted from 0, smallest bucket first) samples with seed --seed +
b * --batch_size + r (wrapped into [0, 2**63), the seed's range: `tfgpt2.seeds`). The plan
depends only on the input and --batch_size, so a rerun, a resumed run and any --workers count
give each line the same text: the text of the prompt generated alone with its row's seed.

Resuming: each batch is appended with one write, then flushed and fsynced. A rerun keeps one
row per line number, drops a torn line (a crash mid-write) and generates only the missing
lines; a batch partly written is generated again and only its missing rows are written.

The generation controls (--min_p, --repetition_penalty, --presence_penalty,
--frequency_penalty, --logit_bias, --stop, --min_tokens: docs/generation.md) apply to every
line; a --stop text ends a row's "text" before it, as the server's "stop" does ("tokens": the
tokens wholly before it; an <|endoftext|> that ends a row is in neither). A line may set its
own, over the flags: "temperature", "top_k", "top_p", "min_p", "seed", "logit_bias" ({"id":
value}), "repetition_penalty", "presence_penalty", "frequency_penalty", "stop" (a text or a
list of texts), "stop_token_ids", "stop_at_eot", "min_tokens", "include_stop_str_in_output".
Only lines with the same such fields share a batch; a line with a "seed" is generated alone,
so its text is `tfgpt2.generate`'s for that prompt and seed.

Bad lines (not UTF-8, not a JSON object with a string "prompt", an empty prompt, a prompt
whose tokens + --length - 1 exceed the context window, a field of a bad value) are each named
on stderr, once, with what is wrong, and stop the run before any generation; --skip_bad names
and counts them and goes on.

--workers N runs N processes of this command, worker k taking the batches b with
b % N == k, all appending to --output (one write per batch, under a lock). Where
CUDA_VISIBLE_DEVICES lists devices, worker k sees only the (k % count)-th of them. A worker
stops when the process that started it is gone; one that fails stops the others.

A run holds <output>.lock: a second run on the same output is refused while it lasts (the
file is removed when the run ends).
Progress: a line on stderr every few seconds (prompts done, prompts/s, tokens/s); --quiet
leaves only the errors and the counts of skipped lines.

--engine beam (the extra tfgpt2[beam]: docs/distributed.md) plans here, the same batches
and seeds, so the same rows, and generates on an Apache Beam runner, whose pipeline options
follow `--` (default: the DirectRunner, in this process). --input, --output and --model_dir
(or --saved_model, a SavedModel of `tfgpt2 export`, whose workers need TensorFlow and not
tfgpt2) may be on any filesystem Beam reads (local, gs://, s3://, hdfs://). The rows are
written as the shards <output>-SSSSS-of-NNNNN, the bad lines, with their line number and
what is wrong, to <output>.errors-00000-of-00001, and the good lines are generated; without
--skip_bad the command then exits with status 1. A Beam run does not resume: rerun it on a
new --output (an output with files of an earlier run is refused). TensorFlow's and Beam's
notices (the runner's and its workers' logs) go to a temporary log file, named where the
pipeline fails, unless --verbose.
"""
import argparse
import importlib.util
import os
import shutil
import sys
import time

from .. import seeds
from ..bulk import lines, pool
from ..formats.folders import model_path, vocabulary_source
from ..hparams import load_hparams
from .args import ranged
from .common import (Notices, Progress, check_flags, encoder_of, end_at_once, fields, load, model_dir,
                     sampling_parser)

HPARAMS_AND_VOCABULARY = ["hparams.json", "encoder.json", "vocab.bpe"]  # what planning reads of a model folder


def arguments(argv, prog="tfgpt2 generate-batch"):
    p = sampling_parser(prog, __doc__, length_help="tokens per continuation (default: half the model's n_ctx)")
    p.set_defaults(batch_size=8)
    p.add_argument("--input", required=True, help="JSONL file, one {\"prompt\": text} per line")
    p.add_argument("--output", required=True, help="JSONL file the rows are appended to (resumed if it exists); "
                                                    "with --engine beam, the prefix of the files written")
    p.add_argument("--skip_bad", action="store_true",
                   help="skip bad input lines (counted) instead of stopping (with --engine beam: exit 0)")
    p.add_argument("--workers", type=ranged(int, 1), default=1, help="processes sharing the batches (default 1)")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # set by --workers for its children
    p.add_argument("--engine", choices=["local", "beam"], default="local",
                   help="local: this machine's processes (--workers); beam: an Apache Beam runner (default local)")
    p.add_argument("--verbose", action="store_true",
                   help="--engine beam: show TensorFlow's and Beam's notices here (default: in a temporary log, "
                        "named if the pipeline fails)")
    p.add_argument("--saved_model", metavar="DIR",
                   help="--engine beam: generate with this SavedModel version folder of `tfgpt2 export` (its "
                        "vocabulary: the model folder's where it exists, else GPT-2's)")
    args = p.parse_args(argv)
    if args.engine == "local" and args.saved_model:
        p.error("--saved_model needs --engine beam")
    if args.engine == "beam" and args.workers > 1:
        p.error("--workers is the local engine's: Beam's workers are set by its options after --")
    if args.saved_model and args.tf32:
        p.error("--tf32 does not apply to --saved_model (a SavedModel keeps the tf32 it was exported with)")
    if args.seed is None:
        args.seed = seeds.draw()  # one seed for the run, shared by its workers
    return args


def input_batches(args, enc, n_ctx, length, n_vocab):
    """The batches of `bulk.lines.plan_batches` for args.input. The bad lines are reported
    (`report_bad`) by the run that starts the workers, not again by each; without --skip_bad
    they raise ValueError."""
    with open(args.input, "rb") as f:
        batches, bad = lines.plan_batches(lines.read_prompts(f), enc, n_ctx=n_ctx, length=length, n_vocab=n_vocab,
                                          batch_size=args.batch_size, context_keep=args.context_keep)
    failed = report_bad(args, bad) if args.worker is None else None
    if failed:
        raise ValueError(failed)
    return batches


def report_bad(args, bad, written_to=None):
    """Each bad line of the input, (line number, what is wrong), on stderr once, then their
    count; what the command's error says of them without --skip_bad (else None)."""
    if not bad:
        return None
    for n, problem in bad:
        print(f"{'skipped ' if args.skip_bad else ''}{args.input}:{n + 1} (line {n} counted from 0): {problem}",
              file=sys.stderr)
    count = f"{len(bad)} bad line(s) of {args.input}" + (f", written to {written_to}" if written_to else "")
    if args.skip_bad:
        print(f"skipped {count}", file=sys.stderr)
        return None
    return f"{count}, each named above (--skip_bad skips such lines)"


def checked_length(args, n_ctx, n_vocab):
    """--length, or its default: half the model's window n_ctx, once the flags are checked by
    the request rules (`common.check_flags`: ValueError naming the first bad one)."""
    return check_flags(args, n_vocab, n_ctx, n_ctx // 2, window=False).length


def keywords(args):
    """The flags as the request's fields (every line's, unless it sets its own)."""
    return fields(args)


def worker_command():
    """How a worker is started: as `tfgpt2 generate-batch` through the console script's module,
    which keeps TensorFlow's start-up lines off the terminal, where it is importable (else
    `python -m tfgpt2 generate-batch`)."""
    if importlib.util.find_spec("tfgpt2_cli") is not None:
        return [sys.executable, "-m", "tfgpt2_cli", "generate-batch"]
    return [sys.executable, "-m", "tfgpt2", "generate-batch"]


def main(argv=None, model=None, prog="tfgpt2 generate-batch"):
    """The command; `model`, where given, is --model_name already loaded (else it is loaded here)."""
    end_at_once()
    argv = sys.argv[1:] if argv is None else list(argv)
    argv, beam_options = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = arguments(argv, prog)
    if args.engine == "beam":
        return run_beam(args, beam_options)
    if beam_options:
        return "error: the options after -- are Beam's pipeline options: they need --engine beam"
    held = None
    try:
        folder = model_dir(args)
        n_ctx, n_vocab = sizes(folder)
        enc = encoder_of(folder)
        length = checked_length(args, n_ctx, n_vocab)
        if os.path.isdir(args.output):
            raise ValueError(f"--output {args.output} is a folder: give the file to append the rows to, "
                             f"for example {os.path.join(args.output, 'rows.jsonl')}")
        batches = input_batches(args, enc, n_ctx, length, n_vocab)
        if args.worker is None:
            held = pool.lock(args.output)
    except (OSError, ValueError) as e:
        return f"error: {e}"
    try:
        return run_batches(argv, args, model, enc, length, batches)
    finally:
        if held is not None:
            pool.unlock(args.output, held)


def run_batches(argv, args, model, enc, length, batches):
    """Generate the missing lines, here or in --workers child processes; the exit status."""
    done, dropped = pool.read_done(args.output, repair=args.worker is None)
    if dropped and args.worker is None:
        print(f"{args.output}: dropped {dropped} torn or repeated line(s); their prompts are generated again",
              file=sys.stderr)
    progress = Progress(args.quiet)
    if args.worker is None and args.workers > 1:
        start = time.monotonic()
        status = pool.spawn([*worker_command(), *argv, "--seed", str(args.seed)], args.workers)
        if status == 0:
            rows = len(pool.read_done(args.output, repair=False)[0]) - len(done)
            progress.note(f"{rows} prompts in {time.monotonic() - start:.1f} s with {args.workers} workers")
        return status
    if model is None:
        model = load(args, lambda n_ctx: n_ctx // 2)[0]
    parent = None if args.worker is None else os.getppid()
    pool.generate_batches(args, model, enc, length, batches, done, keywords(args), progress.note,
                          args.worker or 0, args.workers, parent)
    return 0


def run_beam(args, options):
    """--engine beam: plan here, write the bad lines, generate on Beam's runner (`bulk.beam`,
    with Beam's pipeline `options`), TensorFlow's and Beam's notices in a log unless --verbose;
    then report the bad lines. The exit status."""
    start = time.monotonic()
    with Notices(args.verbose) as notices:
        from ..bulk import beam  # its import's notices too
        try:
            rows, bad = beam_files(args, options)
        except (OSError, ValueError) as e:
            return f"error: {e}"
        except beam.PipelineError as e:
            notices.keep = True
            return f"error: {e} ({notices.where()} has the rest)"
    Progress(args.quiet).note(f"{rows} prompts in {time.monotonic() - start:.1f} s: {args.output}-*-of-*")
    failed = report_bad(args, bad, f"{args.output}.errors-00000-of-00001")
    return f"error: {failed}" if failed else 0


def beam_files(args, options):
    """The rows of --engine beam written by `bulk.beam.generate_files`: (their count, the bad lines)."""
    from ..bulk import beam, handlers
    if os.path.isdir(args.output):
        raise ValueError(f"--output {args.output} is a folder: give the prefix of the files to write, "
                         f"for example {os.path.join(args.output, 'rows')}")
    path, enc, n_ctx, n_vocab = beam_model(args)
    length = checked_length(args, n_ctx, n_vocab)
    settings = dict(keywords=keywords(args), length=length, batch_size=args.batch_size)
    handler = handlers.GPT2SavedModelHandler(path, enc.encoding, n_vocab=n_vocab, eot=enc.eot_token, **settings) \
        if args.saved_model else handlers.GPT2ModelHandler(path, dtype=args.dtype, tf32=args.tf32, **settings)
    if not any(option.startswith("--default_sdk_harness_log_level") for option in options):
        options = [*options, "--default_sdk_harness_log_level=WARNING"]  # the workers' INFO lines off
    return beam.generate_files(args.input, args.output, handler, enc, n_ctx=n_ctx, n_vocab=n_vocab, length=length,
                               batch_size=args.batch_size, seed=args.seed, context_keep=args.context_keep,
                               options=options)


def beam_model(args):
    """(the model's path for the workers, its encoder, n_ctx, n_vocab) for --engine beam: the
    SavedModel of --saved_model, or the model folder; a local path made absolute (the workers'
    current folder may be another), a remote folder's hparams and vocabulary copied here."""
    from ..bulk import beam, handlers
    path = args.model_dir or model_path(args.model_name, args.models_dir)
    if args.saved_model:
        saved = os.path.abspath(args.saved_model) if handlers.is_local(args.saved_model) else args.saved_model
        return (saved, encoder_of(vocabulary_source(path)), *beam.saved_model_sizes(saved))
    if handlers.is_local(path):
        path = os.path.abspath(model_dir(args))
        return (path, encoder_of(path), *sizes(path))
    folder = handlers.local_copy(path, HPARAMS_AND_VOCABULARY)
    try:
        return (path, encoder_of(folder), *sizes(folder))
    finally:
        shutil.rmtree(folder)


def sizes(folder):
    """(n_ctx, n_vocab) of a model folder's hparams.json."""
    hparams = load_hparams(folder)
    return hparams.n_ctx, hparams.n_vocab
