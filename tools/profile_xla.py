#!/usr/bin/env python3
"""Where the time of an XLA-compiled step goes: each compiled operation's time, from
TensorFlow's profiler, summed by what the operation does.

    python tools/profile_xla.py --model_dir models/124M generate --batch 8 --length 160
    python tools/profile_xla.py --model_dir models/124M train --batch 4 --length 128
    python tools/profile_xla.py --model_dir models/124M serve --batch 16 --window 256 --dtype bfloat16

`generate` profiles one `generate` call of `--length` new tokens after a 1-token prompt, per
generated token; `train` profiles `--steps` Adam steps of `tfgpt2.train.Trainer`, per step;
`serve` profiles `--steps` decode calls of the server's slots (`tfgpt2.decoding.slots`, as
`tfgpt2 serve --max_batch M` holds them), each one token for the first `--batch` slots over
the first `--window` positions of their cache, per call (each after a warm-up call that
compiles). `--dtype` is the weights' (as `tfgpt2 generate --dtype`).

XLA runs the operations of a program one after another, each spread over the cores inside,
except where independent ones overlap, so their times add up to about the wall time. Each
operation is put in a group by the TensorFlow op it came from (its name in XLA's optimized
HLO, written with `--xla_dump_to`): the block weights' products, attention's products, the
output layer's products (with `wte`), the optimizer's update, the step's sampling (the
controls, the filters and the draw: `tfgpt2.decoding.step`), and the rest (norms, GELU,
softmax, cache writes). The report (tools/report.py: the groups, the longest operations, and
the block weights' products by the weight each reads, a block's four summed over the blocks)
goes to `--report DIR` as `--name`.json and .md (default profile-<mode>).
"""
import argparse
import collections
import glob
import os
import re
import shutil
import tempfile
import time

try:
    from . import report
except ImportError:  # run as `python tools/profile_xla.py`: this folder is on sys.path
    import report

GROUPS = ("block weights", "attention", "output layer", "optimizer", "sampling", "other")
WEIGHTS = ("attn/c_attn", "attn/c_proj", "mlp/c_fc", "mlp/c_proj")  # a block's, in the order it reads them


def group_of(op_type, op_name):
    """The group of an HLO instruction from its TensorFlow op's type and name."""
    product = op_type in ("MatMul", "BatchMatMulV2", "Einsum", "XlaDot", "XlaDotV2",
                          "RowProduct", "BiasedRowProduct", "ColumnProduct", "CachedAttention")  # (tfgpt2.kernels')
    if re.search(r"Adam|optimizer|AssignVariableOp|AssignSubVariableOp|AssignAddVariableOp", op_name + op_type):
        return "optimizer"
    if re.search(r"(^|/)sampling(_\d+)?/", op_name):  # tfgpt2.decoding.step: the controls and the draw
        return "sampling"
    if product and re.search(r"/(c_attn|c_proj|c_fc)", op_name):
        return "block weights"
    if product and "/attn" in op_name:
        return "attention"
    if product:
        return "output layer"
    return "other"


def weight_of(op_name):
    """The block weight a product's TensorFlow op reads ("attn/c_attn", "attn/c_proj",
    "mlp/c_fc", "mlp/c_proj"), from its name; None for another op."""
    m = re.search(r"/(attn|mlp)(?:_\d+)?/(c_attn|c_proj|c_fc)(?:_\d+)?/", op_name)
    return m and f"{m.group(1)}/{m.group(2)}"


def hlo_groups(dump_dir):
    """{instruction name: group} over the optimized HLO modules XLA wrote to dump_dir. An
    instruction without a TensorFlow op (XLA's own: a copy, a rewritten cumulative sum) is in
    "other", except batched products (attention's, at one row) and what runs in a computation
    of the sampling's (a branch of its conditionals, named after them)."""
    groups = {}
    for name, within, tf_op, line in hlo_instructions(dump_dir):
        if tf_op:
            groups[name] = group_of(*tf_op)
        elif " dot(" in line and "lhs_batch_dims" in line:
            groups[name] = "attention"
        else:
            groups[name] = "sampling" if re.search(r"(^|_)sampling(_\d+)?_", within) else "other"
    return groups


def hlo_weights(dump_dir):
    """{instruction name: the block weight it multiplies by (`weight_of`)} over the block
    weights' products in the optimized HLO modules XLA wrote to dump_dir."""
    return {name: weight_of(tf_op[1]) for name, _, tf_op, _ in hlo_instructions(dump_dir)
            if tf_op and group_of(*tf_op) == "block weights"}


def hlo_instructions(dump_dir):
    """(name, the computation it is in, (its TensorFlow op's type, name) or None, its line) of
    each instruction of the optimized HLO modules XLA wrote to dump_dir."""
    computation = re.compile(r'^(?:ENTRY )?%?([\w.\-]+) ')
    instruction = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = ')
    op = re.compile(r'metadata=\{op_type="([^"]*)" op_name="([^"]*)"')
    for path in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")):
        within = ""
        with open(path) as f:
            for line in f:
                m = instruction.match(line)
                if not m:
                    header = computation.match(line)
                    within = header.group(1) if header else within
                    continue
                tf_op = op.search(line)
                yield m.group(1), within, tf_op and tf_op.groups(), line


