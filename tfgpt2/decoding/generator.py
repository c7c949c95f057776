"""The compiled generation loop, kept for each model while it lives (`generator_for`).

The original's `sample_sequence` as one `tf.function` (XLA when `jit_compile`): the prompt but
its last token fills the cache, then a `tf.while_loop` feeds back one token at a time, picked
by the `choose` it is given (`tfgpt2.sample.choose`), writing each into a token buffer, until
`length` new tokens or every row has stopped. The generation controls (`controls.py`) act on
the logits before `choose` and end rows at stop sequences.
"""
import weakref

import tensorflow as tf

from ..model import shape_list
from ..products import cpus_only
from . import controls as control
from . import layouts
from .cache import call_with_cache, empty_cache


class Generator:
    """The compiled generation loop for one model, which it holds weakly (`generator_for` keeps
    one for the model's life; whoever makes one holds the model while using it).

    `generate_padded` runs a whole generation as one `tf.function` (XLA when `jit_compile`)
    over left-padded prompts. `start` (the prompt but its last token) and `resume` (new
    tokens, up to a count) run it in pieces, to report progress between them. Each takes the
    layout of the block weights first (`weights_for`). `choose(logits, *, temperature, top_k,
    top_p, seed, filters, min_p)` picks each row's token. `traces` counts how often any of them was
    traced, that is compiled.
    """

    def __init__(self, model, choose, *, jit_compile=True):
        self._model, self.choose = weakref.ref(model), choose
        self.jit_compile = jit_compile
        self.traces = 0
        # traced as written: nothing in the loop needs autograph, which would rewrite the model's code
        self.generate_padded, self.start, self.resume = (
            tf.function(self._counted(f), jit_compile=jit_compile, autograph=False)
            for f in (self._generate, self._start, self._resume))
        self.transposed = tf.function(lambda: layouts.transposed(self.model))

    @property
    def model(self):
        model = self._model()
        if model is None:
            raise ReferenceError("the model of this Generator is gone: hold it while generating")
        return model

    def _counted(self, f):
        def traced(*args):
            self.traces += 1
            return f(*args)
        return traced

    def weights_for(self, length, batch):
        """Where `layouts.transpose_pays` (on a CPU, under XLA) and the weights are float: at batch 1
        `layouts.split` (no copy, and faster there), at more rows `transposed()`. Else None."""
        if not (layouts.usable(self.model)
                and bool(layouts.transpose_pays(length, cpu=cpus_only(), jit_compile=self.jit_compile))):
            return None
        return layouts.split(self.model) if batch == 1 else self.transposed()

    def _generate(self, weights, prompt, pad, tokens, length, *options):
        """prompt [batch, P] left-padded by pad [batch]; tokens [batch, T] is the output buffer,
        whose width T (>= P + length) sizes the cache. `options` are temperature, top_k, top_p,
        seed, eot, stop_at_eot and, optionally, `choose`'s filters and the controls (a dict,
        `decoding.controls`). Returns tokens with the prompt and up to `length` new tokens after
        it (eot after a row stops), and each row's count of new tokens (a stop sequence it ended
        with left out)."""
        state = self._start(weights, prompt, pad, tokens, *options)
        state = self._resume(weights, state, pad, shape_list(prompt)[1], length, *options)
        return state["tokens"], state["lengths"]

    def _start(self, weights, prompt, pad, tokens, *options):
        """The prompt but its last token through the model, as the original's
        `sample_sequence`: the state `_resume` continues from that token, so that the sampler
        is compiled once, in the loop."""
        batch, prompt_len = shape_list(prompt)
        cache = empty_cache(self.model, batch, shape_list(tokens)[1])
        if prompt.shape[1] != 1:  # unknown where the SavedModel traces it: see `buckets.bucket_sizes`
            _, cache = call_with_cache(self.model, prompt[:, :-1], cache, 0, pad=pad, layouts=weights)
        controls = options[7] if len(options) > 7 else {}
        return dict(i=tf.constant(0), token=prompt[:, -1], cache=cache,
                    tokens=tf.concat([prompt, tokens[:, prompt_len:]], axis=1),
                    done=tf.zeros([batch], tf.bool), lengths=tf.zeros([batch], tf.int32),
                    **control.start_state(controls, prompt, pad, self.model.hparams.n_vocab))

    def _resume(self, weights, state, pad, prompt_len, until, *options):
        """Generate from `state` until `until` new tokens, or until every row has stopped."""
        def body(state):
            logits, cache = call_with_cache(self.model, state["token"][:, None], state["cache"],
                                            prompt_len + state["i"] - 1, pad=pad, layouts=weights)
            return (self._pick(dict(state, cache=cache), logits, prompt_len, *options),)

        def cond(state):
            return tf.logical_and(state["i"] < until, tf.logical_not(tf.reduce_all(state["done"])))
        return tf.while_loop(cond, body, (state,))[0]

    def _pick(self, state, logits, prompt_len, temperature, top_k, top_p, seed, eot, stop_at_eot,
              filters=(True, True), controls=None):
        """New token number i (eot for rows already stopped), written after the prompt; a row
        whose new tokens end with a stop sequence stops, its length cut before it."""
        i, done, controls = state["i"], state["done"], controls or {}
        drawn = i + controls["step"] if "step" in controls else i  # the random stream's place
        token = self.choose(control.adjusted(logits, controls, state), temperature=tf.cast(temperature, tf.float32),
                            top_k=top_k, top_p=top_p, seed=tf.stack([seed, tf.cast(drawn, tf.int64)]),
                            filters=filters, min_p=controls.get("min_p"))
        token = tf.where(done, eot, token)
        tokens = tf.tensor_scatter_nd_update(state["tokens"], _column(token, prompt_len + i), token)
        lengths = state["lengths"] + tf.cast(tf.logical_not(done), tf.int32)
        stopped = tf.logical_or(done, tf.logical_and(stop_at_eot, tf.equal(token, eot)))
        if "stop" in controls:
            start = prompt_len - controls["carried"][:, None] if "carried" in controls else prompt_len
            cut = tf.where(done, 0, control.stop_length(tokens, start, prompt_len + i + 1, controls["stop"]))
            lengths, stopped = lengths - cut, tf.logical_or(stopped, cut > 0)
        state = control.counted(state, token, tf.logical_not(done))
        return dict(state, i=i + 1, token=token, tokens=tokens, lengths=lengths, done=stopped)


def _column(values, index):
    """Scatter indices of column `index` for one value per row."""
    batch = tf.shape(values)[0]
    return tf.stack([tf.range(batch), tf.fill([batch], index)], axis=1)


KEPT = weakref.WeakKeyDictionary()
"""model -> (what its loops were compiled for, {jit_compile: Generator}), freed with the model,
as Keras keeps `predict_function` for a model."""


def generator_for(model, choose, *, jit_compile=True):
    """The model's `Generator`, kept for it while it lives (compiles are reused across calls);
    made afresh once LoRA is enabled or layers are quantized (the loops compiled before leave
    them out)."""
    compiled_for = (repr(model.lora), [conv.quantization_mode for block in model.h for conv in layouts.convs(block)])
    if model not in KEPT or KEPT[model][0] != compiled_for:
        KEPT[model] = (compiled_for, {})
    generators = KEPT[model][1]
    if jit_compile not in generators:
        generators[jit_compile] = Generator(model, choose, jit_compile=jit_compile)
    return generators[jit_compile]
