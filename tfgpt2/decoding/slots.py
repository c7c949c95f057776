"""The compiled programs of continuous batching: `max_batch` slots over one key/value cache,
each holding a sequence at a position of its own, with its own controls and random stream.

The cache, the logit bias and the penalties' counts live in variables that the programs update
in place (XLA aliases a variable's buffer with its update), so a step reads only what it needs:
the weights and, per slot, the first `window` positions of the cache. Four programs, each
compiled once per shape bucket, never per request:

- `admit(slot, prompt, bias)`: a sequence takes a slot: its bias row, zero counts and, for the
  repetition penalty, the tokens of its prompt (`controls.start_state`);
- `prefill(tokens, slot, start, window)`: a chunk of a prompt into the slot's cache;
- `move(source, target)`: a sequence's cache, bias row and counts from one slot to another (the
  host moves sequences down into free slots, so that steps stay narrow);
- `decode(ints, floats, seed, window)`: up to `steps` new tokens for each of the first B slots
  (B the arrays' width, a program per width: a few sequences pay for their own rows, not for
  `max_batch`), each fed at its own position, the logits adjusted (`controls.adjusted`), then
  picked by `choose` with its row's temperature, top-k, top-p, min-p and seed, the k-th draw
  of a sequence from (seed, k) as `tfgpt2.generate` draws it, so that a sequence's tokens never
  depend on what shares the batch.

Besides them, `load(slot, pool)` and `save(slot, places)` copy whole cache blocks between a slot
and the prefix cache's pool (`decoding.prefix`), as TensorFlow runs them (nothing to compile).

A host (`tfgpt2.serve.scheduler`) decides what runs; nothing here checks its inputs.
"""
import numpy as np
import tensorflow as tf

from ..products import cpus_only
from . import controls as control
from . import layouts
from .cache import BLOCK, blocks_for, call_with_slots, empty_cache, slot_cache

TOP_LOGPROBS = 5  # the most likely tokens `decode` reports per step (OpenAI's limit for completions)
INTS = ("token", "position", "budget", "drawn", "top_k", "logprobs", "biased")  # `decode`'s int32 rows
FLOATS = ("temperature", "top_p", "min_p", "repetition", "presence", "frequency")  # its float32 rows


