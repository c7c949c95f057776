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
beside the latest model, `best.json` where validation runs, `samples-<step>.txt`. With LoRA
(`--lora_rank`) only the adapters train; `model-<step>` holds the merged weights, in the same
layout, and `lora-<step>.*` the adapters.
"""
import contextlib
import dataclasses
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

from ..formats.checkpoint import checkpoint_prefix, load_model
from ..formats.files import write_text
from ..formats.folders import encoder_of, model_path, vocabulary_source
from ..sample import generate
from ..seeds import seed_of
from . import data, distribute
from .config import TrainConfig
from .optimizers import make_optimizer, trained_variables
from .run_folder import find_start, latest_of, locked, read_best, restore_optimizer, save_run, write_run_files
from .step import Trainer


def load_data(config, enc, hparams):
    """(training windows, validation batches or None), windows of `config.window(n_ctx)` + 1 tokens."""
    length = config.window(hparams.n_ctx) + 1
    chunks = data.load_dataset(enc, config.dataset, combine=config.combine, encoding=config.encoding,
                               n_vocab=hparams.n_vocab)
    val = None
    if config.val_dataset:
        val_chunks = data.load_dataset(enc, config.val_dataset, combine=config.combine, encoding=config.encoding,
                                       n_vocab=hparams.n_vocab)
        val = data.Windows(val_chunks, length, name=config.val_dataset)
    elif config.val_every > 0:
        chunks, val_chunks = data.split_validation(chunks, config.val_fraction)
        val = data.Windows(val_chunks, length, name=f"{config.dataset} (the held-out last "
                                                    f"--val_fraction {config.val_fraction})")
    train = data.Windows(chunks, length, name=config.dataset)
    val_batches = val and data.fixed_batches(val, batch_size=config.val_batch_size, count=config.val_batch_count)
    return train, val_batches


def build_trainer(config, strategy, source, prefix, adapters=None):
    """(model, optimizer, Trainer) as the flags say, the model's weights from `prefix`, LoRA
    (--lora_rank) from the adapter checkpoint `adapters` or afresh, the model and the
    optimizer's state made in the strategy's scope."""
    with strategy.scope():
        model = load_model(source, checkpoint=prefix, dtype=config.precision, remat=config.remat, lora=adapters,
                           tf32=config.tf32)
        if config.lora_rank and not adapters:
            model.enable_lora(config.lora_rank, config.lora_targets, lora_alpha=config.lora_alpha, seed=config.seed)
    variables = trained_variables(model, config.only_train_transformer_layers)
    with strategy.scope():
        optimizer = make_optimizer(config.optimizer, config.learning_rate, lr_schedule=config.lr_schedule,
                                   warmup_steps=config.warmup_steps, total_steps=config.steps,
                                   clip_norm=config.clip_norm, weight_decay=config.weight_decay,
                                   variables=variables)
        if config.precision == "mixed_float16":  # dynamic loss scaling; a step with inf or NaN is skipped
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    trainer = Trainer(model, optimizer, variables=variables, accumulate=config.accumulate_gradients,
                      strategy=strategy, jit_compile=not config.no_xla, noise=config.noise, seed=config.seed,
                      skip_non_finite=config.max_bad_steps > 0)
    return model, optimizer, trainer


def finetune(dataset, *, strategy=None, **settings):
    """`python -m tfgpt2.train` from Python, as gpt-2-simple's `finetune` for notebooks: each
    keyword is the flag of that name (True for a switch), e.g.
    `finetune("corpus.txt", model_name="355M", steps=1000, remat=True)` (a list for a flag of
    several values: `lora_rank=8, lora_targets=["c_attn", "c_fc"]`). Returns the (step,
    loss) of each update; Ctrl-C (an interrupted cell) saves and returns. A bad setting raises
    ValueError before anything is loaded or written, as does a loss that is not finite (past
    --max_bad_steps), saving nothing. With `remat=True` on a CPU, calling
    `prefer_memory_schedule()` (`tfgpt2.train.step`) first (before anything compiles) keeps XLA
    from undoing the saving; it sets a process-wide flag, so it is yours to call (`tfgpt2 train
    --remat` does)."""
    try:
        return train(TrainConfig.of(dataset=dataset, **settings), strategy)
    except Interrupted as e:
        return e.history


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run, raised once the run is saved; `history` holds its updates."""

    def __init__(self, history):
        super().__init__("interrupted")
        self.history = history


