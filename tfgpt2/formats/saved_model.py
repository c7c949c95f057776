"""SavedModel export for serving: the forward pass and the XLA generation loop of `sample.py`,
loadable with TensorFlow alone (TF Serving, `tf.saved_model.load`, other languages).

Signatures (requests for TF Serving's REST API in docs/serving.md):

- `serving_default`: `input_ids` int32 [batch, time] -> `logits` float32 [batch, time, n_vocab].
- `generate`: `input_ids`, `attention_mask` int32 [batch, time], left-padded (each mask row is
  0s then 1s); `max_new_tokens`, `temperature`, `top_k`, `top_p`, `seed` (int32, float32, int32,
  float32, int64), each a scalar or one equal value per row, which is what TF Serving's
  `instances` format sends -> `output_ids` int32 [batch, time + max_new_tokens] (the input as
  given, then the new tokens, `eot` after a row stops) and `lengths` int32 [batch], the new
  tokens per row (fewer than max_new_tokens only where the export stops at eot).
- `generate_with_controls`: the inputs of `generate`, then the generation controls
  (`decoding.controls`, docs/generation.md), all required (a signature has no defaults; these
  values leave a control off): `logit_bias` float32 [n_vocab] or [batch, n_vocab] (zeros),
  `repetition_penalty` (1), `presence_penalty` (0), `frequency_penalty` (0), `min_p` (0), each
  float32, a scalar or [batch], and `stop` int32 [S, L] or [batch, S, L] (shape [0, 1]): stop
  sequences, each padded with -1 at its end (a row of -1 only is no sequence). Same outputs;
  `lengths` leaves out a stop sequence a row ended with.
- `generate_text`: the inputs of `generate_with_controls`, then `stop_strings` string [S] or
  [batch, S] ("" for none; shape [0]): the text ends before the first one it contains, wherever
  token boundaries fall, as the library's and the server's; `min_tokens` int32 (end-of-text and
  stops wait for that many new tokens), `stop_at_eot` bool (over the export's) and
  `include_stop_str_in_output` bool, each a scalar or [batch]. Outputs: those of `generate`
  (`lengths`: with a stop string, the tokens wholly before it), `text` string [batch] (the new
  text's UTF-8, as every door gives it: without a stop, or the <|endoftext|> that ended the
  row) and `finish_reason` string [batch] ("stop" or "length"). The SavedModel keeps the
  vocabulary's token bytes for it. `generate_with_controls` runs its program, without stop
  strings.

Every signature runs the one per-token step (`decoding.step`) in the loop; row r of a call
seeded s samples as its prompt alone seeded s + r (`tfgpt2.seeds`).

`generate` runs the library's request rules (`decoding.request`) and length buckets
(`decoding.buckets`) as graph ops before the XLA-compiled loop (`decoding.generator`; XLA would
clamp bad ids silently), which XLA compiles once per (batch, prompt bucket, total bucket).

Devices: `generate` holds two loops and picks one when it runs, by the kind of device its ops
are placed on (`by_device`): on a CPU, the CPU weight layouts (`decoding.layouts`) where they
pay; on a GPU (or any other device), the layers' own products.
So one SavedModel, exported anywhere, serves at each device's speed, with the same numbers.
Float32 products are full float32 on every device unless the model was exported with
`tf32=True` (`tfgpt2.products`): a server that changed no TensorFlow setting computes float32.
"""
import glob
import os

import tensorflow as tf

from ..decoding import layouts
from ..decoding import step as per_token
from ..decoding.buckets import bucket_sizes
from ..decoding.controls import PENALTIES, aligned_stops, assert_controls
from ..decoding.generator import Generator
from ..decoding.request import MAX_STOP_BYTES, MAX_STOPS, assert_request, require
from ..decoding.stops import Vocabulary
from ..encoder import EOT_TOKEN, default_encoder
from ..inputs import in_vocabulary
from ..seeds import seed_of
from .bundle import read_index
from .checkpoint import checkpoint_prefix, load_model
from .folders import encoder_of
from .files import new_folder

SCALARS = {"max_new_tokens": tf.int32, "temperature": tf.float32, "top_k": tf.int32,
           "top_p": tf.float32, "seed": tf.int64}
CONTROLS = {"logit_bias": ("bias", tf.float32, 1), **{field: (key, tf.float32, 0) for key, field in PENALTIES.items()},
            "min_p": ("min_p", tf.float32, 0), "stop": ("stop_ids", tf.int32, 2)}  # name: (key, dtype, rank of a row's)
