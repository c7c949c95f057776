"""Apache Beam RunInference model handlers for bulk generation: requests continued by a model
folder (`GPT2ModelHandler`) or by the SavedModel of `tfgpt2 export` (`GPT2SavedModelHandler`).

A request is one prompt of a plan (`bulk.beam.requests`), a dict: "line" (its line number),
"prompt" (its text), "tokens" (its ids), "batch" (its batch of the plan), "row" (its place in
the batch), "rows" (the batch's size: the rows past its prompts are copies of its first, so
that a length bucket compiles once), "seed" (the batch's) and "options" (the line's own
generation keywords, as `tfgpt2.generate` takes them, logit_bias with its ids as text). A
handler groups the requests it is given by batch and yields one row per request: {"line",
"prompt", "text", "tokens"}. A batch given whole, or split over several calls, gives the same
rows: a row depends on its prompt, its place and its batch's seed only.

Each request's keywords are the handler's (`keywords`: the command's flags, as
`tfgpt2.generate` takes them), then the line's options over them.

This module imports nothing of tfgpt2 where it is loaded: `bulk.beam` sends it to the
workers by value, so that the SavedModel's workers need TensorFlow, tiktoken and Apache Beam
alone; the model folder's handler imports tfgpt2 when it loads the model. A model on a remote
filesystem (gs://, s3://, hdfs://) is copied to a local folder once per worker.
"""
import os
import tempfile

import numpy as np
from apache_beam.io.filesystems import FileSystems
from apache_beam.ml.inference.base import ModelHandler


def is_local(path):
    """Whether `path` is on this machine's filesystem (no scheme, or file://)."""
    return FileSystems.get_scheme(path) in (None, "file")


def local_copy(path, names=None):
    """`path` where it is a local folder, else a local copy of its files (of those of `names`,
    paths inside it, that it has, where given) in a new temporary folder."""
    if is_local(path):
        return path
    root = path.rstrip("/")
    patterns = [f"{root}/{name}" for name in names] if names is not None else [root + "/**"]
    folder = tempfile.mkdtemp(prefix="tfgpt2-model-")
    for found in FileSystems.match(patterns):
        for file in found.metadata_list:
            target = os.path.join(folder, file.path[len(root) + 1:])
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with FileSystems.open(file.path, compression_type="uncompressed") as src, open(target, "wb") as dst:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
    return folder


def batches(requests):
    """(the requests of one batch, the batch's prompts) for each batch that `requests` holds
    some of: each request's tokens at its row, the other rows copies of the first given."""
    groups = {}
    for request in requests:
        groups.setdefault(request["batch"], []).append(request)
    for group in groups.values():
        prompts = [group[0]["tokens"]] * group[0]["rows"]
        for request in group:
            prompts[request["row"]] = request["tokens"]
        yield group, prompts


def keywords_of(keywords, request):
    """The generation keywords of a request: the handler's, its batch's seed, its line's own."""
    options = dict(request["options"])
    if "logit_bias" in options:
        options["logit_bias"] = {int(token): value for token, value in options["logit_bias"].items()}
    return {**keywords, "seed": request["seed"], **options}


class _Handler(ModelHandler):
    """What both handlers share: the settings, Beam's batching (at most one batch of the plan
    at a time), and inference by the loaded model's `rows`, which Beam can call through a
    proxy where the model is shared by a machine's processes (`large_model`)."""

    def __init__(self, path, keywords, *, length, batch_size, large_model=False):
        super().__init__(max_batch_size=batch_size, large_model=large_model)
        self._path, self._keywords, self._length = path, dict(keywords), length

    def run_inference(self, batch, model, inference_args=None):
        return model.rows(batch)

    def get_metrics_namespace(self):
        return "tfgpt2"


class GPT2ModelHandler(_Handler):
    """RunInference over a model folder (local, or on any filesystem Beam reads), loaded once
    per worker process with `tfgpt2.load_model` (`dtype`: the Keras dtype policy; `tf32`: as
    `GPT2`'s) and run by `tfgpt2.generate`. Workers need tfgpt2 installed."""

    def __init__(self, model_dir, keywords, *, length, batch_size, dtype="float32", tf32=False, large_model=False):
        super().__init__(model_dir, keywords, length=length, batch_size=batch_size, large_model=large_model)
        self._dtype, self._tf32 = dtype, tf32

    def load_model(self):
        return FolderModel(local_copy(self._path), self._keywords, self._length, self._dtype, self._tf32)


