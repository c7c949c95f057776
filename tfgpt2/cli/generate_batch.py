"""Continue every prompt of a JSONL file, appending the results to another JSONL file:

    tfgpt2 generate-batch --model_name 124M --input prompts.jsonl --output out.jsonl \\
        --length 40 --top_k 40 --seed 1
    tfgpt2 generate-batch --model_dir checkpoint/run1 --input prompts.jsonl --output out.jsonl --workers 2

(also `python -m tfgpt2.generate_batch`, with the same flags)

Each input line is a JSON object with a "prompt" (text; other keys are ignored, blank lines
skipped). Each output line is a JSON object {"line", "prompt", "text", "tokens"}: the input's
0-based line number, its prompt, the continuation and the continuation's token ids. Rows are
written as their batch finishes, not in input order: sort by "line" to restore it.

Batches: prompts are grouped by the generator's length bucket (`tfgpt2.decoding.plan.bucket` of
their token count) and cut, in line order, into batches of --batch_size; a bucket's short
last batch is padded with copies of its first prompt, so XLA compiles once per bucket. Batch
b of the plan (counted from 0, smallest bucket first) samples with seed --seed + b. The plan
depends only on the input and --batch_size, so a rerun, a resumed run and any --workers count
give each line the same text. Greedy text (--temperature 0 or --top_k 1) is the text of the
prompt generated alone; sampled text also depends on the prompt's place in its batch.

Resuming: each batch is appended with one write, then flushed and fsynced. A rerun keeps one
row per line number, drops a torn line (a crash mid-write) and generates only the missing
lines; a batch partly written is generated again and only its missing rows are written.

The generation controls (--min_p, --repetition_penalty, --presence_penalty,
--frequency_penalty, --logit_bias, --stop: docs/generation.md) apply to every line; a row
that ends with a --stop text leaves it out of "text" and "tokens". A line may set its own,
over the flags: "temperature", "top_k", "top_p", "min_p", "seed", "logit_bias" ({"id":
value}), "repetition_penalty", "presence_penalty", "frequency_penalty", "stop" (a list of
texts), "stop_at_eot". Only lines with the same such fields share a batch; a line with a
"seed" is generated alone, so its text is `tfgpt2.generate`'s for that prompt and seed.

Bad lines (not a JSON object with a string "prompt", an empty prompt, a prompt whose tokens
+ --length - 1 exceed the context window, a field of a bad value) stop the run before any generation with an error
naming the line; --skip_bad counts them on stderr and goes on.

--workers N runs N processes of this command, worker k taking the batches b with
b % N == k, all appending to --output (one write per batch, under a lock). Where
CUDA_VISIBLE_DEVICES lists devices, worker k sees only the (k % count)-th of them. A worker
stops when the process that started it is gone; one that fails stops the others.

A run holds <output>.lock: a second run on the same output is refused while it lasts.
Progress: a line on stderr every few seconds (prompts done, prompts/s, tokens/s); --quiet
leaves only the errors and the counts of skipped lines.
"""
import argparse
import fcntl
import importlib.util
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

from ..decoding.plan import bucket, fits
from ..formats.files import replacing
from ..hparams import load_hparams
from ..sample import generate
from .args import ranged
from .common import Progress, controls, encoder_of, end_at_once, load, model_dir, sampling_parser

PROGRESS_EVERY = 5.0  # seconds between progress lines on stderr


def arguments(argv, prog="tfgpt2 generate-batch"):
    p = sampling_parser(prog, __doc__,
                     length_help="tokens per continuation (default: half the model's n_ctx)")
    p.set_defaults(batch_size=8)
    p.add_argument("--input", required=True, help="JSONL file, one {\"prompt\": text} per line")
    p.add_argument("--output", required=True, help="JSONL file the rows are appended to (resumed if it exists)")
    p.add_argument("--skip_bad", action="store_true", help="skip bad input lines (counted) instead of stopping")
    p.add_argument("--workers", type=ranged(int, 1), default=1, help="processes sharing the batches (default 1)")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # set by --workers for its children
    args = p.parse_args(argv)
    if args.seed is None:
        args.seed = int(np.random.randint(2**31))  # one seed for the run, shared by its workers
    return args


def _number(value, low=-math.inf, high=math.inf, *, above=False):
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and (value > low if above else value >= low) and value <= high)


def _integer(value, low, high):
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


FIELDS = {  # a line's control: (what its value must be, the check, given n_vocab)
    "temperature": ("a number >= 0", lambda v, _: _number(v, 0)),
    "top_k": ("an integer >= 0", lambda v, _: _integer(v, 0, 2**31 - 1)),
    "top_p": ("a number in [0, 1]", lambda v, _: _number(v, 0, 1)),
    "min_p": ("a number in [0, 1]", lambda v, _: _number(v, 0, 1)),
    "seed": ("an integer in [0, 2**32)", lambda v, _: _integer(v, 0, 2**32 - 1)),
    "repetition_penalty": ("a number > 0", lambda v, _: _number(v, 0, above=True)),
    "presence_penalty": ("a number >= 0", lambda v, _: _number(v, 0)),
    "frequency_penalty": ("a number >= 0", lambda v, _: _number(v, 0)),
    "stop_at_eot": ("true or false", lambda v, _: isinstance(v, bool)),
    "stop": ("a list of non-empty strings", lambda v, _: isinstance(v, list) and all(isinstance(t, str) and t
                                                                                    for t in v)),
    "logit_bias": ("an object of token ids below n_vocab to numbers (-100 or less bans)",
                   lambda v, n_vocab: isinstance(v, dict) and all(
                       k.isdigit() and int(k) < n_vocab and (_number(x) or x == -math.inf) for k, x in v.items())),
}