TEXT = {"stop_strings": tf.string, "min_tokens": tf.int32, "stop_at_eot": tf.bool,
        "include_stop_str_in_output": tf.bool}  # `generate_text`'s inputs past `generate_with_controls`
WPE, WTE = "model.Swpe", "model.Swte"  # the embeddings in the SavedModel's object graph (`Serving.weights`)
IDS = tf.TensorSpec([None, None], tf.int32, name="input_ids")
MASK = tf.TensorSpec([None, None], tf.int32, name="attention_mask")


def _after(x, *checks):
    """x, computed only once the checks have passed."""
    with tf.control_dependencies(checks):
        return tf.identity(x)


def _one_value(x, name):
    """The value of a scalar, or of a [batch] vector whose values are all equal (NaNs too)."""
    x = _after(x, tf.debugging.assert_rank_in(x, [0, 1], message=f"{name} must be a scalar or one value per row"))
    flat = _after(tf.reshape(x, [-1]), tf.debugging.assert_positive(tf.size(x), message=f"{name} is empty"))
    same = tf.equal(flat, flat[0])
    if x.dtype.is_floating:
        same = tf.logical_or(same, tf.logical_and(tf.math.is_nan(flat), tf.math.is_nan(flat[0])))
    return _after(flat[0], tf.debugging.Assert(tf.reduce_all(same), [f"{name} must be the same for every row"]))


def _per_row(x, batch, rank, name):
    """x [batch, ...] from a row's value (rank `rank`, the same for every row) or one per row."""
    x = _after(x, tf.debugging.assert_rank_in(x, [rank, rank + 1], message=(
        f"{name} must have rank {rank} (every row) or {rank + 1} (one per row)")))
    x = tf.reshape(x, tf.concat([tf.ones([rank + 1 - tf.rank(x)], tf.int32), tf.shape(x)], 0))
    rows = tf.shape(x)[0]
    x = _after(x, tf.debugging.Assert(tf.logical_or(tf.equal(rows, 1), tf.equal(rows, batch)),
                                      [f"{name} must have one value per row or one for all", rows]))
    return tf.ensure_shape(tf.broadcast_to(x, tf.concat([[batch], tf.shape(x)[1:]], 0)), [None] * (rank + 1))


