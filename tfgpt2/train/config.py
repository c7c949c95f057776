"""A fine-tuning run's settings: `tfgpt2 train`'s flags (the forks' `train.py` flags, and more)
as one typed value, `TrainConfig`, made once from the flags (`cli/train.py` builds them from
the fields below) or from `tfgpt2.finetune`'s keywords, and passed to the loop. Each
setting's type, default, range and help are written here, once; a value out of range is a
ValueError naming its flag."""
import dataclasses
import difflib
import math
import os

from ..adapters.lora import LORA_TARGETS
from ..ranges import Range
from ..seeds import SEEDS
from .data import check_encoding
from .distribute import STRATEGIES
from .optimizers import OPTIMIZERS


def _setting(default, help, kind, **rule):
    return dataclasses.field(default=default, metadata=dict(help=help, kind=kind, **rule))


def integer(default, help=None, *, low=None, high=None):
    return _setting(default, help, int, low=low, high=high)


def number(default, help=None, *, low, high=None):
    return _setting(default, help, float, low=low, high=high)


def text(default, help=None, *, choices=None, check=None):
    return _setting(default, help, str, choices=choices, check=check)


def switch(help, *, aliases=()):
    return _setting(False, help, bool, aliases=aliases)


def names(help, *, metavar):
    return _setting(None, help, list, metavar=metavar)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The settings of one run, checked when made; `dataclasses.replace` makes a changed copy."""
    dataset: str = text(dataclasses.MISSING, "a text file, a folder, a glob, or an .npz of encoded chunks")
    model_name: str | None = text(None, "the model to start from: <models_dir>/<model_name> (default 124M; a run "
                                        "continues from its own checkpoint, and a --model_name given must be the "
                                        "one it started from)")
    models_dir: str = text("models")
    combine: int = integer(50000, "join text files with <|endoftext|> until at least this many characters "
                                  "per chunk", low=1)
    encoding: str = text("utf-8", "the text files' encoding", check=check_encoding)
    batch_size: int = integer(1, "windows per micro-batch in all, split over the replicas of --strategy", low=1)
    strategy: str = text("auto", "auto: several GPUs -> mirrored, TF_CONFIG -> multiworker, else one "
                                 "(see tfgpt2/train/distribute.py)", choices=STRATEGIES)
    tpu: str | None = text(None, "with --strategy tpu: the TPU's name or grpc:// address (empty on a TPU VM)")
    learning_rate: float = number(2e-5, low=0)
    optimizer: str = text("adam", choices=OPTIMIZERS)
    accumulate_gradients: int = integer(1, "micro-batches per update, their gradients averaged", low=1)
    only_train_transformer_layers: bool = switch("train the blocks only (not wte, wpe, ln_f)")
    steps: int = integer(-1, "stop when the run has made this many updates in all (-1: never); rerun the "
                             "same command with --restore_from latest to continue an interrupted run exactly",
                         low=-1)
    run_name: str = text("run1")
    checkpoint_dir: str = text("checkpoint")
    restore_from: str = text("latest", "latest (the run folder's latest checkpoint, else the base model), fresh "
                                       "(the base model), or a model folder / checkpoint prefix (its weights, "
                                       "from step 0)")
    save_every: int = integer(1000, low=0)
    max_checkpoints: int = integer(1, low=1)
    sample_every: int = integer(100, low=0)
    sample_length: int | None = integer(None, "tokens per sample, and the tokens a training window predicts (a window "
                                       "is sample_length + 1 tokens); default n_ctx - 1 (1023), the forks'",
                                 low=1)
    sample_num: int = integer(1, low=1)
    top_k: int = integer(40, low=0)
    top_p: float = number(0.0, "the samples' nucleus sampling, the forks': used where > 0 (then not --top_k)",
                          low=0, high=1)
    noise: float = number(0.0, "the forks' --noise: each input token of a training window is replaced by a "
                               "random one with this probability (the labels are not), against typos", low=0, high=1)
    max_bad_steps: int = integer(0, "updates whose loss or gradients are not finite (NaN, inf) to skip before the "
                                    "run stops with an error (default 0: at the first); weights that are not "
                                    "finite are never saved", low=0)
    val_dataset: str | None = text(None, "validation data; without it, the last --val_fraction of --dataset is "
                                         "held out")
    val_fraction: float = number(0.1, low=0, high=1)
    val_every: int = integer(0, low=0)
    val_batch_size: int = integer(2, low=1)
    val_batch_count: int = integer(40, low=1)
    print_every: int = integer(1, "a line every this many steps where stderr is not a terminal (a terminal has "
                                  "a bar); 0: none", low=0)
    quiet: bool = switch("no bar or per-step lines, samples or checkpoint messages: warnings, errors and the "
                         "final line only")
    no_xla: bool = switch("run the step without XLA (compiles faster; on a CPU, 16-bit products: see --precision)")
    seed: int = integer(0, "draws the windows (and samples: `tfgpt2.seeds`)", low=SEEDS.low, high=SEEDS.high)
    lr_schedule: str = text("constant", "cosine: down to a tenth of --learning_rate at --steps",
                            choices=("constant", "cosine"))
    warmup_steps: int = integer(0, low=0)
    clip_norm: float = number(0.0, "clip gradients to this global norm (0: off)", low=0)
    weight_decay: float = number(0.0, "decoupled weight decay (AdamW's), not of biases or norm gains; with "
                                      "--optimizer adamw, 0 means Keras' default, 0.004", low=0)
    precision: str = text("float32", "mixed_*: float32 weights, matmuls in 16 bits (float16 with dynamic loss "
                                     "scaling); on a CPU only with --no_xla (XLA's CPU dots are float32), faster "
                                     "where oneDNN's bfloat16 kernels are",
                          choices=("float32", "mixed_bfloat16", "mixed_float16"))
    tf32: bool = switch("let float32 products use TensorFloat-32 on the GPUs that have it (NVIDIA Ampere on): "
                        "faster, further from float32 (docs/precision.md)")
    remat: bool = switch("recompute each block in the backward pass: less memory, more time",
                         aliases=("memory_saving_gradients", "use_memory_saving_gradients"))
    lora_rank: int | None = integer(None, "train LoRA adapters of this rank only (every other weight frozen); "
                                   "model-<step> holds the merged weights, lora-<step> the adapters", low=1)
    lora_alpha: float | None = number(None, "the adapters' scale is lora_alpha / lora_rank (default lora_rank: a scale "
                                     "of 1, as Keras')", low=0)
    lora_targets: tuple | None = names(f"the Conv1D layers to adapt in every block (default {' '.join(LORA_TARGETS)}): "
                                "c_attn, c_proj, c_fc, attn/c_proj, mlp/c_proj", metavar="NAME")

    def __post_init__(self):
        for field in dataclasses.fields(self):
            object.__setattr__(self, field.name, _checked(field, getattr(self, field.name)))
        if self.lr_schedule == "cosine" and self.steps < 1:
            raise ValueError("--lr_schedule cosine needs --steps")
        if (self.lora_alpha is not None or self.lora_targets) and not self.lora_rank:
            raise ValueError("--lora_alpha and --lora_targets need --lora_rank")

    @classmethod
    def of(cls, **settings):
        """The config of these settings (each a flag's name, or the forks' and gpt-2-simple's
        name of it: memory_saving_gradients); an unknown one is a ValueError."""
        known = [field.name for field in dataclasses.fields(cls)]
        aliases = {alias: field.name for field in dataclasses.fields(cls) for alias in field.metadata.get("aliases", ())}
        for name in settings:
            if name not in known and name not in aliases:
                close = difflib.get_close_matches(name, known, 1)
                raise ValueError(f"unknown setting {name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return cls(**{aliases.get(name, name): value for name, value in settings.items()})

    @property
    def base_model(self):
        """The model a new run starts from: --model_name, by default 124M."""
        return self.model_name or "124M"

    @property
    def run_dir(self):
        """The run folder, <checkpoint_dir>/<run_name>."""
        return os.path.join(self.checkpoint_dir, self.run_name)

    def window(self, n_ctx):
        """The tokens a training window predicts, --sample_length (by default n_ctx - 1), which
        must fit the model's context n_ctx."""
        length = self.sample_length or n_ctx - 1
        if length > n_ctx:
            raise ValueError(f"--sample_length {length} exceeds the model's context n_ctx={n_ctx}")
        return length


