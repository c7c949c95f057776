"""The run folder `checkpoint/<run_name>/`, gpt-2-simple's: `model-<step>.*` in OpenAI's
variable layout (OpenAI's code and `tfgpt2.load_model` restore it), `checkpoint`, `counter`,
`hparams.json`, `encoder.json`, `vocab.bpe`, TensorBoard events; and `optimizer-<step>.*`
beside the latest model, `best.json` where validation runs, `samples-<step>.txt`. With LoRA
(`--lora_rank`), `model-<step>` holds the merged weights and `lora-<step>.*` the adapters
(`formats.lora`), from which, with the base, a run continues; `base_model.json` names the
model folder the run started from. A run holds `.lock` while it writes the folder and removes
it at its end."""
import contextlib
import glob
import json
import os
import socket

import tensorflow as tf

from ..adapters.lora import LORA_TARGETS
from ..encoder import VOCAB_FILES
from ..formats.checkpoint import checkpoint_prefix, save_tensors
from ..formats.files import copy_file, hold, release, write_text
from ..formats.folders import model_folder, save_hparams
from ..formats.lora import adapter_tensors, merged_weights, read_config
from ..hparams import load_hparams, read_json_object

BASE = "base_model.json"  # {"model_dir": the folder a run started from}


def _step_of(prefix):
    """The step in a `model-<step>` prefix, else the `counter` beside it (gpt-2-simple's), else 0."""
    tail = os.path.basename(prefix).rsplit("-", 1)[-1]
    if tail.isdigit():
        return int(tail)
    counter = os.path.join(os.path.dirname(prefix), "counter")
    return int(open(counter).read().strip() or 0) if os.path.isfile(counter) else 0


def refuse_run_folder(path):
    """FileExistsError where `path` is a run folder (it has a `counter`): a command writing
    weights there would change what its next run resumes from."""
    if os.path.isfile(os.path.join(path, "counter")):
        raise FileExistsError(f"{path} is a training run folder (it has a counter file); writing into it would "
                              "change the checkpoint its next `tfgpt2 train` resumes from: choose another folder")


@contextlib.contextmanager
def locked(run_dir):
    """Hold the run folder's `.lock` while a run writes it (`formats.files.hold`): another
    process is refused, naming the one that holds it. The lock of a run that died ends with its
    process and is taken over by the next; a run that ends removes it, and a folder made for a
    run that wrote nothing is removed too."""
    made = []  # the folders made here, innermost first
    folder = os.path.abspath(run_dir)
    while not os.path.isdir(folder):
        made, folder = made + [folder], os.path.dirname(folder)
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, ".lock")
    fd = hold(path)
    if fd is None:
        with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as f:
            holder = f.read(200).strip()
        raise BlockingIOError(f"{run_dir} is in use by another training run ({holder or 'another process'}, "
                              f"which holds {path}): wait for it to end, or choose another --run_name")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        release(path, fd)
        if made and not os.listdir(run_dir):
            for folder in made:
                with contextlib.suppress(OSError):
                    os.rmdir(folder)


def checkpoint_steps(run_dir):
    """Steps of the model-<step> checkpoints the run folder's `checkpoint` file names."""
    state = tf.train.get_checkpoint_state(run_dir)
    paths = state.all_model_checkpoint_paths if state else []
    return [_step_of(p) for p in paths]