class Serving(tf.Module):
    """The model's variables, each once (the tied `wte` too), and the two signatures.

    Its `Generator` is held where `tf.Module` does not track it, and holds the model weakly, so
    the SavedModel stores plain variables, not the Keras objects; the caller holds the model
    while the signatures are traced (`export_saved_model`).
    """

    def __init__(self, model, *, stop_at_eot=False, eot=EOT_TOKEN, vocabulary=None):
        super().__init__(name="gpt2")
        if not in_vocabulary(eot, model.hparams.n_vocab):
            raise ValueError(f"eot {eot} is not a token id of this model (n_vocab={model.hparams.n_vocab})")
        self.weights = {v.path: v.value for v in model.weights}
        self._generator = Generator(model, jit_compile=True)
        self._layouts = layouts.usable(model)
        self._stop_at_eot, self._eot = stop_at_eot, eot
        vocabulary = vocabulary or Vocabulary.of(default_encoder())
        # the tokens' bytes, once (as strings: a byte matrix would be 16 times their size): stop
        # strings are matched on them, and the text is made of them
        self.vocabulary = tf.Variable(tf.constant(vocabulary.items), trainable=False)
        self._longest = int(vocabulary.lengths.max())

    @tf.function(input_signature=[IDS], autograph=False)
    def logits(self, input_ids):
        return {"logits": self._generator.model(_rank_2(input_ids))["logits"]}

    @tf.function(input_signature=[IDS, MASK] + [tf.TensorSpec(None, d, name=n) for n, d in SCALARS.items()],
                 autograph=False)
    def generate(self, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, seed):
        out = self._generate(input_ids, attention_mask, [max_new_tokens, temperature, top_k, top_p, seed])
        return {k: out[k] for k in ("output_ids", "lengths")}

    @tf.function(input_signature=[IDS, MASK] + [tf.TensorSpec(None, d, name=n) for n, d in SCALARS.items()]
                 + [tf.TensorSpec(None, d, name=n) for n, (_, d, _) in CONTROLS.items()], autograph=False)
    def generate_with_controls(self, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, seed,
                               logit_bias, repetition_penalty, presence_penalty, frequency_penalty, min_p, stop):
        # `generate_text` without stop strings: its program, traced once for both
        none = tf.zeros([tf.shape(input_ids)[0], 0], tf.string)
        out = self.generate_text(input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, seed,
                                 logit_bias, repetition_penalty, presence_penalty, frequency_penalty, min_p, stop,
                                 none, tf.constant(0), tf.constant(self._stop_at_eot), tf.constant(False))
        return {k: out[k] for k in ("output_ids", "lengths")}

    @tf.function(input_signature=[IDS, MASK] + [tf.TensorSpec(None, d, name=n) for n, d in SCALARS.items()]
                 + [tf.TensorSpec(None, d, name=n) for n, (_, d, _) in CONTROLS.items()]
                 + [tf.TensorSpec(None, d, name=n) for n, d in TEXT.items()], autograph=False)
    def generate_text(self, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, seed,
                      logit_bias, repetition_penalty, presence_penalty, frequency_penalty, min_p, stop, stop_strings,
                      min_tokens, stop_at_eot, include_stop_str_in_output):
        batch = tf.shape(input_ids)[0]
        controls = self._controls(input_ids, logit_bias, repetition_penalty, presence_penalty, frequency_penalty,
                                  min_p, stop)
        controls.update(stop_strings=_per_row(stop_strings, batch, 1, "stop_strings"),
                        min_tokens=_per_row(min_tokens, batch, 0, "min_tokens"),
                        stop_at_eot=_per_row(stop_at_eot, batch, 0, "stop_at_eot"),
                        include_stop=_per_row(include_stop_str_in_output, batch, 0, "include_stop_str_in_output"))
        return self._generate(input_ids, attention_mask, [max_new_tokens, temperature, top_k, top_p, seed], controls)

    def _controls(self, input_ids, *values):
        batch = tf.shape(input_ids)[0]
        return {key: _per_row(x, batch, rank, name) for x, (name, (key, _, rank)) in zip(values, CONTROLS.items())}

    def _generate(self, input_ids, attention_mask, options, controls=None):
        """The loop's run (`decoding.generator`, the one per-token step) of a request of tensors,
        checked as `check_request` checks one (`assert_request`, `assert_controls`): the output ids
        and lengths, the text, and why each row ended."""
        generator, hp = self._generator, self._generator.model.hparams
        options = [_one_value(x, name) for x, name in zip(options, SCALARS)]
        input_ids = _rank_2(input_ids)
        prompt, real = self._prompts(input_ids, _rank_2(attention_mask))
        controls = dict(controls or {})
        checks = assert_request(prompt, real, *options, hparams=hp) + assert_controls(controls, hp.n_vocab)
        controls = {key: _after(x, *checks) for key, x in controls.items()}
        max_new_tokens, temperature, top_k, top_p, seed = (_after(x, *checks) for x in options)
        prompt, real = _after(prompt, *checks), _after(real, *checks)
        prompt_len, total = bucket_sizes(tf.reduce_max(real), max_new_tokens, hp.n_ctx, one_alone=False)
        prompt = tf.pad(prompt, [[0, 0], [prompt_len, 0]])[:, -prompt_len:]
        rows = tf.shape(prompt)[0]
        controls = self._per_token(controls, rows, max_new_tokens, temperature, top_k, top_p, seed)
        out = self._loop(max_new_tokens, (prompt, prompt_len - real, tf.zeros([rows, total], tf.int32), max_new_tokens,
                                          controls, (True, True)))
        new, count, finish, cut = out["tokens"][:, prompt_len:prompt_len + max_new_tokens], out["count"], out[
            "finish"], out["cut"]
        text, lengths = self._text(new, count, finish, cut)
        new = tf.where(tf.range(max_new_tokens)[None] < lengths[:, None], new, self._eot)
        return {"output_ids": tf.concat([input_ids, new], axis=1), "lengths": lengths, "text": text,
                "finish_reason": tf.where((finish == per_token.LENGTH) | (finish == 0), "length", "stop")}

    def _per_token(self, controls, rows, length, temperature, top_k, top_p, seed):
        """The step's controls (`decoding.step`) of the signature's inputs, per row."""
        row = lambda x: tf.fill([rows], x)  # noqa: E731
        stop_ids = controls.pop("stop_ids", None)
        strings = controls.pop("stop_strings", None)
        controls.update(temperature=row(temperature), top_k=row(top_k), top_p=row(top_p),
                        seed=seed_of(seed, tf.range(rows)), length=row(length), eot=tf.constant(self._eot),
                        stop_at_eot=controls.get("stop_at_eot", row(tf.constant(self._stop_at_eot))))
        if stop_ids is not None:
            controls["stop_ids"] = aligned_stops(stop_ids)
        if strings is not None:
            controls["stops"], controls["stop_lengths"] = _stop_bytes(strings)
            tokens = self.vocabulary.value()
            controls["vocabulary"] = (tf.io.decode_raw(tokens, tf.uint8, fixed_length=self._longest),
                                      tf.strings.length(tokens))
        if "min_tokens" in controls:
            single = tf.reduce_sum(tf.cast(controls["stop_ids"] >= 0, tf.int32), -1) == 1 if stop_ids is not None \
                else tf.zeros([rows, 0], tf.bool)
            last = controls["stop_ids"][..., -1] if stop_ids is not None else tf.zeros([rows, 0], tf.int32)
            controls["ends"] = tf.concat([tf.where(controls["stop_at_eot"], self._eot, -1)[:, None],
                                          tf.where(single, last, -1)], 1)
        return controls

    def _text(self, new, count, finish, cut):
        """Each row's text (its new tokens' bytes, as `decoding.text.kept` ends it: without the
        <|endoftext|> that ended it, a stop sequence, or what follows a stop string) and the count
        of its tokens as `tfgpt2.generate` returns them without text (`text.token_row`: through
        that <|endoftext|>; a stop string: those wholly before it)."""
        kept = tf.where(finish == per_token.STOP, count - cut, count)
        in_text = tf.where(finish == per_token.EOT, kept - 1, kept)
        width = tf.shape(new)[1]
        tokens = self.vocabulary.value()
        sizes = tf.where(tf.range(width)[None] < in_text[:, None], tf.gather(tf.strings.length(tokens), new), 0)
        total = tf.reduce_sum(sizes, 1)
        end = tf.where(finish == per_token.STOP_TEXT, total - cut, total)
        whole = tf.math.cumsum(sizes, 1) <= end[:, None]
        kept = tf.where(finish == per_token.STOP_TEXT, tf.reduce_sum(tf.cast(whole & (sizes > 0), tf.int32), 1), kept)
        pieces = tf.where(sizes > 0, tf.gather(tokens, new), "")
        return tf.strings.substr(tf.strings.reduce_join(pieces, 1), tf.zeros_like(end), end), kept

    def _loop(self, max_new_tokens, args):
        """`generate_padded(weights, *args)`, by the device its ops run on: on a CPU with the
        transposed weights (for the prompt and the steps) where `layouts.transpose_pays`,
        elsewhere with the layers' own."""
        generator = self._generator

        def plain():
            return generator.generate_padded((None, None), *args)

        def on_cpu():
            return tf.cond(layouts.transpose_pays(max_new_tokens, cpu=True),
                           lambda: generator.generate_padded((generator.transposed(),) * 2, *args), plain)
        return by_device(on_cpu, plain) if self._layouts else plain()

    def _prompts(self, input_ids, attention_mask):
        """Prompts with padding slots zeroed and each row's count of real tokens, once the mask
        is checked; the ids are checked with the rest of the request (`assert_request`)."""
        mask = _after(attention_mask, tf.debugging.assert_equal(
            tf.shape(attention_mask), tf.shape(input_ids), message="attention_mask must have the shape of input_ids"))
        checks = [
            tf.debugging.assert_equal(mask * (1 - mask), 0, message="attention_mask must hold only 0 and 1"),
            tf.debugging.assert_greater_equal(mask[:, 1:], mask[:, :-1], message=(
                "attention_mask must be left padding: 0s, then 1s, in each row "
                "(Hugging Face tokenizers: padding_side='left')")),
        ]
        return _after(tf.where(mask == 1, input_ids, 0), *checks), _after(tf.reduce_sum(mask, axis=1), *checks)