class FolderModel:
    """A model folder's model and vocabulary, loaded, and how it generates rows."""

    def __init__(self, folder, keywords, length, dtype, tf32=False):
        from ..formats.checkpoint import load_model
        from ..formats.folders import encoder_of
        self.model, self.enc = load_model(folder, dtype=dtype, tf32=tf32), encoder_of(folder)
        self.keywords, self.length = keywords, length

    def rows(self, requests):
        from ..decoding.request import check_request
        from ..decoding.batch import complete
        hp = self.model.hparams
        for group, prompts in batches(requests):
            request = check_request(n_vocab=hp.n_vocab, n_ctx=hp.n_ctx, length=self.length,
                                    **keywords_of(self.keywords, group[0]))
            out = complete(self.model, prompts, request, encoder=self.enc)
            for request in group:
                row = out[request["row"]]
                yield dict(line=request["line"], prompt=request["prompt"], text=row.text,
                           tokens=row.new_tokens.tolist())


class GPT2SavedModelHandler(_Handler):
    """RunInference over a SavedModel of `tfgpt2 export` (the version folder, local or on any
    filesystem Beam reads), loaded once per worker process with `tf.saved_model.load` and run
    by its `generate_text` signature, which checks every value as `tfgpt2.generate` does and
    gives the text as every door does. `encoding`: the tiktoken Encoding of the vocabulary;
    `n_vocab`, `eot`: the model's. Workers need TensorFlow, tiktoken and Apache Beam, not
    tfgpt2; a keyword context_keep is refused (the SavedModel does not slide)."""

    def __init__(self, saved_model, encoding, keywords, *, length, batch_size, n_vocab, eot=50256,
                 large_model=False):
        if keywords.get("context_keep") is not None:
            raise ValueError("a SavedModel generates within its context window: context_keep is not available")
        super().__init__(saved_model, keywords, length=length, batch_size=batch_size, large_model=large_model)
        self._encoding, self._n_vocab, self._eot = encoding, n_vocab, eot

    def load_model(self):
        return SignatureModel(local_copy(self._path), self._encoding, self._keywords, self._length, self._n_vocab,
                              self._eot)


class SignatureModel:
    """A SavedModel's `generate_with_controls` signature, loaded, and how it generates rows."""

    def __init__(self, folder, encoding, keywords, length, n_vocab, eot):
        import tensorflow as tf
        self.loaded = tf.saved_model.load(folder)  # kept: the signature holds its variables weakly
        self.generate = self.loaded.signatures["generate_text"]
        self.encoding, self.keywords, self.length, self.n_vocab, self.eot = encoding, keywords, length, n_vocab, eot

    def rows(self, requests):
        for group, prompts in batches(requests):
            keywords = keywords_of(self.keywords, group[0])
            out = self.generate(**self.inputs(prompts, keywords))
            output_ids, lengths, texts = out["output_ids"].numpy(), out["lengths"].numpy(), out["text"].numpy()
            width = max(len(p) for p in prompts)
            for request in group:
                ids = output_ids[request["row"], width:width + lengths[request["row"]]].tolist()
                yield dict(line=request["line"], prompt=request["prompt"], tokens=ids,
                           text=texts[request["row"]].decode("utf-8", errors="replace"))

    def inputs(self, prompts, keywords):
        """The signature's inputs for the prompts (left-padded, with their mask) and keywords."""
        import tensorflow as tf
        width = max(len(p) for p in prompts)
        ids, mask = np.zeros([len(prompts), width], np.int32), np.zeros([len(prompts), width], np.int32)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
        bias = np.zeros([self.n_vocab], np.float32)
        for token, value in (keywords.get("logit_bias") or {}).items():
            bias[token] = value
        sequences = [[s] if isinstance(s, int) else s for s in keywords.get("stop_token_ids") or []]
        stop = np.full([len(sequences), max(map(len, sequences), default=1)], -1, np.int32)
        for row, sequence in enumerate(sequences):
            stop[row, :len(sequence)] = sequence
        texts = keywords.get("stop") or []
        texts = [texts] if isinstance(texts, str) else list(texts)
        scalars = dict(max_new_tokens=(self.length, tf.int32), temperature=(keywords["temperature"], tf.float32),
                       top_k=(keywords["top_k"], tf.int32), top_p=(keywords["top_p"], tf.float32),
                       seed=(keywords["seed"], tf.int64),
                       repetition_penalty=(keywords.get("repetition_penalty", 1.0), tf.float32),
                       presence_penalty=(keywords.get("presence_penalty", 0.0), tf.float32),
                       frequency_penalty=(keywords.get("frequency_penalty", 0.0), tf.float32),
                       min_p=(keywords.get("min_p", 0.0), tf.float32),
                       min_tokens=(keywords.get("min_tokens", 0), tf.int32),
                       stop_at_eot=(keywords.get("stop_at_eot", False), tf.bool),
                       include_stop_str_in_output=(keywords.get("include_stop_str_in_output", False), tf.bool))
        return dict({name: tf.constant(value, dtype) for name, (value, dtype) in scalars.items()},
                    input_ids=tf.constant(ids), attention_mask=tf.constant(mask), logit_bias=tf.constant(bias),
                    stop=tf.constant(stop), stop_strings=tf.constant(texts, tf.string, shape=[len(texts)]))