class Slots:
    """The programs and the state of `max_batch` slots for `model`. `choose` is
    `tfgpt2.sample.choose`; `chunk` the longest prefill chunk (the cache holds n_ctx + chunk
    positions, rounded up to whole blocks, so that a chunk's padding never wraps); `steps` the
    most tokens one `decode` call makes; `eot` the token that ends a sequence; `pool` the
    blocks of the prefix cache's pool (each the keys and values of BLOCK positions). Each program is
    traced once per shape (`programs`, the compiles), and called as a concrete function: a call
    costs little more than the program (a polymorphic `tf.function` call matches its arguments
    each time)."""

    def __init__(self, model, choose, *, max_batch, chunk, steps, eot, pool=0):
        hp = model.hparams
        self.model, self.choose, self.max_batch, self.steps, self.eot = model, choose, max_batch, steps, eot
        self.length = blocks_for(hp.n_ctx + chunk) * BLOCK
        self.cache = [tuple(tuple(tf.Variable(block, trainable=False) for block in blocks) for blocks in layer)
                      for layer in slot_cache(model, max_batch, self.length)]
        self.pool = [tuple(tf.Variable(part, trainable=False) for part in layer)
                     for layer in empty_cache(model, pool, BLOCK)]  # [pool * n_head, BLOCK, head_dim]
        self.bias = tf.Variable(tf.zeros([max_batch, hp.n_vocab]), trainable=False)
        self.counts = tf.Variable(tf.zeros([max_batch, hp.n_vocab], tf.int32), trainable=False)
        self.seen = tf.Variable(tf.zeros([max_batch, hp.n_vocab], tf.bool), trainable=False)
        # on a CPU, the block weights multiplied on every core at a few rows (`layouts`), as
        # `generator.weights_for` picks them: at one slot without a copy
        self.layouts = (None if not (cpus_only() and layouts.usable(model)) else
                        layouts.split(model) if max_batch == 1 else layouts.transposed(model))
        self.programs, self.copies = {}, {}  # the compiled programs; the prefix cache's copies (not compiled)

    def program(self, name, *specs, **static):
        """The concrete function of `_<name>` for tensors of `specs` and Python values `static`."""
        key = (name, tuple((tuple(s.shape), s.dtype) for s in specs), tuple(sorted(static.items())))
        if key not in self.programs:
            run = getattr(self, "_" + name)
            self.programs[key] = tf.function(lambda *args: run(*args, **static), jit_compile=True,
                                             autograph=False).get_concrete_function(*specs)
        return self.programs[key]

    def admit(self, slot, prompt, bias):
        """Slot `slot` for a sequence whose prompt is `prompt` (token ids): its bias row `bias`
        [n_vocab] (numpy), no tokens counted, its prompt's tokens seen."""
        n_ctx = self.model.hparams.n_ctx
        prompt = prompt[-n_ctx:]
        padded = np.zeros(n_ctx, np.int32)
        padded[n_ctx - len(prompt):] = prompt
        where = np.array([slot, n_ctx - len(prompt)], np.int32)
        run = self.program("admit", tf.TensorSpec([2], tf.int32), tf.TensorSpec([n_ctx], tf.int32),
                           tf.TensorSpec(bias.shape, tf.float32))
        run(tf.constant(where), tf.constant(padded), tf.constant(bias))

    def move(self, source, target):
        """The sequence in slot `source` to slot `target` (whose sequence has left): its cache
        rows, bias row, counts and seen tokens."""
        self.program("move", tf.TensorSpec([2], tf.int32))(tf.constant([source, target], tf.int32))

    def load(self, slot, pool):
        """Blocks 0, 1, ... len(pool) - 1 of slot `slot` from the pool's blocks `pool`."""
        for j, kept in enumerate(pool):
            self.copy(j, into_slot=True)(tf.constant(slot), tf.constant(kept))

    def save(self, slot, places):
        """Block j of slot `slot` into pool block p, for each (j, p) of `places`."""
        for j, kept in places:
            self.copy(j, into_slot=False)(tf.constant(slot), tf.constant(kept))

    def copy(self, j, *, into_slot):
        """The graph that copies block j of a slot (its first argument) from or into a pool block
        (its second), every layer's keys and values: run by TensorFlow as it is, one per block
        and direction (XLA would take a minute to compile a program of a few hundred copies, and
        save nothing)."""
        key = (j, into_slot)
        if key not in self.copies:
            self.copies[key] = tf.function(lambda slot, kept: self._copy(j, slot, kept, into_slot),
                                           autograph=False).get_concrete_function(
                tf.TensorSpec([], tf.int32), tf.TensorSpec([], tf.int32))
        return self.copies[key]

    def _copy(self, j, slot, kept, into_slot):
        heads = tf.range(self.model.hparams.n_head)
        rows, pooled_rows = (at * heads.shape[0] + heads for at in (slot, kept))
        for layer, pooled in zip(self.cache, self.pool):
            for blocks, pool in zip(layer, pooled):  # keys, then values
                if into_slot:
                    blocks[j].scatter_nd_update(rows[:, None], pool.sparse_read(pooled_rows))
                else:
                    pool.scatter_nd_update(pooled_rows[:, None], blocks[j].sparse_read(rows))

    def prefill(self, tokens, slot, start, window, targets=None):
        """tokens [C] (numpy) into slot `slot` at positions start, start + 1, ... (attending
        over its first `window` positions). With `targets` [C], the token after each, returns
        how likely each was (`log_probabilities`: [C], [C, N], [C, N], numpy), for the
        log-probabilities of a prompt."""
        score = targets is not None
        specs = ([tf.TensorSpec([1, len(tokens)], tf.int32), tf.TensorSpec([2], tf.int32)]
                 + [tf.TensorSpec([len(tokens)], tf.int32)] * score)
        args = [tokens[None], [slot, start]] + [targets] * score
        out = self.program("prefill", *specs, window=window)(*(tf.constant(a, tf.int32) for a in args))
        return (out[0].numpy(), out[1][0].numpy(), out[1][1].numpy()) if score else None

    def decode(self, ints, floats, seed, window):
        """Up to `steps` new tokens for each of the first B slots (`_decode`), from numpy arrays:
        `ints` [len(INTS), B] int32, `floats` [len(FLOATS), B] float32, `seed` [B] int64 (B <=
        max_batch). Returns numpy arrays."""
        run = self.program("decode", tf.TensorSpec(ints.shape, tf.int32), tf.TensorSpec(floats.shape, tf.float32),
                           tf.TensorSpec(seed.shape, tf.int64), window=window)
        tokens, count, logprob, (ids, top) = run(tf.constant(ints), tf.constant(floats), tf.constant(seed))
        wanted = ints[INTS.index("logprobs")].any()
        return (tokens.numpy(), count.numpy(),
                (logprob.numpy(), ids.numpy(), top.numpy()) if wanted else None)

    def _admit(self, where, prompt, bias):
        state = control.start_state({"repetition": None}, prompt[None], where[1:], self.model.hparams.n_vocab)
        at = where[:1, None]
        self.bias.scatter_nd_update(at, bias[None])
        self.counts.scatter_nd_update(at, state["counts"])
        self.seen.scatter_nd_update(at, state["seen"])

    def _move(self, slots):
        heads = self.model.hparams.n_head
        for variable in self._variables():  # [slots * heads, BLOCK, head_dim]
            rows = tf.gather(variable, tf.range(heads) + slots[0] * heads)
            variable.scatter_nd_update((tf.range(heads) + slots[1] * heads)[:, None], rows)
        for variable in (self.bias, self.counts, self.seen):  # [slots, n_vocab]
            variable.scatter_nd_update(slots[1:, None], tf.gather(variable, slots[:1]))

    def _prefill(self, tokens, where, targets=None, *, window):
        logits, cache = call_with_slots(self.model, tokens, self._read(window), where[1:], window=window,
                                        slot=where[:1], layouts=self.layouts, every_position=targets is not None)
        self._store(cache)
        if targets is not None:
            return log_probabilities(logits[0], targets)

    def _decode(self, ints, floats, seed, *, window):
        """Up to `steps` new tokens per slot: its `token` fed at its `position`, each new token
        fed after it, while the slot has `budget` tokens left and has not made `eot`; draw k of
        a slot uses the pair (seed, drawn + k); `logprobs` rows (1) want the log-probabilities
        (of the model's distribution, before the controls). Returns tokens [B, steps], the count
        of each row's new tokens [B], and the log-probability of each token [B, steps] with the
        TOP_LOGPROBS most likely ids and theirs [B, steps, N] (zeros unless a row asked). `biased`
        rows have a logit bias."""
        row = dict(zip(INTS, tf.unstack(ints)), **dict(zip(FLOATS, tf.unstack(floats))))
        batch, budget = ints.shape[1], row["budget"]  # the first `batch` slots (every slot's blocks of
        # the window go through the loop, updated in place)
        controls = dict(bias=self.bias.value()[:batch], repetition=row["repetition"], presence=row["presence"],
                        frequency=row["frequency"])
        used = tf.reduce_any((row["biased"] > 0) | (row["repetition"] != 1) | (row["presence"] != 0)
                             | (row["frequency"] != 0))  # else the controls leave the logits as they are
        zeros = tf.zeros([batch, self.steps], tf.float32)
        start = dict(j=tf.constant(0), token=row["token"], position=row["position"], alive=budget > 0,
                     count=tf.zeros_like(budget), cache=self._read(window), counts=self.counts.value()[:batch],
                     tokens=tf.zeros([batch, self.steps], tf.int32), logprob=zeros,
                     top=(tf.zeros([batch, self.steps, TOP_LOGPROBS], tf.int32),
                          tf.zeros([batch, self.steps, TOP_LOGPROBS])))

        def body(s):
            at = tf.where(s["alive"], s["position"], self.length - 1)  # a stopped row writes past its window
            logits, cache = call_with_slots(self.model, s["token"][:, None], s["cache"], at, window=window,
                                            layouts=self.layouts)
            state = dict(counts=s["counts"], seen=self.seen[:batch])
            adjusted = tf.cond(used, lambda: control.adjusted(logits, controls, state), lambda: logits)
            new = self.choose(adjusted, temperature=row["temperature"], top_k=row["top_k"], top_p=row["top_p"],
                              seed=tf.stack([seed, tf.cast(row["drawn"] + s["count"], tf.int64)], axis=1),
                              min_p=row["min_p"])
            column = tf.stack([tf.range(batch), tf.fill([batch], s["j"])], axis=1)
            chosen, top = tf.cond(tf.reduce_any(row["logprobs"] > 0), lambda: log_probabilities(logits, new),
                                  lambda: (zeros[:, 0], tuple(t[:, 0] for t in start["top"])))
            alive, count = s["alive"], s["count"] + tf.cast(s["alive"], tf.int32)
            return (dict(j=s["j"] + 1, token=tf.where(alive, new, s["token"]),
                         position=s["position"] + tf.cast(alive, tf.int32),
                         alive=alive & (count < budget) & tf.not_equal(new, self.eot), count=count, cache=cache,
                         counts=control.counted(dict(counts=s["counts"]), new, alive)["counts"],
                         tokens=tf.tensor_scatter_nd_update(s["tokens"], column, new),
                         logprob=tf.tensor_scatter_nd_update(s["logprob"], column, chosen),
                         top=tuple(tf.tensor_scatter_nd_update(o, column, t) for o, t in zip(s["top"], top))),)

        s = tf.while_loop(lambda s: tf.reduce_any(s["alive"]), body, (start,), maximum_iterations=self.steps)[0]
        self._store(s["cache"])
        self.counts[:batch].assign(s["counts"])
        return s["tokens"], s["count"], s["logprob"], s["top"]

    def _read(self, window):
        """Each layer's (keys, values) blocks that hold the first `window` positions: a program
        takes (and the runtime hands it) only the variables it uses."""
        return [tuple(tuple(block.value() for block in part[:blocks_for(window)]) for part in layer)
                for layer in self.cache]

    def _store(self, cache):
        """`cache` (as `_read` gives it) into its blocks."""
        for variable, value in zip(self._variables(len(cache[0][0])), tf.nest.flatten(cache)):
            variable.assign(value)

    def _variables(self, blocks=None):
        """The first `blocks` blocks of every layer's keys and values (all: None), in
        `tf.nest.flatten` order."""
        return tf.nest.flatten([tuple(part[:blocks] for part in layer) for layer in self.cache])


def log_probabilities(logits, token):
    """log softmax(logits) [batch, n_vocab] at `token` [batch], and the TOP_LOGPROBS most likely
    ids and their log-probabilities [batch, N] (by repeated arg max: no sort of the vocabulary)."""
    logp = tf.nn.log_softmax(logits)
    chosen = tf.gather(logp, token, batch_dims=1)
    ids, values = [], []
    rest = logp
    for _ in range(TOP_LOGPROBS):
        best = tf.argmax(rest, axis=-1, output_type=tf.int32)
        ids.append(best)
        values.append(tf.gather(logp, best, batch_dims=1))
        rest = tf.tensor_scatter_nd_update(rest, tf.stack([tf.range(tf.shape(best)[0]), best], 1),
                                           tf.fill(tf.shape(best), float("-inf")))
    return chosen, (tf.stack(ids, 1), tf.stack(values, 1))