def _stop_bytes(strings):
    """Stop strings [batch, S] (tf.string; "" for none) as `decoding.stops.stop_bytes` makes
    them: bytes [batch, S', L] int32 (-1 past each string's end) and lengths [batch, S'], S' and
    L powers of two, once checked (at most MAX_STOPS strings of MAX_STOP_BYTES bytes)."""
    sizes = tf.strings.length(strings)
    longest = tf.reduce_max(tf.concat([tf.reshape(sizes, [-1]), [1]], 0))
    checks = [require(tf.shape(strings)[1] <= MAX_STOPS, f"stop_strings: at most {MAX_STOPS} per row",
                      tf.shape(strings)[1]),
              require(longest <= MAX_STOP_BYTES, f"stop_strings must be at most {MAX_STOP_BYTES} bytes of UTF-8",
                      longest)]
    width = _after(tf.maximum(_power_of_two(longest), 4), *checks)
    count = _power_of_two(tf.shape(strings)[1])
    strings = tf.pad(strings, [[0, 0], [0, count - tf.shape(strings)[1]]])
    sizes = tf.strings.length(strings)
    data = tf.cast(tf.io.decode_raw(strings, tf.uint8, fixed_length=width), tf.int32)
    return tf.where(tf.range(width) < sizes[..., None], data, -1), sizes


