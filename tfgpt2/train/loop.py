"""Fine-tuning OpenAI's GPT-2 checkpoints: the forks' `train.py`, in TensorFlow 2 / Keras 3.

    python -m tfgpt2.train --dataset corpus.txt --model_name 124M --steps 1000 --run_name run1

It reads like nanoGPT's `train.py`: data, step, log, evaluate, save. The forks' flags and
defaults leave their update rule unchanged (Adam as TensorFlow 1's `AdamOptimizer`, epsilon
1e-8, learning rate 2e-5, batch 1, windows of 1024 tokens); unlike them, accumulated gradients
are averaged, validation uses data never trained on, and the optimizer state is saved with
each checkpoint so that a resumed run continues exactly.

The run folder `checkpoint/<run_name>/` is gpt-2-simple's: `model-<step>.*` in OpenAI's
variable layout (OpenAI's code and `tfgpt2.load_model` restore it), `checkpoint`, `counter`,
`hparams.json`, `encoder.json`, `vocab.bpe`, TensorBoard events; and `optimizer-<step>.*`
beside the latest model, `best.json` where validation runs, `samples-<step>.txt`.
"""
import contextlib
import json
import math
import os
import signal
import sys
import time

import numpy as np
import tensorflow as tf
import keras
from tensorflow.core.framework import summary_pb2
from tqdm import tqdm

from ..encoder import get_encoder
from ..formats.checkpoint import load_model
from ..formats.files import write_text
from ..sample import generate
from . import data, distribute
from .optimizers import make_optimizer, trained_variables
from .run_folder import checkpoint_steps, find_start, read_best, restore_optimizer, save_run, vocabulary_dir, write_run_files
from .step import Trainer


def load_data(args, enc, hparams):
    """(training windows, validation batches or None), and the window length."""
    length = args.sample_length + 1
    chunks = data.load_dataset(enc, args.dataset, combine=args.combine, encoding=args.encoding,
                               n_vocab=hparams.n_vocab)
    _check_ids(chunks, hparams.n_vocab, args.dataset)
    val = None
    if args.val_dataset:
        val_chunks = data.load_dataset(enc, args.val_dataset, combine=args.combine, encoding=args.encoding,
                                       n_vocab=hparams.n_vocab)
        val = data.Windows(val_chunks, length, name=args.val_dataset)
    elif args.val_every > 0:
        chunks, val_chunks = data.split_validation(chunks, args.val_fraction)
        val = data.Windows(val_chunks, length, name=f"{args.dataset} (the held-out last "
                                                    f"--val_fraction {args.val_fraction})")
    train = data.Windows(chunks, length, name=args.dataset)
    val_batches = val and data.fixed_batches(val, batch_size=args.val_batch_size, count=args.val_batch_count)
    return train, val_batches


def _check_ids(chunks, n_vocab, name):
    top = max(int(c.max()) for c in chunks if c.size) if any(c.size for c in chunks) else 0
    if top >= n_vocab:
        raise data.DatasetError(f"{name}: token id {top} is outside [0, n_vocab={n_vocab})")


def build_trainer(args, strategy, source, prefix):
    """(model, optimizer, Trainer) as the flags say, the model's weights from `prefix`, the
    model and the optimizer's state made in the strategy's scope."""
    with strategy.scope():
        model = load_model(source, checkpoint=prefix, dtype=args.precision, remat=args.remat)
    variables = trained_variables(model, args.only_train_transformer_layers)
    with strategy.scope():
        optimizer = make_optimizer(args.optimizer, args.learning_rate, lr_schedule=args.lr_schedule,
                                   warmup_steps=args.warmup_steps, total_steps=args.steps,
                                   clip_norm=args.clip_norm, weight_decay=args.weight_decay,
                                   variables=variables)
        if args.precision == "mixed_float16":  # dynamic loss scaling; a step with inf or NaN is skipped
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    trainer = Trainer(model, optimizer, variables=variables, accumulate=args.accumulate_gradients,
                      strategy=strategy, jit_compile=not args.no_xla)
    return model, optimizer, trainer