def line_controls(row, n_vocab):
    """The control fields of an input line (`FIELDS`), checked, as sorted (field, value) pairs:
    lines with equal pairs may share a batch. Raises ValueError naming the field."""
    fields = []
    for name in sorted(set(row) & set(FIELDS)):
        what, ok = FIELDS[name]
        if not ok(row[name], n_vocab):
            raise ValueError(f"field {name!r} must be {what}, got {json.dumps(row[name])}")
        value = row[name]
        if name == "logit_bias":
            value = tuple(sorted((int(k), float(x)) for k, x in value.items()))
        fields.append((name, tuple(value) if name == "stop" else value))
    return tuple(fields)


def sampling(args, enc, fields, seed, flags):
    """`tfgpt2.generate`'s keywords for a batch: the flags' (`flags`, the controls), then the
    line's fields over them; `seed` unless the line has its own."""
    keywords = dict(flags, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=seed,
                    stop_at_eot=args.stop_at_eot)
    for name, value in fields:
        keywords[name] = {"logit_bias": lambda: dict(value), "stop": lambda: [enc.encode(t) for t in value]}.get(
            name, lambda: value)()
    return keywords


def read_prompts(path):
    """(line number, the line's object) for every non-blank line of the JSONL file at `path`;
    a line that is not a JSON object with a string "prompt" gives (line number, ValueError)."""
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                yield n, ValueError(f"not valid JSON ({e})")
                continue
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                yield n, ValueError('not a JSON object with a string "prompt"')
            else:
                yield n, row


def plan(args, enc, n_ctx, length, n_vocab):
    """The batches, lists of (line, prompt, tokens, controls) of one length bucket and the same
    controls (`line_controls`) each, in the order of their controls, then smallest bucket
    first; a line with its own "seed" alone. Raises ValueError naming the
    first bad line, unless --skip_bad (then each is reported and counted)."""
    buckets, bad = {}, 0
    for n, row in read_prompts(args.input):
        prompt = row if isinstance(row, ValueError) else row["prompt"]
        tokens = [] if isinstance(row, ValueError) else enc.encode(prompt)
        fields = problem = None
        if isinstance(row, ValueError):
            problem = row
        elif not tokens:
            problem = "empty prompt"
        elif args.context_keep is not None and len(tokens) > n_ctx:
            problem = f"prompt of {len(tokens)} tokens exceeds the context window n_ctx={n_ctx}"
        elif args.context_keep is None and not fits(len(tokens), length, n_ctx):
            problem = f"prompt of {len(tokens)} tokens + --length {length} - 1 exceeds the context window n_ctx={n_ctx}"
        else:
            try:
                fields = line_controls(row, n_vocab)
            except ValueError as e:
                problem = e
        if problem is not None:
            where = f"{args.input}:{n + 1} (line {n} counted from 0)"
            if not args.skip_bad:
                raise ValueError(f"{where}: {problem} (--skip_bad skips such lines)")
            print(f"skipped {where}: {problem}", file=sys.stderr)
            bad += 1
            continue
        key = (json.dumps(fields), bucket(len(tokens))) + ((n,) if "seed" in dict(fields) else ())
        buckets.setdefault(key, []).append((n, prompt, tokens, fields))
    if bad:
        print(f"skipped {bad} bad line(s) of {args.input}", file=sys.stderr)
    size = args.batch_size
    return [rows[i:i + size] for _, rows in sorted(buckets.items()) for i in range(0, len(rows), size)]