def _power_of_two(n):
    return tf.cast(2 ** tf.math.ceil(tf.math.log(tf.cast(tf.maximum(n, 1), tf.float32)) / tf.math.log(2.0)), tf.int32)


def by_device(on_cpu, elsewhere):
    """The results of `on_cpu()` where the graph's ops are placed on a CPU, else of `elsewhere()`:
    the graph holds both, and the device picks one each time it runs (`DeviceIndex`, resolved
    by TensorFlow's optimizer for the device of the `Case` op it feeds). Under XLA, `elsewhere()`."""
    return tf.__internal__.execute_fn_for_device({"CPU": on_cpu}, default_fn=elsewhere)


def _rank_2(x):
    """x, refused unless [batch, time]: the signature's declared shape is not enforced when a
    request is fed to it (TF Serving, a loaded signature), and graph rewrites trust it."""
    return tf.ensure_shape(x, [None, None])


def export_saved_model(model_dir_or_model, export_dir, version=1, *, stop_at_eot=False, eot=EOT_TOKEN, dtype=None,
                       tf32=False, encoder=None):
    """Write the SavedModel to `<export_dir>/<version>/`, TF Serving's layout; returns that path.

    `model_dir_or_model` is a model folder or a `GPT2`. `stop_at_eot` fixes for every request
    whether a row stops after `eot`. The version folder is written under a hidden name and
    renamed when complete, so a server watching `export_dir` never loads half of it; an
    existing version is never overwritten. `dtype`: the dtype policy a model folder is loaded
    with (a bfloat16 SavedModel stores bfloat16 variables and computes in bfloat16; its logits
    are float32), and `tf32` (TensorFloat-32 allowed, as `GPT2`'s; the SavedModel keeps it).
    `encoder`: the vocabulary whose token bytes the SavedModel keeps, for stop strings and text
    (default: a model folder's, else GPT-2's).
    """
    if int(version) < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    target = os.path.join(export_dir, str(int(version)))
    if os.path.exists(target):
        raise FileExistsError(f"{target} exists; export another version or remove it")
    model = model_dir_or_model
    if isinstance(model, (str, os.PathLike)):
        encoder = encoder or encoder_of(model)
        model = load_model(model, dtype=dtype, tf32=tf32)
    module = Serving(model, stop_at_eot=stop_at_eot, eot=eot, vocabulary=encoder and Vocabulary.of(encoder))
    with new_folder(target) as tmp:
        # No gradients: serving takes none, and tracing the custom gradient of every product
        # would make the export much slower
        tf.saved_model.save(module, tmp, signatures={"serving_default": module.logits, "generate": module.generate,
                                                     "generate_with_controls": module.generate_with_controls,
                                                     "generate_text": module.generate_text},
                            options=tf.saved_model.SaveOptions(experimental_custom_gradients=False))
    return target


def embedding_sizes(path):
    """(n_ctx, n_vocab) of the SavedModel at `path` (a version folder written by
    `export_saved_model`): the shapes of its position and token embeddings, read from its
    variables' index alone."""
    _, entries = read_index(os.path.join(path, "variables", "variables"))
    rows = {name: entry.shape.dim[0].size for name, entry in entries.items() if entry.shape.dim}
    try:
        return tuple(rows[f"weights/{name}/.ATTRIBUTES/VARIABLE_VALUE"] for name in (WPE, WTE))
    except KeyError:
        raise ValueError(f"{path}: not a SavedModel of tfgpt2 export (it has no wpe and wte variables)") from None


def folder_bytes(path):
    """Total size of the files under `path`."""
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def checkpoint_bytes(model_dir):
    """Size of a model folder's checkpoint data, to compare with the SavedModel's variables/."""
    return sum(os.path.getsize(f) for f in glob.glob(glob.escape(checkpoint_prefix(model_dir)) + ".data-*"))
