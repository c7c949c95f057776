"""LiteRT (TensorFlow Lite) export, and generation over the file with `ai_edge_litert`.

The file has two signatures, a contract any client can use with `ai_edge_litert` and NumPy
alone (docs/litert.md):

- `prefill`: `input_ids` int32 [1, T], 1 <= T <= n_ctx -> `logits` float32 [1, n_vocab], the
  last position's, and the key/value cache, `cache_h<layer>_k` and `cache_h<layer>_v`, each
  float32 [n_head, n_ctx, n_embd // n_head], holding the T tokens at slots 0 .. T-1.
- `decode`: `input_ids` int32 [1, 1], `position` int32 scalar (the tokens already in the
  cache) and every `cache_*` tensor as the last call returned it -> `logits` and the `cache_*`
  tensors with the token's keys and values written at slot `position`.

The graph is `decoding.cache.call_with_cache` over a cache of n_ctx slots, converted from a
SavedModel (`from_saved_model` freezes the variables; builtin ops only). A file cannot raise:
`decode` at a position outside [0, n_ctx) or with a token id outside [0, n_vocab) returns NaN
logits; `LiteRTModel` checks both before it calls the file.

Quantization (`quantize`): "float16" stores the weights as float16; "int8" is LiteRT's
dynamic-range quantization (int8 weights, one scale per output channel, float activations),
with the tied token table written once (`Int8Table`).

The products are traced as `tf.matmul` (`plain_products`): LiteRT has no XLA dot op, and its
runtime no TensorFloat-32, so they are float32 in the file.
"""
import contextlib
import dataclasses
import os
import tempfile

import numpy as np
import tensorflow as tf

from ..decoding import step as per_token
from ..decoding.cache import call_with_cache, empty_cache
from ..decoding.request import check_prompts, check_request, check_window
from ..decoding.stops import Vocabulary
from ..decoding.text import completion, token_row
from ..encoder import default_encoder
from ..inputs import in_vocabulary
from ..model import shape_list
from ..seeds import seed_of
from .checkpoint import load_model
from .files import replacing

QUANTIZE = ("none", "float16", "int8")
SIGNATURES = ("prefill", "decode")


def cache_names(n_layer):
    """The cache tensors' names, each layer's keys then values."""
    return [f"cache_h{layer}_{kv}" for layer in range(n_layer) for kv in "kv"]


class Int8Table(tf.Module):
    """`wte` as int8 rows, each with a float32 scale (abs max / 127), for the int8 file.

    The lookup reads the int8 rows times their scales; the output product reads a float copy,
    rows * scales, which the converter quantizes per row back into the same bytes (its scale,
    that row's abs max / 127, is the row's own), so the file holds the table once: quantizing
    `wte` itself, the converter writes one copy per tensor for the lookup and another per row
    for the product. The scales are kept as int32 bit patterns, which it leaves as they are."""

    def __init__(self, model):
        super().__init__(name="int8_table")
        w = model.wte.numpy().astype(np.float32)
        scale = np.abs(w).max(axis=1) / 127
        scale = np.where(scale > 0, scale, 1).astype(np.float32)
        rows = np.round(w / scale[:, None]).astype(np.int8)
        self.rows = tf.Variable(rows, trainable=False, name="rows")
        self.scale_bits = tf.Variable(scale.view(np.int32), trainable=False, name="scale_bits")
        self.dequantized = tf.Variable(rows.astype(np.float32) * scale[:, None], trainable=False, name="dequantized")
        self._norm = model.ln_f

    def embed(self, X):
        scale = tf.bitcast(tf.gather(self.scale_bits, X), tf.float32)
        return tf.cast(tf.gather(self.rows, X), tf.float32) * scale[..., None]

    def logits(self, h):
        """The final norm, then logits [batch, T, n_vocab], as `GPT2.lm_logits`."""
        batch, sequence, n_embd = shape_list(h)
        logits = tf.matmul(tf.reshape(self._norm(h), [-1, n_embd]), self.dequantized, transpose_b=True)
        return tf.reshape(logits, [batch, sequence, self.rows.shape[0]])


