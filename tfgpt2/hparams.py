"""Hyperparameters: the original's `default_hparams()` and `hparams.json` (read here; its text
given to `formats.folders`, which writes it), with checks, and the published sizes."""
import dataclasses
import json
import os

FIELDS = ("n_vocab", "n_ctx", "n_embd", "n_head", "n_layer")


@dataclasses.dataclass
class HParams:
    n_vocab: int = 0
    n_ctx: int = 1024
    n_embd: int = 768
    n_head: int = 12
    n_layer: int = 12

    def override_from_dict(self, values):
        """Set fields from a dict, as `tf.contrib.training.HParams` does; unknown keys are an error."""
        unknown = sorted(set(values) - set(FIELDS))
        if unknown:
            raise ValueError(f"unknown hparams {unknown}; expected keys among {list(FIELDS)}")
        for key, value in values.items():
            setattr(self, key, value)
        return self.validate()

    def validate(self):
        for key in FIELDS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"hparams.{key} must be an integer, got {value!r}")
            minimum = 0 if key == "n_vocab" else 1
            if value < minimum:
                raise ValueError(f"hparams.{key} must be >= {minimum}, got {value}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"hparams.n_embd ({self.n_embd}) must be divisible by hparams.n_head ({self.n_head})")
        return self

    def values(self):
        return dataclasses.asdict(self)

    def to_json(self):
        """The text of `hparams.json`, as OpenAI's folders have it."""
        return json.dumps(self.values(), indent=2)


def default_hparams():
    """The 124M model's shape with n_vocab 0, as in the original; `hparams.json` fills it in."""
    return HParams()


# The four published sizes, as in their hparams.json files.
PUBLISHED = {
    "124M": dict(n_vocab=50257, n_ctx=1024, n_embd=768, n_head=12, n_layer=12),
    "355M": dict(n_vocab=50257, n_ctx=1024, n_embd=1024, n_head=16, n_layer=24),
    "774M": dict(n_vocab=50257, n_ctx=1024, n_embd=1280, n_head=20, n_layer=36),
    "1558M": dict(n_vocab=50257, n_ctx=1024, n_embd=1600, n_head=25, n_layer=48),
}


# Hugging Face's names of the four sizes, taken wherever a model name is.
ALIASES = {"gpt2": "124M", "gpt2-medium": "355M", "gpt2-large": "774M", "gpt2-xl": "1558M"}


def published_name(model_name):
    """The published size an alias names ("gpt2-medium" -> "355M"); any other name as it is."""
    return ALIASES.get(model_name, model_name)


def as_hparams(value):
    """`value` itself if HParams, else HParams from its dict (as a Keras config holds them)."""
    return value if isinstance(value, HParams) else default_hparams().override_from_dict(value)


def published_hparams(model_name):
    model_name = published_name(model_name)
    if model_name not in PUBLISHED:
        raise ValueError(f"unknown model name {model_name!r}; the published sizes are {list(PUBLISHED)}")
    return default_hparams().override_from_dict(PUBLISHED[model_name])


def read_json_object(path, error=ValueError):
    """The JSON object in `path`; invalid JSON or another JSON value raises `error` naming the file."""
    try:
        with open(path) as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def load_hparams(model_dir):
    """Read `<model_dir>/hparams.json`, which must set all five fields, as OpenAI's do: a
    missing one is an error, not the 124M default (the original would fill it in)."""
    path = os.path.join(model_dir, "hparams.json")
    if not os.path.isfile(path):
        if os.path.isfile(os.path.join(model_dir, "config.json")):
            raise FileNotFoundError(f"{path}: no such file; {model_dir} looks like a Hugging Face folder "
                                    f"(config.json): convert it with `tfgpt2 convert --from hf --to openai {model_dir} "
                                    f"DST` (in Python: tfgpt2.formats.hf_kerashub.load({model_dir!r}, 'hf'))")
        raise FileNotFoundError(f"{path}: no such file (is {model_dir!r} a GPT-2 model folder?)")
    values = read_json_object(path)
    missing = [key for key in FIELDS if key not in values]
    if missing:
        unknown = sorted(set(values) - set(FIELDS))
        raise ValueError(f"{path}: missing {', '.join(missing)}" + (f" (but unknown {unknown})" if unknown else "")
                         + f"; a GPT-2 hparams.json sets all of {', '.join(FIELDS)}")
    try:
        return default_hparams().override_from_dict(values)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