def read_done(path, *, repair):
    """The line numbers already in the output. With `repair`, first rewrites it (temp name,
    then rename) without a torn last line, lines that are not rows, and repeated line numbers."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        data = f.read()
    done, keep, dropped = set(), [], 0
    for raw in data.split(b"\n"):
        try:
            line = json.loads(raw)["line"]
            fresh = isinstance(line, int) and line not in done
        except (ValueError, TypeError, KeyError):  # torn, or not a row
            fresh = False
        if fresh:
            done.add(line)
            keep.append(raw + b"\n")
        elif raw:
            dropped += 1
    if repair and dropped:
        with replacing(path) as temp, open(temp, "wb") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        print(f"{path}: dropped {dropped} torn or repeated line(s); their prompts are generated again",
              file=sys.stderr)
    return done


def lock(path):
    """An exclusive lock on `path`.lock, held by a run (its workers write under it), so that a
    second run on the same output is refused instead of writing the same lines again."""
    fd = os.open(path + ".lock", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"{path}: another generate_batch run is writing it (it holds {path}.lock)") from None
    return fd


def append(path, rows):
    """Append the rows as JSON lines with one write under an exclusive lock, then fsync.
    A torn line left by a writer that died mid-write is ended first, so it stays one bad line."""
    data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    finally:
        os.close(fd)


def generate_batch(args, model, enc, length, batches, done, worker=0, workers=1, parent=None):
    """Generate and append the batches of this worker that have lines not yet done; a worker
    of `--workers` (`parent`: the process that started it) stops once that process is gone."""
    todo = [(b, rows) for b, rows in enumerate(batches) if b % workers == worker
            and any(n not in done for n, _, _, _ in rows)]
    progress = Progress(args.quiet)
    total = sum(len(rows) for _, rows in todo)
    prompts = tokens = 0
    start = last = time.monotonic()
    name = f"worker {worker}/{workers}: " if workers > 1 else ""
    if not todo:
        progress.note(f"{name}no prompts left to generate")
    controlled = controls(args, enc, model.hparams.n_vocab)
    for b, rows in todo:
        if parent is not None and os.getppid() != parent:
            return prompts
        context = [t for _, _, t, _ in rows]
        if len(rows) > 1 or "seed" not in dict(rows[0][3]):  # one compiled shape per bucket
            context += [context[0]] * (args.batch_size - len(context))
        out = generate(model, context, length, **sampling(args, enc, rows[0][3], args.seed + b, controlled))
        new = [(n, prompt, out[i][len(t):].tolist()) for i, (n, prompt, t, _) in enumerate(rows) if n not in done]
        append(args.output, [dict(line=n, prompt=prompt, text=enc.decode(ids), tokens=ids) for n, prompt, ids in new])
        prompts += len(new)
        tokens += sum(len(ids) for _, _, ids in new)
        now = time.monotonic()
        if now - last >= PROGRESS_EVERY or prompts == total:
            last = now
            progress.note(f"{name}{prompts}/{total} prompts, {prompts / (now - start):.2f} prompts/s, "
                          f"{tokens / (now - start):.1f} tokens/s")
    return prompts


def spawn(argv, args):
    """Run --workers child processes of this command on the same arguments; 0 if all succeed."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    children = []
    for k in range(args.workers):
        env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": visible[k % len(visible)]} if visible else {}))
        children.append(subprocess.Popen([*worker_command(), *argv, "--seed", str(args.seed), "--worker", str(k)],
                                         env=env))
    failed = None
    while children and failed is None:
        for k, child in enumerate(children):
            if child.poll() not in (None, 0):
                failed = f"worker {k} ended with status {child.returncode}"
        children = [c for c in children if c.returncode is None]
        time.sleep(0.2)
    for child in children:
        child.terminate()
        child.wait()
    if failed:
        return f"error: {failed}; the rows written so far are kept, rerun to resume"
    return 0


def worker_command():
    """How a worker is started: as `tfgpt2 generate-batch` through the console script's module,
    which keeps TensorFlow's start-up lines off the terminal, where it is importable (else
    `python -m tfgpt2.generate_batch`)."""
    if importlib.util.find_spec("tfgpt2_cli") is not None:
        return [sys.executable, "-m", "tfgpt2_cli", "generate-batch"]
    return [sys.executable, "-m", "tfgpt2.generate_batch"]


def main(argv=None, model=None, prog="tfgpt2 generate-batch"):
    """The command; `model`, where given, is --model_name already loaded (else it is loaded here)."""
    end_at_once()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = arguments(argv, prog)
    held = None
    try:
        folder = model_dir(args)
        n_ctx = load_hparams(folder).n_ctx
        enc = encoder_of(folder)
        length = n_ctx // 2 if args.length is None else args.length
        if length < 1:
            raise ValueError(f"--length must be at least 1, got {length}")
        if args.context_keep is not None and args.context_keep >= n_ctx:
            raise ValueError(f"--context_keep must be below the model's n_ctx={n_ctx}, got {args.context_keep}")
        batches = plan(args, enc, n_ctx, length, load_hparams(folder).n_vocab)
        if args.worker is None:
            held = lock(args.output)
    except (OSError, ValueError) as e:
        return f"error: {e}"
    try:
        return run_batches(argv, args, model, enc, length, batches)
    finally:
        if held is not None:
            os.close(held)


def run_batches(argv, args, model, enc, length, batches):
    """Generate the missing lines, here or in --workers child processes; the exit status."""
    done = read_done(args.output, repair=args.worker is None)
    if args.worker is None and args.workers > 1:
        start = time.monotonic()
        status = spawn(argv, args)
        if status == 0:
            rows = len(read_done(args.output, repair=False)) - len(done)
            Progress(args.quiet).note(f"{rows} prompts in {time.monotonic() - start:.1f} s with "
                                      f"{args.workers} workers")
        return status
    if model is None:
        model = load(args, lambda n_ctx: n_ctx // 2)[0]
    parent = None if args.worker is None else os.getppid()
    generate_batch(args, model, enc, length, batches, done, args.worker or 0, args.workers, parent)
    return 0