def op_times(logdir):
    """{operation name: seconds} over the XLA operations the profiler recorded under logdir,
    each without the time of operations nested in it (a loop's or a conditional's body).
    An operation is an event with an `hlo_op` stat, on whichever thread ran it: XLA's thread
    pool, or the calling thread (which runs whole programs when the cores are busy)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    times = collections.Counter()
    for path in glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True):
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        for plane in space.planes:
            names = {k: v.name for k, v in plane.event_metadata.items()}
            hlo_op = {k for k, v in plane.stat_metadata.items() if v.name == "hlo_op"}
            for line in plane.lines:
                open_events = []  # (end, name) of the operations enclosing the current one
                for event in sorted(line.events, key=lambda e: (e.offset_ps, -e.duration_ps)):
                    if not any(stat.metadata_id in hlo_op for stat in event.stats):
                        continue
                    name = names.get(event.metadata_id, "")
                    while open_events and open_events[-1][0] <= event.offset_ps:
                        open_events.pop()
                    if open_events:
                        times[open_events[-1][1]] -= event.duration_ps / 1e12
                    times[name] += event.duration_ps / 1e12
                    open_events.append((event.offset_ps + event.duration_ps, name))
    return times


def profiled(run, units, warmup=1):
    """Runs `run()` `warmup` times, then once under the profiler. Returns (wall seconds per
    unit, {operation: seconds per unit})."""
    import tensorflow as tf
    for _ in range(warmup):
        run()
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        start = time.perf_counter()
        run()
        wall = time.perf_counter() - start
        tf.profiler.experimental.stop()
        times = op_times(logdir)
    return wall / units, {k: v / units for k, v in times.items()}


def generate_run(model, args):
    from tfgpt2.sample import generate
    prompts = [[1]] * args.batch
    return lambda: generate(model, prompts, args.length, seed=0), args.length


def serve_run(model, args):
    """`--steps` decode calls of `--batch` rows, as the server's step over that many sequences
    (a sampled token each, temperature 1, no penalties) at the window's last position."""
    import numpy as np
    from tfgpt2.decoding import controls as control
    from tfgpt2.decoding.slots import FLOATS, INTS, Slots
    from tfgpt2.decoding.cache import window
    hp = model.hparams
    if args.window != window(args.window, hp.n_ctx):
        raise SystemExit(f"--window {args.window}: a step's window is whole blocks of the cache (64, 128, ...), "
                         f"at most n_ctx={hp.n_ctx}")
    slots = Slots(model, max_batch=args.max_batch, chunk=min(64, hp.n_ctx), steps=1, eot=hp.n_vocab - 1)
    ints = {name: np.zeros(args.batch, np.int32) for name in INTS}
    ints.update(token=np.ones(args.batch, np.int32), position=np.full(args.batch, args.window - 1, np.int32),
                budget=np.ones(args.batch, np.int32), length=np.full(args.batch, hp.n_ctx, np.int32))
    floats = {name: np.zeros(args.batch, np.float32) for name in FLOATS}
    floats.update(temperature=np.ones(args.batch, np.float32), top_p=np.ones(args.batch, np.float32),
                  **{name: np.full(args.batch, off, np.float32) for name, off in control.OFF.items()})
    ints, floats = np.stack([ints[n] for n in INTS]), np.stack([floats[n] for n in FLOATS])
    seed = np.arange(args.batch, dtype=np.int64)

    def run():
        for _ in range(args.steps):
            slots.decode(ints, floats, seed, args.window)
    return run, args.steps


def train_run(model, args):
    import numpy as np
    import tensorflow as tf
    from tfgpt2.train.optimizers import make_optimizer
    from tfgpt2.train.step import Trainer
    trainer = Trainer(model, make_optimizer("adam", 2e-5))
    rng = np.random.default_rng(0)
    batches = [tf.constant(rng.integers(0, model.hparams.n_vocab, [args.batch, args.length + 1]), tf.int32)
               for _ in range(args.steps)]

    def run():
        for batch in batches:
            float(trainer.step(batch))
    return run, args.steps


MODES = {  # mode: (its run, the unit timed, what the profiled run does, its settings in the report)
    "generate": (generate_run, "generated token (the whole batch's step)",
                 "generating {length} tokens at batch {batch}", ("length", "dtype")),
    "train": (train_run, "training step", "{steps} Adam steps on {batch} x {length} tokens", ("length", "steps")),
    "serve": (serve_run, "decode call (a token for each row)",
              "{steps} decode calls of {batch} of {max_batch} slots over {window} positions",
              ("steps", "dtype", "max_batch", "window")),
}
GROUP_COLUMNS = [report.column("group", "group"), report.column("ms", "ms", ".3f"),
                 report.column("share", "share", ".0%")]