def save_run(run_dir, model, optimizer, step, *, max_checkpoints=1, keep=(), lora_base=None):
    """Save step `step`: optimizer state, the LoRA adapters (recording `lora_base`, the
    checkpoint they train on) where the model has them, then the weights (merged), then the
    `checkpoint` file that names them (so an interrupt never leaves a half-written checkpoint
    named there) and `counter`. Older checkpoints beyond `max_checkpoints` go, with their
    adapters, except the steps in `keep`; optimizer state is kept for the latest only. Weights
    that are not finite are refused (ValueError) before anything is written or removed."""
    weights = merged_weights(model)
    bad = [name for name, value in weights.items() if not bool(tf.reduce_all(tf.math.is_finite(value)))]
    if bad:
        raise ValueError(f"{run_dir}: step {step}'s weights are not finite ({bad[0]} holds NaN or inf): not saved, "
                         f"the run folder is as it was ({latest_of(run_dir)})")
    save_tensors(run_dir, f"optimizer-{step}",
                 {f"optimizer/{i}": v for i, v in enumerate(optimizer_state(optimizer))})
    if model.lora_targets:
        save_tensors(run_dir, f"lora-{step}", adapter_tensors(model, lora_base))
    save_tensors(run_dir, f"model-{step}", weights)
    steps = sorted(set(checkpoint_steps(run_dir)) - {step}) + [step]
    kept = [s for i, s in enumerate(steps) if i >= len(steps) - max_checkpoints or s in keep]
    lines = [f'model_checkpoint_path: "model-{step}"']
    lines += [f'all_model_checkpoint_paths: "model-{s}"' for s in kept]
    write_text(os.path.join(run_dir, "checkpoint"), "\n".join(lines) + "\n")
    write_text(os.path.join(run_dir, "counter"), f"{step}\n")
    for path in [p for kind in ("model", "optimizer", "lora") for p in glob.glob(os.path.join(run_dir, f"{kind}-*.*"))]:
        kind, s = os.path.basename(path).split(".")[0].split("-")
        if int(s) not in kept or (kind == "optimizer" and int(s) != step):
            os.remove(path)


def latest_of(run_dir):
    """The run folder's latest checkpoint, as a message says it (a new run has none yet)."""
    latest = tf.train.latest_checkpoint(run_dir)
    return f"its latest checkpoint: {latest}" if latest else "it holds no checkpoint yet"


def optimizer_state(optimizer):
    """The optimizer's variables but its learning rate, which comes from the config."""
    return [v for v in optimizer.variables if v.name != "learning_rate"]


def restore_optimizer(optimizer, run_dir, step):
    """Optimizer state from `optimizer-<step>` beside the weights; False where there is none."""
    prefix = os.path.join(run_dir, f"optimizer-{step}")
    if not os.path.isfile(prefix + ".index"):
        return False
    reader = tf.train.load_checkpoint(prefix)
    shapes = reader.get_variable_to_shape_map()
    state = optimizer_state(optimizer)
    if len(shapes) != len(state):
        raise ValueError(f"{prefix}: holds {len(shapes)} optimizer variables, this optimizer has "
                         f"{len(state)} (another --optimizer or --only_train_transformer_layers?)")
    for i, variable in enumerate(state):
        value = reader.get_tensor(f"optimizer/{i}")
        if list(value.shape) != list(variable.shape):
            raise ValueError(f"{prefix}: optimizer/{i} ({variable.path}) has shape {list(value.shape)}, "
                             f"expected {list(variable.shape)}")
        variable.assign(value)
    return True


def find_start(config):
    """Where the run starts: (run folder, folder of the weights, checkpoint prefix or None,
    step, hparams, LoRA adapters to load or None), from the run folder (--restore_from latest;
    with LoRA, its adapters on their base), the base model (fresh, or latest in a new run) or
    a path; a run folder with checkpoints continues only from them. Checks only; nothing is
    loaded or written."""
    run_dir = config.run_dir
    has_checkpoint = os.path.isfile(os.path.join(run_dir, "checkpoint"))
    adapters = None
    if config.restore_from == "latest" and has_checkpoint:
        check_base(run_dir, config)
        source, prefix = run_dir, checkpoint_prefix(run_dir)
        step = _step_of(prefix)
        adapters = lora_start(run_dir, step, config)
        if adapters:
            prefix = read_config(adapters)["base"]
            source = os.path.dirname(prefix)
    elif has_checkpoint:  # fresh, or a path: the run would start over and rotate its checkpoints away
        raise ValueError(f"{run_dir} already holds checkpoints (the latest: "
                         f"{tf.train.latest_checkpoint(run_dir)}); continue it with --restore_from latest, "
                         "or choose another --run_name")
    elif config.restore_from in ("latest", "fresh"):
        source, prefix, step = model_folder(config.base_model, config.models_dir), None, 0
    else:
        if not os.path.isdir(config.restore_from) and not os.path.isfile(config.restore_from + ".index"):
            raise FileNotFoundError(f"--restore_from {config.restore_from}: no such folder or checkpoint prefix")
        source = config.restore_from if os.path.isdir(config.restore_from) else os.path.dirname(config.restore_from)
        prefix, step = checkpoint_prefix(config.restore_from), 0
    hparams = load_hparams(source)
    if os.path.isfile(os.path.join(run_dir, "hparams.json")) and load_hparams(run_dir) != hparams:
        raise ValueError(f"{run_dir}/hparams.json is {load_hparams(run_dir).values()}, but the model to "
                         f"start from ({source}) has {hparams.values()}")
    if 0 <= config.steps < step:
        raise ValueError(f"{run_dir} is at step {step}, past --steps {config.steps}: --steps is the run's "
                         f"total, not a number of steps more (for N more: --steps {step} + N)")
    return run_dir, source, prefix, step, hparams, adapters