def train(args, strategy=None):
    """Fine-tune as the flags say; returns the list of (step, loss) of this run's updates."""
    strategy = strategy or tf.distribute.get_strategy()
    distribute.check_batch(args.batch_size, strategy)
    chief = distribute.is_chief(strategy)  # the one process that writes the run folder
    run_dir, source, prefix, step, hp = find_start(args)
    if step == args.steps:
        tqdm.write(f"{run_dir} has made its --steps {step} updates already: nothing to train")
        return []
    args.sample_length = args.sample_length or hp.n_ctx - 1
    if args.sample_length > hp.n_ctx:
        raise ValueError(f"--sample_length {args.sample_length} exceeds the model's context n_ctx={hp.n_ctx}")
    vocab_dir = vocabulary_dir(source, os.path.join(args.models_dir, args.model_name))
    enc = get_encoder(os.path.basename(vocab_dir), os.path.dirname(vocab_dir))
    windows, val_batches = load_data(args, enc, hp)
    model, optimizer, trainer = build_trainer(args, strategy, source, prefix)
    if chief:
        write_run_files(run_dir, hp, vocab_dir)
    if step and not restore_optimizer(optimizer, run_dir, step):
        tqdm.write(f"{run_dir}: no optimizer state for step {step}; the optimizer starts afresh")
    optimizer.iterations.assign(step)

    per_step = args.batch_size * args.accumulate_gradients  # in all, split over the replicas
    dataset = data.training_dataset(windows, batch_size=per_step, seed=args.seed, start_step=step, steps=args.steps)
    best = read_best(run_dir)
    writer = tf.summary.create_file_writer(run_dir) if chief else tf.summary.create_noop_writer()
    history, avg = [], [0.0, 0.0]
    bar = tqdm(initial=step, total=args.steps if args.steps > 0 else None, unit="step",
               disable=not sys.stderr.isatty())

    def save():
        if not chief:
            return
        with _no_interrupts():
            save_run(run_dir, model, optimizer, step, max_checkpoints=args.max_checkpoints,
                     keep={best["step"]} if best else ())
            if best and best["step"] == step:
                write_text(os.path.join(run_dir, "best.json"), json.dumps(best) + "\n")
        tqdm.write(f"Saving {run_dir}/model-{step}")

    saved = step
    try:
        batches = iter(trainer.distribute(dataset))
        while args.steps < 0 or step < args.steps:
            start = time.perf_counter()
            loss = float(trainer.step(next(batches)))
            step += 1
            seconds = time.perf_counter() - start
            history.append((step, loss))
            avg = [avg[0] * 0.99 + loss, avg[1] * 0.99 + 1]
            lr = _current_lr(optimizer)
            tokens_per_s = per_step * args.sample_length / seconds
            _log(writer, step, loss=loss, learning_rate=lr, tokens_per_second=tokens_per_s)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", avg=f"{avg[0] / avg[1]:.4f}", tok_s=f"{tokens_per_s:.0f}",
                            lr=f"{lr:.3g}")
            if bar.disable and args.print_every and step % args.print_every == 0:
                print(f"[{step} | {seconds:.2f}s] loss={loss:.4f} avg={avg[0] / avg[1]:.4f} "
                      f"tokens/s={tokens_per_s:.0f} lr={lr:.3g}", flush=True)
            if args.val_every > 0 and step % args.val_every == 0:
                val_loss = validate(trainer, val_batches)
                _log(writer, step, val_loss=val_loss, val_perplexity=math.exp(val_loss))
                tqdm.write(f"[{step}] validation loss={val_loss:.4f} perplexity={math.exp(val_loss):.2f}")
                if best is None or val_loss < best["val_loss"]:
                    best = {"step": step, "val_loss": val_loss}
                    save()
                    saved = step
            if args.save_every > 0 and step % args.save_every == 0 and saved != step:
                save()
                saved = step
            if args.sample_every > 0 and step % args.sample_every == 0 and chief:
                write_samples(model, enc, args, run_dir, step)
    except KeyboardInterrupt:
        tqdm.write("interrupted")
    finally:
        bar.close()
        writer.close()
    if saved != step:
        save()
    return history


@contextlib.contextmanager
def _no_interrupts():
    """Ctrl-C waits until the block (writing a checkpoint) is done, then takes effect."""
    pending = []
    try:
        previous = signal.signal(signal.SIGINT, lambda *_: pending.append(True))
    except ValueError:  # not the main thread: signals go elsewhere anyway
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        raise KeyboardInterrupt


def validate(trainer, batches):
    """The mean loss over the validation batches [count, batch, length], each split over the replicas."""
    dataset = trainer.distribute(tf.data.Dataset.from_tensor_slices(batches))
    return float(np.mean([float(trainer.loss(batch)) for batch in dataset]))


def write_samples(model, enc, args, run_dir, step):
    """`--sample_num` samples of `--sample_length` tokens from <|endoftext|>, printed and written
    to samples-<step>.txt."""
    rows = generate(model, [[enc.eot_token]] * args.sample_num, args.sample_length, top_k=args.top_k,
                    seed=args.seed + step)
    text = "".join("=" * 20 + f" SAMPLE {i} " + "=" * 20 + "\n" + enc.decode(row[1:]) + "\n"
                   for i, row in enumerate(rows))
    tqdm.write(text)
    write_text(os.path.join(run_dir, f"samples-{step}.txt"), text)


def _current_lr(optimizer):
    return float(tf.convert_to_tensor(optimizer.learning_rate))  # the schedule's value where there is one


def _log(writer, step, **scalars):
    """TensorBoard scalars, as `tf.summary.scalar` writes them (which needs tensorboard installed)."""
    metadata = summary_pb2.SummaryMetadata()
    metadata.plugin_data.plugin_name = "scalars"
    with writer.as_default():
        for name, value in scalars.items():
            tf.summary.write(name, tf.constant(value, tf.float32), step=step, metadata=metadata)
