"""The compiled generation loop, kept for each model while it lives (`generator_for`).

The original's `sample_sequence` as one `tf.function` (XLA when `jit_compile`): the prompt but
its last token fills the cache, then a `tf.while_loop` feeds back one token at a time, each
picked and checked by the one per-token step (`step.step`: the controls, the sampler, the stops,
the log-probabilities), writing each into a token buffer, until `length` new tokens or every row
has ended.
"""
import weakref

import tensorflow as tf

from .. import kernels
from ..model import shape_list
from ..products import cpus_only
from . import layouts, quiet_retracing
from . import step as per_token
from .cache import call_with_cache, empty_cache, slot_dtype


class Generator:
    """The compiled generation loop for one model, which it holds weakly (`generator_for` keeps
    one for the model's life; whoever makes one holds the model while using it).

    `generate_padded` runs a whole generation as one `tf.function` (XLA when `jit_compile`)
    over left-padded prompts. `start` (the prompt but its last token) and `resume` (new
    tokens, up to a count) run it in pieces, to report progress between them; `run` and
    `begin` call them, with the prompt's pass outside XLA (`start_plain`) where that is faster
    (`prompt_apart`). Each takes the layouts of the block weights first (`weights_for`: the
    prompt's, the steps'). `traces` counts how often any of them was traced, that is compiled.
    """

    def __init__(self, model, *, jit_compile=True):
        quiet_retracing()  # a trace per length bucket, by design
        self._model = weakref.ref(model)
        self.jit_compile = jit_compile
        self.traces = 0
        self.on_huge_pages = False  # the model's weights moved to huge pages (`weights_for`)
        # traced as written: nothing in the loop needs autograph, which would rewrite the model's code
        self.generate_padded, self.start, self.resume = (
            tf.function(self._counted(f), jit_compile=jit_compile, autograph=False)
            for f in (self._generate, self._start, self._resume))
        self.transposed = tf.function(lambda: layouts.transposed(self.model), autograph=False)
        self.one_row16 = tf.function(lambda: layouts.one_row16(self.model), autograph=False)
        self.rows = tf.function(lambda: layouts.rows(self.model), autograph=False)
        self.widened = tf.function(lambda: layouts.widened(self.model), autograph=False)
        # the pass over a prompt outside XLA, where it is faster there (`prompt_apart`)
        self.start_plain = tf.function(self._counted(self._start), jit_compile=False, autograph=False)

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

    def weights_for(self, length, batch, prompt_len):
        """The layouts of the block weights (`layouts.py`) for (the pass over a prompt of
        `prompt_len` tokens but its last, the new tokens' steps), on a CPU under XLA; else (None,
        None). A float32 model, where `layouts.transpose_pays`: at batch 1 `layouts.split` (no
        copy, and faster there), at more rows `transposed()`; its steps at batch <= `layouts.ROWS`
        by the kernels where they run here (`rows()`: its own weights, nothing to repay). A
        16-bit model: `widened()` for
        its prompt, and for its steps where no other layout pays; where one does, at batch
        <= `layouts.ROWS` `rows()` (by the row kernels) where they run here, else `one_row16()`
        at batch 1, `transposed()` for both at more rows; none for a prompt whose pass runs apart
        (`prompt_apart`). An int8 model: its steps at batch <= ROWS by the row kernels, where
        they run here (its own weights: nothing to repay)."""
        if not (cpus_only() and self.jit_compile):
            return None, None
        if not self.on_huge_pages:  # once: the weights each step reads (`kernels.huge_pages`)
            kernels.huge_pages(self.model.weights)
            self.on_huge_pages = True
        few = batch <= layouts.ROWS
        if not layouts.usable(self.model):  # int8
            return None, self.rows() if few else None
        pays = bool(layouts.transpose_pays(length, cpu=True))
        if self.model.compute_dtype == "float32":
            weights = None if not pays else layouts.split(self.model) if batch == 1 else self.transposed()
            rows = self.rows() if few else None
            return weights, weights if rows is None else rows
        rows = self.rows() if pays and few else None
        if rows is not None:
            steps = rows
        else:
            steps = (self.transposed() if batch > 1 else self.one_row16()) if pays else self.widened()
        if prompt_len == 1 or self.prompt_apart(prompt_len):
            return None, steps  # no pass (`_start`), or one apart, by the layers' own weights
        return steps if not pays or (batch > 1 and rows is None) else self.widened(), steps

    def prompt_apart(self, prompt_len):
        """Whether the pass over a prompt of `prompt_len` tokens runs outside XLA (`start_plain`,
        by `run` and `begin`): a bfloat16 model's on a CPU with BF16 instructions, where
        TensorFlow's kernels multiply bfloat16 natively, and XLA's as float32
        (`layouts.native_bfloat16`). The loop stays in XLA."""
        return (prompt_len > 1 and self.jit_compile and self.model.compute_dtype == "bfloat16" and cpus_only()
                and layouts.native_bfloat16())

    def run(self, weights, prompt, pad, tokens, length, controls, filters=(True, True), top=None):
        """`generate_padded`, its prompt's pass apart where `prompt_apart`."""
        if not self.prompt_apart(shape_list(prompt)[1]):
            return self.generate_padded(weights, prompt, pad, tokens, length, controls, filters, top)
        state = self.start_plain(weights, prompt, pad, tokens, controls, top)
        state = self.resume(weights, state, pad, tf.constant(shape_list(prompt)[1]), length, controls, filters, top)
        return {k: v for k, v in state.items() if k in OUTPUTS}

    def begin(self, weights, prompt, pad, tokens, controls, top=None):
        """`start`, or `start_plain` where `prompt_apart`."""
        start = self.start_plain if self.prompt_apart(shape_list(prompt)[1]) else self.start
        return start(weights, prompt, pad, tokens, controls, top)

    def _generate(self, weights, prompt, pad, tokens, length, controls, filters=(True, True), top=None):
        """prompt [batch, P] left-padded by pad [batch]; tokens [batch, T] is the output buffer,
        whose width T (>= P + length) sizes the cache; `controls`, `filters` and `top` as
        `step.step` takes them (`step.controls_for`). Returns the state after up to `length` new
        tokens: "tokens" (the prompt, then the new tokens, eot after a row ended), and per row
        "count" (its new tokens), "finish" and "cut" (`step`), with the log-probabilities
        ("logprob" [batch, T], "top_ids", "top_logprobs" [batch, T, top], at the tokens'
        columns) where `top` is given."""
        state = self._start(weights, prompt, pad, tokens, controls, top)
        state = self._resume(weights, state, pad, shape_list(prompt)[1], length, controls, filters, top)
        return {k: v for k, v in state.items() if k in OUTPUTS}

    def _start(self, weights, prompt, pad, tokens, controls, top=None):
        """The prompt but its last token through the model, as the original's
        `sample_sequence`: the state `_resume` continues from that token, so that the sampler
        is compiled once, in the loop."""
        batch, prompt_len = shape_list(prompt)
        # under XLA on a CPU, a 16-bit model's cache held in float32, as a server's slots hold theirs
        wide = self.jit_compile and cpus_only()
        cache = empty_cache(self.model, batch, shape_list(tokens)[1], slot_dtype(self.model) if wide else None)
        if prompt.shape[1] != 1:  # unknown where the SavedModel traces it: see `buckets.bucket_sizes`
            _, cache = call_with_cache(self.model, prompt[:, :-1], cache, 0, pad=pad, layouts=weights[0])
        state = dict(i=tf.constant(0), token=prompt[:, -1], cache=cache,
                     tokens=tf.concat([prompt, tokens[:, prompt_len:]], axis=1),
                     **per_token.begin(controls, prompt, pad, self.model.hparams.n_vocab))
        if top is not None:
            state.update(logprob=tf.zeros(tf.shape(state["tokens"]), tf.float32),
                         top_ids=tf.zeros(tf.concat([tf.shape(state["tokens"]), [top]], 0), tf.int32),
                         top_logprobs=tf.zeros(tf.concat([tf.shape(state["tokens"]), [top]], 0), tf.float32))
        return state

    def _resume(self, weights, state, pad, prompt_len, until, controls, filters=(True, True), top=None):
        """Generate from `state` until `until` new tokens, or until every row has ended."""
        def body(state):
            logits, cache = call_with_cache(self.model, state["token"][:, None], state["cache"],
                                            prompt_len + state["i"] - 1, pad=pad, layouts=weights[1])
            token, stepped, scores = per_token.step(logits, _step_state(state), controls, filters=filters, top=top)
            column = _column(token, prompt_len + state["i"])
            new = dict(state, **stepped, i=state["i"] + 1, token=token, cache=cache,
                       tokens=tf.tensor_scatter_nd_update(state["tokens"], column, token))
            if top is not None:
                chosen, (ids, values) = scores
                new.update(logprob=tf.tensor_scatter_nd_update(state["logprob"], column, chosen),
                           top_ids=tf.tensor_scatter_nd_update(state["top_ids"], column, ids),
                           top_logprobs=tf.tensor_scatter_nd_update(state["top_logprobs"], column, values))
            return (new,)

        def cond(state):
            return tf.logical_and(state["i"] < until, tf.reduce_any(tf.equal(state["finish"], 0)))
        return tf.while_loop(cond, body, (state,))[0]