def lora_start(run_dir, step, config):
    """`lora-<step>` to continue a LoRA run from, checked against the --lora_* flags and for its
    base; None for a run without LoRA."""
    prefix = os.path.join(run_dir, f"lora-{step}")
    if os.path.isfile(prefix + ".index") != bool(config.lora_rank):
        raise ValueError(f"{run_dir}: model-{step} was trained with LoRA ({prefix}); continue it with its --lora_rank"
                         if config.lora_rank is None else
                         f"{run_dir}: model-{step} was trained without LoRA (no {prefix}.index); continue it "
                         f"without --lora_rank, or start LoRA from it with --restore_from {run_dir} and another "
                         "--run_name")
    if config.lora_rank is None:
        return None
    stored = read_config(prefix)
    given = {"rank": config.lora_rank, "alpha": float(config.lora_alpha or config.lora_rank),
             "targets": list(config.lora_targets or LORA_TARGETS)}
    differ = [f"--lora_{name} {given[name]} (it has {stored[name]})" for name in given if given[name] != stored[name]]
    if differ:
        raise ValueError(f"{prefix}: the run's adapters differ from the flags: " + ", ".join(differ))
    if not os.path.isfile(f"{stored['base']}.index"):
        raise FileNotFoundError(f"{prefix}: the base checkpoint the adapters were trained on, {stored['base']}, "
                                "is not there")
    return prefix


def check_base(run_dir, config):
    """A run continues from its own checkpoint: a --model_name given must be the model it started
    from (the folder `base_model.json` names, else one of the run's hparams), or ValueError naming
    both."""
    if config.model_name is None:
        return
    given = model_folder(config.model_name, config.models_dir)
    record = os.path.join(run_dir, BASE)
    if os.path.isfile(record):
        started = read_json_object(record).get("model_dir", "?")
        same = os.path.realpath(started) == os.path.realpath(given)
    else:  # a run folder of gpt-2-simple or the forks: its hparams are all there is to compare
        started = f"a model of hparams {load_hparams(run_dir).values()}"
        same = load_hparams(given) == load_hparams(run_dir)
    if not same:
        raise ValueError(f"{run_dir} was started from {started}, not from --model_name {config.model_name} ({given}); "
                         f"leave --model_name out to continue it, or start another --run_name from {given}")


def write_run_files(run_dir, hparams, vocab_dir, base=None):
    """hparams.json, encoder.json and vocab.bpe from `vocab_dir`, and for a run that starts from
    the model folder `base`, base_model.json naming it."""
    os.makedirs(run_dir, exist_ok=True)
    save_hparams(hparams, run_dir)
    if base:
        write_text(os.path.join(run_dir, BASE), json.dumps({"model_dir": os.path.abspath(base)}) + "\n")
    for name in VOCAB_FILES:
        src, dst = os.path.join(vocab_dir, name), os.path.join(run_dir, name)
        if not os.path.isfile(dst):
            copy_file(src, dst)


def read_best(run_dir):
    """`best.json`: the step and validation loss of the best checkpoint so far, or None."""
    path = os.path.join(run_dir, "best.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