class Signatures(tf.Module):
    """The model's variables (each once) and the `prefill` and `decode` functions at batch 1."""

    def __init__(self, model, table=None):
        super().__init__(name="gpt2")
        hp = model.hparams
        self.weights = {v.path: v.value for v in model.weights}
        self.table = table
        names = cache_names(hp.n_layer)
        head_dim = hp.n_embd // hp.n_head
        # at batch 1 the cache's rows, [batch * n_head], are the heads
        cache_specs = [tf.TensorSpec([hp.n_head, hp.n_ctx, head_dim], tf.float32, name=n) for n in names]
        tokens = (table.embed, table.logits) if table is not None else None

        def run(ids, position, cache):
            """NaN logits for a bad id or position; the graph runs on a valid stand-in."""
            known = in_vocabulary(ids, hp.n_vocab)
            ok = tf.logical_and(tf.reduce_all(known), tf.logical_and(position >= 0, position < hp.n_ctx))
            logits, cache = call_with_cache(model, tf.where(known, ids, 0), cache,
                                            tf.clip_by_value(position, 0, hp.n_ctx - 1), table=tokens)
            return {"logits": tf.where(ok, logits, np.nan), **dict(zip(names, [t for kv in cache for t in kv]))}

        def prefill(input_ids):
            return run(input_ids, tf.constant(0), empty_cache(model, 1, hp.n_ctx))

        def decode(input_ids, position, *cache):
            return run(input_ids, position, list(zip(cache[::2], cache[1::2])))

        self.prefill = tf.function(prefill, input_signature=[tf.TensorSpec([1, None], tf.int32, name="input_ids")],
                                   autograph=False)
        self.decode = tf.function(decode, input_signature=[
            tf.TensorSpec([1, 1], tf.int32, name="input_ids"), tf.TensorSpec([], tf.int32, name="position"),
            *cache_specs], autograph=False)


@contextlib.contextmanager
def plain_products(model):
    """The model's products traced as `tf.matmul` inside the block (every layer's `tf32` set,
    then restored), as LiteRT's converter takes them."""
    layers = [layer for layer in model._flatten_layers() if hasattr(layer, "tf32")]
    kept = [layer.tf32 for layer in layers]
    for layer in layers:
        layer.tf32 = True
    try:
        yield model
    finally:
        for layer, tf32 in zip(layers, kept):
            layer.tf32 = tf32