OP_COLUMNS = [report.column("operation", "operation"), report.column("group", "group"),
              report.column("ms", "ms", ".2f")]
WEIGHT_COLUMNS = [report.column("weight", "block weight"), report.column("ms", "ms", ".3f"),
                  report.column("operations", "operations")]


def summary(wall, times, groups, weights, top=12):
    """(facts, group rows, longest operations' rows, block weights' rows), times in ms per unit;
    `weights` as `hlo_weights` gives them."""
    by_group = collections.Counter()
    for name, seconds in times.items():
        by_group[groups.get(name, "other")] += seconds
    total = sum(by_group.values())
    if not total:
        raise SystemExit("the profiler recorded no XLA operations (is this TensorFlow's profiler working?)")
    unmatched = sum(s for n, s in times.items() if n not in groups)
    facts = {"wall_ms": wall * 1e3, "operations_ms": total * 1e3, "unmatched_ms": unmatched * 1e3}
    group_rows = [{"group": g, "ms": by_group[g] * 1e3, "share": by_group[g] / total} for g in GROUPS]
    op_rows = [{"operation": name, "group": groups.get(name, "other"), "ms": seconds * 1e3}
               for name, seconds in sorted(times.items(), key=lambda kv: -kv[1])[:top]]
    weight_rows = [{"weight": w, "ms": sum(s for n, s in times.items() if weights.get(n) == w) * 1e3,
                    "operations": sum(1 for n in times if weights.get(n) == w)} for w in WEIGHTS]
    return facts, group_rows, op_rows, weight_rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_dir", default="models/124M")
    p.add_argument("mode", choices=list(MODES))
    p.add_argument("--batch", type=int, default=1, help="rows (serve: the slots a decode call runs)")
    p.add_argument("--length", type=int, default=160, help="new tokens (generate) or predicted tokens per row (train)")
    p.add_argument("--steps", type=int, default=3, help="train: steps profiled; serve: decode calls profiled")
    p.add_argument("--dtype", default="float32", help="generate, serve: the weights' (float32, bfloat16, int8)")
    p.add_argument("--max_batch", type=int, default=16, help="serve: the slots held (tfgpt2 serve --max_batch)")
    p.add_argument("--window", type=int, default=256, help="serve: the cache positions a decode call reads")
    report.add_arguments(p, "profile-<mode>")
    args = p.parse_args(argv)
    if args.mode == "train" and args.dtype != "float32":
        p.error("train profiles float32 weights (--dtype float32)")
    if args.mode == "serve" and not 0 < args.batch <= args.max_batch:
        p.error(f"--batch {args.batch} must be 1 to --max_batch {args.max_batch}")
    args.name = args.name.replace("<mode>", args.mode)
    dump_dir = tempfile.mkdtemp(prefix="profile_xla_")
    try:
        wall, times, groups, weights = run_profile(args, dump_dir)
    finally:
        shutil.rmtree(dump_dir, ignore_errors=True)
    facts, group_rows, op_rows, weight_rows = summary(wall, times, groups, weights)
    _, unit, what, keys = MODES[args.mode]
    what = what.format(**vars(args))
    notes = [f"One profiled run ({what}) after a warm-up one; ms per {unit}. Wall {facts['wall_ms']:.1f} ms; "
             f"XLA operations {facts['operations_ms']:.1f} ms, of which {facts['unmatched_ms']:.1f} ms not "
             f"found in the HLO dump (counted as other)."]
    settings = {k: getattr(args, k) for k in ("model_dir", "mode", "batch") + keys}
    settings.update(facts)
    report.publish(args, f"Where the time goes: {args.mode}", [report.table(GROUP_COLUMNS, group_rows, "By group"),
                   report.table(OP_COLUMNS, op_rows, "Longest operations"),
                   report.table(WEIGHT_COLUMNS, weight_rows, "Block weights, by the weight read")],
                   tool=__file__, argv=argv,
                   settings=settings, notes=notes)


def run_profile(args, dump_dir):
    """(wall seconds per unit, {operation: seconds per unit}, {operation: group}, {operation:
    block weight})."""
    # both read when XLA first compiles: this process's own settings, added to the user's
    os.environ["XLA_FLAGS"] = " ".join(filter(None, (os.environ.get("XLA_FLAGS"), "--xla_cpu_enable_xprof_traceme=true",
                                                      f"--xla_dump_to={dump_dir}", "--xla_dump_hlo_as_text")))
    from tfgpt2 import load_model
    model = load_model(args.model_dir, dtype=args.dtype)
    run, units = MODES[args.mode][0](model, args)
    wall, times = profiled(run, units)
    return wall, times, hlo_groups(dump_dir), hlo_weights(dump_dir)


if __name__ == "__main__":
    main()
