"""Model folders as users name them: a folder, or a model name in a models folder (`--model_dir`,
or `--model_name` in `--models_dir`, as every command and `finetune` take them); what to say
when one is missing; the vocabulary a folder gives (`encoder.vocabulary_files`' rule: both
files, or neither for the shipped copy); and its hparams.json written."""
import os

from ..encoder import ASSETS_DIR, get_encoder, vocabulary_files
from ..hparams import PUBLISHED, published_name
from .files import write_text


def model_path(model_name, models_dir="models"):
    """`<models_dir>/<model_name>` (~ and $VARS expanded), whether or not it exists."""
    return os.path.join(_expand(models_dir), model_name)


def model_folder(model_name="124M", models_dir="models", model_dir=None):
    """The model folder `model_dir` names, else `model_name` in `models_dir`; FileNotFoundError
    says how to get a published one that is missing."""
    return find_model_dir(_expand(model_dir) if model_dir else model_path(model_name, models_dir))


def find_model_dir(model, models_dir="models"):
    """`model` if it is a folder, else the folder `<models_dir>/<model>` (a model name); where
    neither is, the same for the published size that the name's last part is Hugging Face's
    name of (models/gpt2 -> models/124M)."""
    folder, name = os.path.split(os.path.normpath(model))
    alias = os.path.join(folder, published_name(name))
    for path in (model, os.path.join(models_dir, model), alias, os.path.join(models_dir, alias)):
        if os.path.isdir(path):
            return path
    raise FileNotFoundError(missing_model(model, models_dir))


def missing_model(model, models_dir="models"):
    """What to say of a model folder that does not exist (`model` a name in `models_dir`, or a
    path): how to download a published one, and how to do without a network."""
    given = os.path.basename(os.path.normpath(model))
    name = published_name(given)
    if model != given:
        models_dir = os.path.dirname(os.path.normpath(model)) or "."
    where = os.path.join(models_dir, name)
    if name not in PUBLISHED:
        return f"{where}: no such model folder (the published models are {', '.join(PUBLISHED)})"
    return (f"{where}: no such model folder; download it with `tfgpt2 download {name}{_option(models_dir)}` "
            f"({offline(name, models_dir)})")


def offline(name, models_dir="models"):
    """The way to published model `name` without a network: random weights in its layout."""
    return f"offline, `tfgpt2 make-checkpoint {name}{_option(models_dir)}` writes random weights in the same layout"


def _option(models_dir):
    return "" if os.path.normpath(models_dir) == "models" else f" --models_dir {models_dir}"


def encoder_of(folder):
    """The encoder of a folder's encoder.json and vocab.bpe (the shipped copy where it has neither)."""
    folder = os.path.normpath(folder)
    return get_encoder(os.path.basename(folder), os.path.dirname(folder))


def vocabulary_source(*folders):
    """The first of `folders` that holds a vocabulary, else the shipped copy's folder; a folder
    with only one of the two files is an error (`encoder.vocabulary_files`)."""
    return next((folder for folder in folders if vocabulary_files(folder)), ASSETS_DIR)


def save_hparams(hparams, model_dir):
    """Write `hparams.json` as OpenAI's folders have it."""
    write_text(os.path.join(model_dir, "hparams.json"), hparams.to_json())


def _expand(path):
    return os.path.expanduser(os.path.expandvars(path))