def _checked(field, value):
    """`value` as the setting `field` holds it (a number from its text, a path as a string, one
    name as a tuple of one), or ValueError naming the flag."""
    rule, flag = field.metadata, f"--{field.name}"
    if value is None and rule["kind"] is bool:
        return False  # finetune(remat=None): not given
    if value is None and field.default is None:
        return None
    if rule["kind"] is bool and isinstance(value, bool):
        return value
    if rule["kind"] is str and isinstance(value, (str, os.PathLike)):
        value = os.fspath(value)
        if rule["choices"] and value not in rule["choices"]:
            raise ValueError(f"{flag} must be one of {', '.join(rule['choices'])}, got {value!r}")
        try:
            return rule["check"](value) if rule["check"] else value
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
    if rule["kind"] is list:
        values = (value,) if isinstance(value, str) else value
        if isinstance(values, (list, tuple)) and values and all(isinstance(v, str) for v in values):
            return tuple(values)
        raise ValueError(f"{flag} must be one or more names, got {value!r}")
    if rule["kind"] in (int, float):
        return _in_range(flag, value, rule)
    what = {bool: "True or False", str: "a string"}[rule["kind"]]
    raise ValueError(f"{flag} must be {what}, got {value!r}")


def _in_range(flag, value, rule):
    """A number of the rule's kind (from a number or its text) within its range (the one range
    rule, `ranges.Range`; finite), or ValueError naming the flag."""
    kind, low, high = rule["kind"], rule["low"], rule["high"]
    bounded = kind is int or high is not None
    value_range = Range(kind, -math.inf if low is None else low, math.inf if high is None else high,
                        "[]" if bounded else "[)")
    return value_range.check(value, flag, text=True)