OUTPUTS = ("tokens", "count", "finish", "cut", "logprob", "top_ids", "top_logprobs")
LOOP = ("i", "token", "cache", "tokens", "logprob", "top_ids", "top_logprobs")  # the loop's own, not the step's


def _step_state(state):
    return {k: v for k, v in state.items() if k not in LOOP}


def _column(values, index):
    """Scatter indices of column `index` for one value per row."""
    batch = tf.shape(values)[0]
    return tf.stack([tf.range(batch), tf.fill([batch], index)], axis=1)


KEPT = weakref.WeakKeyDictionary()
"""model -> (what its loops were compiled for, {jit_compile: Generator}), freed with the model,
as Keras keeps `predict_function` for a model."""


def generator_for(model, *, jit_compile=True):
    """The model's `Generator`, kept for it while it lives (compiles are reused across calls);
    made afresh once LoRA is enabled or layers are quantized (the loops compiled before leave
    them out)."""
    compiled_for = (repr(model.lora), [conv.quantization_mode for block in model.h for conv in layouts.convs(block)])
    if model not in KEPT or KEPT[model][0] != compiled_for:
        KEPT[model] = (compiled_for, {})
    generators = KEPT[model][1]
    if jit_compile not in generators:
        generators[jit_compile] = Generator(model, jit_compile=jit_compile)
    return generators[jit_compile]