def train(config, strategy=None):
    """Fine-tune as the TrainConfig says, in `strategy` (default: the one --strategy names);
    returns the list of (step, loss) of this run's updates. The process that writes the run
    folder holds its lock (another run on it is refused). Ctrl-C saves, then raises Interrupted;
    a loss or gradients that are not finite stop the run (ValueError, past --max_bad_steps)
    with nothing saved."""
    strategy = strategy or distribute.make_strategy(config.strategy, config.tpu)
    distribute.check_batch(config.batch_size, strategy)
    chief = distribute.is_chief(strategy)  # the one process that writes the run folder
    with locked(config.run_dir) if chief else contextlib.nullcontext():
        return _train(config, strategy, chief)


def _train(config, strategy, chief):
    run_dir, source, prefix, step, hp, adapters = find_start(config)
    if step == config.steps:
        print(f"{run_dir} has made its --steps {step} updates already: nothing to train", file=sys.stderr)
        return []
    vocab_dir = vocabulary_source(source, model_path(config.base_model, config.models_dir))
    enc = encoder_of(vocab_dir)
    config = dataclasses.replace(config, sample_length=config.window(hp.n_ctx))  # its default, n_ctx - 1
    windows, val_batches = load_data(config, enc, hp)
    model, optimizer, trainer = build_trainer(config, strategy, source, prefix, adapters)
    if chief:
        write_run_files(run_dir, hp, vocab_dir, base=None if step else source)
    log = Log(run_dir if chief else None, config, step)
    if step and not restore_optimizer(optimizer, run_dir, step):
        log.print(f"{run_dir}: no optimizer state for step {step}; the optimizer starts afresh", always=True)
    optimizer.iterations.assign(step)
    run = Run(config, run_dir if chief else None, model, optimizer, trainer, enc, val_batches, log,
              base=os.path.abspath(prefix or checkpoint_prefix(source)))
    dataset = data.training_dataset(windows, batch_size=config.batch_size * config.accumulate_gradients,
                                    seed=config.seed, start_step=step, steps=config.steps)
    return run.steps(iter(trainer.distribute(dataset)), step)


@dataclasses.dataclass
class Run:
    """A run under way: what its steps, validation, samples and saves share. `run_dir` is None
    in the processes that do not write the run folder."""
    config: TrainConfig
    run_dir: str | None
    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    trainer: Trainer
    enc: object
    val_batches: np.ndarray | None
    log: "Log"
    base: str  # the checkpoint LoRA adapters are trained on

    def steps(self, batches, step):
        """Train from `step` on, as nanoGPT's loop; returns the (step, loss) of each update."""
        config, log = self.config, self.log
        per_step = config.batch_size * config.accumulate_gradients  # windows per update, split over the replicas
        best, saved, history, interrupted = read_best(self.run_dir or config.run_dir), step, [], False
        try:
            while config.steps < 0 or step < config.steps:
                start = time.perf_counter()
                applied = self.update(next(batches), step + 1, history)
                step += 1
                if applied:
                    log(step, loss=history[-1][1], learning_rate=current_lr(self.optimizer),
                        tokens_per_second=per_step * config.sample_length / (time.perf_counter() - start))
                save_now = config.save_every > 0 and step % config.save_every == 0
                if config.val_every > 0 and step % config.val_every == 0:
                    val_loss = validate(self.trainer, self.val_batches)
                    log(step, val_loss=val_loss, val_perplexity=math.exp(val_loss))
                    if best is None or val_loss < best["val_loss"]:
                        best, save_now = {"step": step, "val_loss": val_loss}, True
                if save_now and self.run_dir:
                    self.save(step, best)
                    saved = step
                if config.sample_every > 0 and step % config.sample_every == 0 and self.run_dir:
                    log.print(write_samples(self.model, self.enc, config, self.run_dir, step), file=sys.stdout)
        except KeyboardInterrupt:
            interrupted = True
            log.print("interrupted", always=True)
        finally:
            log.close()
        if self.run_dir:
            if saved != step:
                self.save(step, best)
            log.print(f"{self.run_dir}: step {step}" + (f", loss {log.average.value:.4f} (running average)"
                                                        if log.average.weight else ""), always=True)
        if interrupted:
            raise Interrupted(history)
        return history

    def update(self, batch, step, history):
        """Update `step` on `batch`, its (step, loss) added to `history`; False where the loss or
        gradients were not finite (the update skipped, with --max_bad_steps). Past
        --max_bad_steps such updates, ValueError: the run stops, saving nothing."""
        skipped = int(self.trainer.skipped.numpy())
        loss = float(self.trainer.step(batch))
        history.append((step, loss))
        if math.isfinite(loss) and int(self.trainer.skipped.numpy()) == skipped:
            return True
        bad = int(self.trainer.skipped.numpy()) if self.config.max_bad_steps else 1
        what = f"step {step}: the loss is {loss}" if not math.isfinite(loss) else \
            f"step {step}: a gradient is not finite (the loss {loss:.4f})"
        if bad <= self.config.max_bad_steps:
            self.log.print(f"{what}: the update is skipped ({bad} of --max_bad_steps {self.config.max_bad_steps})",
                           always=True)
            return False
        folder = self.run_dir or self.config.run_dir
        raise ValueError(f"{folder}: {what}, not finite: the run stops, saving nothing ({latest_of(folder)}); try "
                         "a lower --learning_rate, --clip_norm, or --max_bad_steps to skip a few such updates")

    def save(self, step, best):
        """The weights and optimizer state of `step` in the run folder (and adapters on `base`),
        and `best.json` where `step` is the best; Ctrl-C waits until they are written."""
        with _no_interrupts():
            save_run(self.run_dir, self.model, self.optimizer, step, max_checkpoints=self.config.max_checkpoints,
                     keep={best["step"]} if best else (), lora_base=self.base)
            if best and best["step"] == step:
                write_text(os.path.join(self.run_dir, "best.json"), json.dumps(best) + "\n")
        self.log.print(f"Saving {self.run_dir}/model-{step}")