def export_litert(model_dir_or_model, path, *, quantize="none"):
    """Write the LiteRT file of a model folder or a float32 `GPT2` to `path` (atomically);
    returns `path`. `quantize`: "none", "float16" or "int8" (see the module's docstring)."""
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}; got {quantize!r}")
    model = load_model(model_dir_or_model) if isinstance(model_dir_or_model, (str, os.PathLike)) \
        else model_dir_or_model
    quantized = [layer.path for layer in model._flatten_layers() if layer.quantization_mode is not None]
    if model.compute_dtype != "float32" or quantized:
        raise ValueError(f"LiteRT export takes a float32 model (dtype policy {model.dtype_policy.name}, "
                         f"quantized layers {quantized[:3]}); quantize the file with quantize='int8' instead")
    table = Int8Table(model) if quantize == "int8" and model.tie_embeddings else None
    module = Signatures(model, table)
    with tempfile.TemporaryDirectory(prefix="tfgpt2-litert-") as saved:
        with plain_products(model):
            tf.saved_model.save(module, saved, signatures={name: getattr(module, name) for name in SIGNATURES})
        converter = tf.lite.TFLiteConverter.from_saved_model(saved, signature_keys=list(SIGNATURES))
        # Folding each norm's scale into the next product's weight happens in `decode` but not in
        # `prefill` (its T is unknown): two copies of those weights (+40% at 124M)
        converter._experimental_disable_fuse_mul_and_fc = True
        if quantize != "none":
            converter.optimizations = [tf.lite.Optimize.DEFAULT]
        if quantize == "float16":
            converter.target_spec.supported_types = [tf.float16]
        data = converter.convert()
    with replacing(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
    return path


class LiteRTModel:
    """A file of `export_litert` in `ai_edge_litert`'s interpreter: `prefill` and `decode`
    check their inputs (ValueError naming the value) and call the file's signatures."""

    def __init__(self, path, *, num_threads=None):
        from ai_edge_litert.interpreter import Interpreter
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no LiteRT file at {path}")
        self.path = path
        try:
            self.interpreter = Interpreter(model_path=path, num_threads=num_threads)
        except (ValueError, RuntimeError) as e:  # the interpreter's message does not name the file
            raise ValueError(f"{path}: not a LiteRT file ({str(e).strip().splitlines()[0]})") from None
        found = self.interpreter.get_signature_list()
        if set(found) != set(SIGNATURES):
            raise ValueError(f"{path}: expected the signatures {', '.join(SIGNATURES)}, found {', '.join(found)}")
        self._prefill, self._decode = (self.interpreter.get_signature_runner(name) for name in SIGNATURES)
        outputs = self._prefill.get_output_details()
        self.cache_names = sorted(name for name in outputs if name.startswith("cache"))
        self.n_vocab = int(outputs["logits"]["shape"][-1])
        self.n_ctx = int(outputs[self.cache_names[0]]["shape"][1])

    def prefill(self, ids):
        """(logits [n_vocab], cache) after the token ids `ids` (1 to n_ctx of them)."""
        ids = np.asarray(ids)
        if ids.ndim != 1 or not 1 <= len(ids) <= self.n_ctx:
            raise ValueError(f"prefill takes 1 to n_ctx={self.n_ctx} token ids; got shape {list(ids.shape)}")
        self._check_ids(ids)
        return self._outputs(self._prefill(input_ids=ids[None].astype(np.int32)))

    def decode(self, token, position, cache):
        """(logits [n_vocab], cache) after `token` at slot `position` of `cache`."""
        if not 0 <= position < self.n_ctx:
            raise ValueError(f"position {position} is past the cache of n_ctx={self.n_ctx} slots "
                             f"(decode takes 0 <= position < {self.n_ctx})")
        self._check_ids(np.asarray([token]))
        return self._outputs(self._decode(input_ids=np.array([[token]], np.int32),
                                          position=np.array(position, np.int32), **cache))

    def _check_ids(self, ids):
        bad = ids[~in_vocabulary(ids, self.n_vocab)]
        if bad.size:
            raise ValueError(f"token ids must be in [0, n_vocab={self.n_vocab}); got {bad[:3].tolist()}")

    def _outputs(self, out):
        return out["logits"][0], {name: out[name] for name in self.cache_names}


def generate_litert(model, prompts, length, *, encoder=None, progress=None, **controls):
    """`tfgpt2.generate` over a `LiteRTModel` (or a file's path): the same arguments (every
    control; not `context_keep`, `stream` or `prompt_logprobs`), checks, sampling, seeds and
    results, so at temperature 0 the same tokens wherever the logits agree. `progress(n)`: called
    with the number of new tokens so far."""
    if not isinstance(model, LiteRTModel):
        model = LiteRTModel(model)
    texts, sequences = (controls.pop("stop", None), [])
    if texts is not None and not isinstance(texts, str):
        texts, sequences = [t for t in texts if isinstance(t, str)], [t for t in texts if not isinstance(t, str)]
    controls["stop_token_ids"] = sequences + list(controls.get("stop_token_ids") or [])
    request = check_request(n_vocab=model.n_vocab, n_ctx=model.n_ctx, length=length, stop=texts, **controls)
    text = bool(request.stop) or request.logprobs is not None or encoder is not None
    return complete_litert(model, prompts, request, encoder=encoder, text=text, progress=progress)


def complete_litert(model, prompts, request, *, encoder=None, text=True, progress=None):
    """`generate_litert` of a checked `decoding.request.Request`, as `decoding.batch.complete`:
    `decoding.text.Completion`s, or, without `text`, arrays. The file runs at batch 1: each
    prompt has its own cache, and the rows advance together through the one per-token step
    (`decoding.step`), run on the logits the file returns."""
    if request.context_keep is not None or request.prompt_logprobs is not None:
        raise ValueError("a LiteRT file generates within its window and reports no prompt log-probabilities: "
                         "context_keep and prompt_logprobs are not available")
    prompts = check_prompts(prompts, model.n_vocab)
    check_window(max(map(len, prompts)), request.length, model.n_ctx)
    vocabulary = Vocabulary.of(encoder or default_encoder()) if text else None
    rows = [dataclasses.replace(request, seed=seed_of(request.seed, r)) for r in range(len(prompts))]
    controls, filters = per_token.controls_for(rows, model.n_vocab, vocabulary)
    padded = np.zeros([len(prompts), max(map(len, prompts))], np.int32)
    for row, p in enumerate(prompts):
        padded[row, padded.shape[1] - len(p):] = p
    pad = tf.constant([padded.shape[1] - len(p) for p in prompts], tf.int32)
    state = per_token.begin(controls, tf.constant(padded), pad, model.n_vocab)
    # one graph for the run (eagerly, top-k's bisection is slow)
    run = tf.function(lambda logits, state: per_token.step(logits, state, controls, filters=filters,
                                                           top=request.logprobs), autograph=False)
    new, scores = [[] for _ in prompts], [[] for _ in prompts]
    caches = [model.prefill(p) for p in prompts]
    for i in range(request.length):
        running = state["finish"].numpy() == 0
        token, state, scored = run(tf.constant(np.stack([logits for logits, _ in caches])), state)
        for row in np.flatnonzero(running):
            new[row].append(int(token[row]))
            if scored is not None:
                scores[row].append((scored[0][row].numpy(), scored[1][0][row].numpy(), scored[1][1][row].numpy()))
        if progress is not None:
            progress(i + 1)
        finish = state["finish"].numpy()
        if not (finish == 0).any():
            break
        caches = [cache if finish[row] else model.decode(new[row][-1], len(prompts[row]) + i, cache[1])
                  for row, cache in enumerate(caches)]
    finish, cut = state["finish"].numpy(), state["cut"].numpy()
    if not text:
        return [np.concatenate([p, np.asarray(token_row(n, f, c), np.int64)])
                for p, n, f, c in zip(prompts, new, finish, cut)]
    return [completion(p, n, f, c, vocabulary.token_bytes, scores=s if request.logprobs is not None else None)
            for p, n, f, c, s in zip(prompts, new, finish, cut, scores)]