class Log:
    """Where a run reports: scalars to TensorBoard in the run folder (`run_dir`; None: none),
    and on stderr a bar (a terminal) or a line every --print_every steps; --quiet: neither."""

    def __init__(self, run_dir, config, step):
        self.writer = tf.summary.create_file_writer(run_dir) if run_dir else tf.summary.create_noop_writer()
        self.quiet, self.print_every = config.quiet, config.print_every
        self.bar = tqdm(initial=step, total=config.steps if config.steps > 0 else None, unit="step",
                        disable=config.quiet or not sys.stderr.isatty())
        self.average = Average()

    def __call__(self, step, **scalars):
        """TensorBoard's scalars at `step`; then the bar or a line: a training step's (with
        `loss`) at its pace, any other at once."""
        with self.writer.as_default():
            for name, value in scalars.items():
                tf.summary.write(name, tf.constant(value, tf.float32), step=step, metadata=_SCALAR)
        if "loss" not in scalars:
            self.print(f"[{step}] " + " ".join(f"{name}={value:.4f}" for name, value in scalars.items()))
            return
        avg = self.average(scalars["loss"])
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{scalars['loss']:.4f}", avg=f"{avg:.4f}",
                             tok_s=f"{scalars['tokens_per_second']:.0f}", lr=f"{scalars['learning_rate']:.3g}")
        if self.bar.disable and self.print_every and step % self.print_every == 0:
            self.print(f"[{step}] loss={scalars['loss']:.4f} avg={avg:.4f} "
                       f"tokens/s={scalars['tokens_per_second']:.0f} lr={scalars['learning_rate']:.3g}")

    def print(self, text, always=False, file=None):
        """A line on stderr, or `file` (above the bar), unless --quiet and not `always`."""
        if always or not self.quiet:
            tqdm.write(text, file=file or sys.stderr)

    def close(self):
        self.bar.close()
        self.writer.close()


class Average:
    """The forks' running average of the loss: weights 0.99^k for the k-th last, normalized."""

    def __init__(self, decay=0.99):
        self.decay, self.total, self.weight = decay, 0.0, 0.0

    def __call__(self, value):
        self.total = self.total * self.decay + value
        self.weight = self.weight * self.decay + 1
        return self.value

    @property
    def value(self):
        return self.total / self.weight


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


def write_samples(model, enc, config, run_dir, step):
    """`--sample_num` samples of `--sample_length` tokens from <|endoftext|>, written to
    samples-<step>.txt; returns their text. As the forks: top-p where --top_p > 0, else top-k.
    The samples of a step are batch number `step` of the run's (`seeds.seed_of`)."""
    nucleus = config.top_p > 0
    rows = generate(model, [[enc.eot_token]] * config.sample_num, config.sample_length,
                    top_k=0 if nucleus else config.top_k, top_p=config.top_p if nucleus else 1.0,
                    seed=seed_of(config.seed, step * config.sample_num))
    text = "".join("=" * 20 + f" SAMPLE {i} " + "=" * 20 + "\n" + enc.decode(row[1:]) + "\n"
                   for i, row in enumerate(rows))
    write_text(os.path.join(run_dir, f"samples-{step}.txt"), text)
    return text


def current_lr(optimizer):
    return float(tf.convert_to_tensor(optimizer.learning_rate))  # the schedule's value where there is one


_SCALAR = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
"""TensorBoard's scalar plugin, as `tf.summary.scalar` marks its values (that needs tensorboard)."""
