"""The compiled programs of continuous batching: `max_batch` slots over one key/value cache,
each holding a sequence at a position of its own, with its own controls and random stream.

The cache and what a slot's request keeps (its logit bias, the penalties' counts, its stop
strings and stop token sequences and how far its text has gone into them) live in variables
that the programs update in place (XLA aliases a variable's buffer with its update), so a step
reads only what it needs: the weights and, per slot, the first `window` positions of the cache.
Four programs, each compiled once per shape bucket, never per request (`programs`: a few
wide ones compiled before the first request stand in for the others while those compile in the
background, `warm`):

- `admit(slot, prompt, request)`: a sequence takes a slot: its bias row, zero counts, for the
  repetition penalty the tokens of its prompt (`controls.start_state`), and its stops;
- `prefill(tokens, slots, starts, window)`: a chunk of each of a few prompts (at most
  PREFILL_ROWS, one call reading the weights once for them all) into their slots' caches;
- `move(source, target)`: a sequence's cache and request from one slot to another (the host
  moves sequences down into free slots, so that steps stay narrow);
- `decode(ints, floats, seed, window, stops)`: up to `steps` new tokens for each of the first B
  slots (B the arrays' width, a program per width: a few sequences pay for their own rows, not
  for `max_batch`), each fed at its own position, then the one per-token step (`step.step`:
  the controls, the sampler, end-of-text, stops, log-probabilities) with its row's request, the
  k-th draw of a sequence from (seed, k) as `tfgpt2.generate` draws it, so that a sequence's
  tokens never depend on what shares the batch. Stop strings and stop token sequences enter a
  program only where a sequence of the step has some (`stops`: their shape bucket).

Besides them, `load(slot, pool)` and `save(slot, places)` copy whole cache blocks between a slot
and the prefix cache's pool (`decoding.prefix`), as TensorFlow runs them (nothing to compile).

A host (`tfgpt2.serve.scheduler`) decides what runs; nothing here checks its inputs.
"""
import numpy as np
import tensorflow as tf

from .. import kernels
from ..products import cpus_only
from . import controls as control
from . import layouts, quiet_retracing
from . import step as per_token
from . import stops as text_stops
from .cache import BLOCK, blocks_for, call_with_slots, empty_cache, slot_cache, slot_dtype, window
from .programs import Programs, key_of
from .request import MAX_LOGPROBS, MAX_STOP_BYTES, MAX_STOPS, Request

STOP_TOKENS = 16  # the longest stop token sequence a slot holds
INTS = ("token", "position", "budget", "count", "length", "top_k", "logprobs", "biased", "stop_at_eot",
        "min_tokens", "include_stop")  # `decode`'s int32 rows
FLOATS = ("temperature", "top_p", "min_p", *control.PENALTIES)  # its float32 rows
IDLE = -1  # `finish` of a row that makes no token in a call (no budget, or its budget spent)
PREFILL_ROWS = 4  # the most prompts whose chunks one `prefill` call reads


class Slots:
    """The programs and the state of `max_batch` slots for `model`. `chunk` the longest
    prefill chunk (the cache holds n_ctx + chunk positions, rounded up to whole blocks, so that
    a chunk's padding never wraps); `steps` the most tokens one `decode` call makes; `eot` the
    token that ends a sequence (where its request says so); `pool` the blocks of the prefix
    cache's pool (each the keys and values of BLOCK positions); `vocabulary` (a
    `stops.Vocabulary`) the token bytes that stop strings are matched on. Each program is
    traced once per shape (`programs`), and called as a concrete function: a call costs little
    more than the program (a polymorphic `tf.function` call matches its arguments each time)."""

    def __init__(self, model, *, max_batch, chunk, steps, eot, pool=0, vocabulary=None):
        quiet_retracing()  # a trace per shape bucket, by design
        hp = model.hparams
        self.model, self.max_batch, self.chunk, self.steps, self.eot = model, max_batch, chunk, steps, eot
        self.prefill_rows = min(PREFILL_ROWS, max_batch)
        if vocabulary is not None:
            self.vocabulary_bytes, self.vocabulary_lengths = (tf.Variable(a, trainable=False) for a in (
                vocabulary.bytes, vocabulary.lengths))
        self.length = blocks_for(hp.n_ctx + chunk) * BLOCK
        self.cache = [tuple(tuple(tf.Variable(block, trainable=False) for block in blocks) for blocks in layer)
                      for layer in slot_cache(model, max_batch, self.length)]
        self.pool = [tuple(tf.Variable(part, trainable=False) for part in layer)  # [pool * n_head, BLOCK, head_dim]
                     for layer in empty_cache(model, pool, BLOCK, slot_dtype(model))]
        def kept(shape, dtype, fill=0):
            return tf.Variable(tf.fill(shape, tf.constant(fill, dtype)), trainable=False)
        self.bias = kept([max_batch, hp.n_vocab], tf.float32)
        self.counts = kept([max_batch, hp.n_vocab], tf.int32)
        self.seen = kept([max_batch, hp.n_vocab], tf.bool, False)
        self.ends = kept([max_batch, MAX_STOPS + 1], tf.int32, -1)  # banned before min_tokens
        self.stop_ids, self.recent = kept([max_batch, MAX_STOPS, STOP_TOKENS], tf.int32, -1), kept(
            [max_batch, STOP_TOKENS], tf.int32, -1)
        self.stops, self.stop_lengths = kept([max_batch, MAX_STOPS, MAX_STOP_BYTES], tf.int32, -1), kept(
            [max_batch, MAX_STOPS], tf.int32)
        self.prefixes = kept([max_batch, MAX_STOPS, MAX_STOP_BYTES], tf.bool, False)
        self.slot_state = (self.bias, self.counts, self.seen, self.ends, self.stop_ids, self.recent, self.stops,
                           self.stop_lengths, self.prefixes)  # a slot's row of each: what `move` moves
        # on a CPU, the block weights multiplied on every core at a few rows (`layouts`), as
        # `generator.weights_for` picks them: at one slot without a copy
        self.layouts = (None if not (cpus_only() and layouts.usable(model)) else
                        layouts.split(model) if max_batch == 1 else layouts.transposed(model))
        self.head = None if self.layouts is None else layouts.head(model)  # a 16-bit wte's float32 copy
        # the steps of a few rows by the kernels, where they run here (`layouts.rows`); else a 16-bit
        # model's one-row steps, its block weights as 16-bit [nf, nx] copies (`layouts.one_row16`)
        self.rows = layouts.rows(model) if cpus_only() else None
        if cpus_only():  # the weights each step reads, on huge pages (`kernels.huge_pages`)
            kernels.huge_pages(list(model.weights) + [layout.w for block in self.rows or () for layout in block])
        self.one_row16 = (None if self.layouts is None or self.rows is not None or model.compute_dtype == "float32"
                          else layouts.one_row16(model))
        self.programs = Programs(lambda name, static: lambda *args: getattr(self, "_" + name)(*args, **static),
                                 tf.nest.flatten(self.cache) + list(self.slot_state))
        self.copies = {}  # the prefix cache's copies (not compiled)

    def program(self, name, *specs, **static):
        """(key, concrete function) of the program that runs `_<name>` for tensors of `specs` and
        Python values `static`: its own, or a wider one that stands in (`Programs.ready`)."""
        return self.programs.ready(key_of(name, specs, static))

    def warm(self, widths):
        """Compiles the programs that stand in for every other (`programs`): a decode step at each
        of `widths` rows over each of `windows` (the first quarter's, where most sequences run,
        each its own: under a load that keeps the cores busy the background compiles slowly, and
        a wider window's blocks cost a step more time, most at many rows); at the widest, one
        with the slots' whole stop shapes; a prefill of the longest chunk over the
        whole context (scored and not), and over its own first blocks (a prompt's first chunk:
        most prompts' only one), each of one prompt and (not scored) of `prefill_rows`; `admit`
        and `move`. Those that hold every step first (the widest decode with the whole stop
        shapes, the prefills over the whole context, `admit`, `move`), the others while the
        process's memory maps leave room (`programs`)."""
        n_ctx = self.model.hparams.n_ctx
        first = window(self.chunk, n_ctx)
        whole = ((MAX_STOPS, MAX_STOP_BYTES) if hasattr(self, "vocabulary_bytes") else None, (MAX_STOPS, STOP_TOKENS))
        rows = [specs_of(np.zeros([len(INTS), w], np.int32), np.zeros([len(FLOATS), w], np.float32),
                         np.zeros(w, np.int64)) for w in widths]
        decode = [key_of("decode", specs, dict(window=window, stops=(None, None))) for w, specs in zip(widths, rows)
                  for window in windows(n_ctx)]
        tokens = np.zeros(self.chunk, np.int32)
        prefill = {(k, window, score): key_of("prefill", specs_of(np.zeros([k, self.chunk], np.int32),
                                                                  np.zeros([2, k], np.int32), *[tokens] * score),
                                              dict(window=window))
                   for k, window, score in [(1, n_ctx, False), (1, n_ctx, True), (1, first, False),
                                            (self.prefill_rows, n_ctx, False), (self.prefill_rows, first, False)]}
        admit = key_of("admit", specs_of(*self._admit_args(0, [0], Request(length=1))), {})
        needed = [key_of("decode", rows[-1], dict(window=n_ctx, stops=whole)), prefill[self.prefill_rows, n_ctx, False],
                  prefill[1, n_ctx, True], admit, key_of("move", specs_of(tokens[:2]), {})]
        self.programs.warm(decode + list(prefill.values()), needed)

    def admit(self, slot, prompt, request):
        """Slot `slot` for a sequence whose prompt is `prompt` (token ids), generated with
        `request` (a `decoding.request.Request`): its bias row, no tokens counted, its prompt's
        tokens seen, its stops (whose shapes it returns: `stop_shape`)."""
        args = self._admit_args(slot, prompt, request)
        _, run = self.program("admit", *specs_of(*args))
        run(*(tf.constant(a) for a in args))
        return stop_shape(request)

    def _admit_args(self, slot, prompt, request):
        """`_admit`'s arguments (numpy) for `admit`."""
        hp = self.model.hparams
        prompt = prompt[-hp.n_ctx:]
        padded = np.zeros(hp.n_ctx, np.int32)
        padded[hp.n_ctx - len(prompt):] = prompt
        bias = np.zeros(hp.n_vocab, np.float32)
        for token, value in request.logit_bias:
            bias[token] = value
        ends = np.full(MAX_STOPS + 1, -1, np.int32)
        singles = ([request.eot] if request.stop_at_eot else []) + [s[0] for s in request.stop_token_ids if len(s) == 1]
        ends[:len(singles)] = singles
        ids = np.full([MAX_STOPS, STOP_TOKENS], -1, np.int32)
        for n, sequence in enumerate(request.stop_token_ids):
            ids[n, STOP_TOKENS - len(sequence):] = sequence
        data, lengths = text_stops.stop_bytes([request.stop], MAX_STOPS, MAX_STOP_BYTES)
        where = np.array([slot, hp.n_ctx - len(prompt)], np.int32)
        return where, padded, bias, ends, ids, data[0], lengths[0]

    def move(self, source, target):
        """The sequence in slot `source` to slot `target` (whose sequence has left): its cache
        rows and its request's state."""
        self.program("move", tf.TensorSpec([2], tf.int32))[1](tf.constant([source, target], tf.int32))

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

    def prefill(self, tokens, slots, starts, window, targets=None):
        """tokens [k, C] (numpy, k <= prefill_rows): row r into slot slots[r] at positions
        starts[r], starts[r] + 1, ... (attending over the slot's first `window` positions), all
        in one call (a program per power of two of k: the rows past k write nowhere). With
        `targets` [C] (k = 1), the token after each, returns how likely each was
        (`step.log_probabilities`: [C], [C, N], [C, N], numpy), for the log-probabilities of a
        prompt, and each target's rank ([C]). A stand-in of a longer chunk reads the tokens
        padded with zeros (their positions are written over before they are read, as a chunk's
        own padding is)."""
        score, (rows, size) = targets is not None, np.shape(tokens)
        k = _power_of_two(rows)
        specs = [tf.TensorSpec([k, size], tf.int32), tf.TensorSpec([2, k], tf.int32)]
        key, run = self.program("prefill", *specs + [tf.TensorSpec([size], tf.int32)] * score, window=window)
        wide, longer = key[1][0][0]
        more = wide - rows  # rows that write past every block (XLA drops such updates)
        where = [list(slots) + [0] * more, list(starts) + [self.length] * more]
        args = [np.pad(padded(tokens, longer), [(0, more), (0, 0)]), where]
        args += [padded(targets, longer)] if score else []
        out = run(*(tf.constant(a, tf.int32) for a in args))
        return (out[0].numpy()[:size], out[1][0].numpy()[:size], out[1][1].numpy()[:size],
                out[2].numpy()[:size]) if score else None

    def decode(self, ints, floats, seed, window, stops=(None, None)):
        """Up to `steps` new tokens for each of the first B slots (`_decode`), from numpy arrays:
        `ints` [len(INTS), B] int32, `floats` [len(FLOATS), B] float32, `seed` [B] int64 (B <=
        max_batch); `stops`: the largest `stop_shape` of the rows. Returns numpy arrays. A
        stand-in of more rows runs the slots past B as rows without budget (they make nothing)."""
        rows = ints.shape[1]
        key, run = self.program("decode", tf.TensorSpec(ints.shape, tf.int32), tf.TensorSpec(floats.shape, tf.float32),
                                tf.TensorSpec(seed.shape, tf.int64), window=window, stops=tuple(stops))
        wider = key[1][0][0][1]
        out = run(*(tf.constant(padded(a, wider)) for a in (ints, floats, seed)))
        tokens, count, finish, cut, logprob, ids, top = (value.numpy()[:rows] for value in tf.nest.flatten(out))
        wanted = ints[INTS.index("logprobs")].any()
        return tokens, count, finish, cut, (logprob, ids, top) if wanted else None

    def _admit(self, where, prompt, bias, ends, ids, data, lengths):
        state = control.start_state({"repetition": None}, prompt[None], where[1:], self.model.hparams.n_vocab)
        at = where[:1, None]
        for variable, value in [(self.bias, bias), (self.counts, state["counts"][0]), (self.seen, state["seen"][0]),
                                (self.ends, ends), (self.stop_ids, ids), (self.stops, data),
                                (self.stop_lengths, lengths)]:
            variable.scatter_nd_update(at, value[None])
        self.recent.scatter_nd_update(at, tf.fill([1, STOP_TOKENS], -1))
        self.prefixes.scatter_nd_update(at, tf.zeros([1, MAX_STOPS, MAX_STOP_BYTES], tf.bool))

    def _move(self, slots):
        heads = self.model.hparams.n_head
        for variable in self._variables():  # [slots * heads, BLOCK, head_dim]
            rows = tf.gather(variable, tf.range(heads) + slots[0] * heads)
            variable.scatter_nd_update((tf.range(heads) + slots[1] * heads)[:, None], rows)
        for variable in self.slot_state:  # [slots, ...]
            variable.scatter_nd_update(slots[1:, None], tf.gather(variable, slots[:1]))

    def _prefill(self, tokens, where, targets=None, *, window):
        logits, cache = call_with_slots(self.model, tokens, self._read(window), where[1], window=window,
                                        slot=where[0], layouts=self.layouts, head=self.head,
                                        every_position=targets is not None)
        self._store(cache)
        if targets is not None:  # with each target's rank (1: the most likely), as vLLM's prompt_logprobs
            chosen, top = per_token.log_probabilities(logits[0], targets)
            logp = tf.nn.log_softmax(tf.cast(logits[0], tf.float32))
            rank = 1 + tf.reduce_sum(tf.cast(logp > chosen[:, None], tf.int32), -1)
            return chosen, top, rank

    def _decode(self, ints, floats, seed, *, window, stops):
        """Up to `steps` new tokens per slot: its `token` fed at its `position`, each new token
        fed after it, while the slot has `budget` tokens left in this call and the step has not
        ended it; token k of a slot draws with the pair (seed, count + k); `logprobs` rows (1)
        want the log-probabilities (of the model's distribution, before the controls). Returns
        tokens [B, steps], the count of each row's new tokens [B], how each ended [B] (`step`;
        IDLE: not ended) and what to cut [B], and the log-probability of each token [B, steps]
        with the MAX_LOGPROBS most likely ids and theirs [B, steps, N] (zeros unless a row
        asked). `biased` rows have a logit bias."""
        row = dict(zip(INTS, tf.unstack(ints)), **dict(zip(FLOATS, tf.unstack(floats))))
        batch = ints.shape[1]  # the first `batch` slots (every slot's blocks of the window go through the loop)
        controls = self._controls(row, seed, batch, stops)
        zeros = tf.zeros([batch, self.steps], tf.float32)
        step_state = dict(count=row["count"], finish=tf.where(row["budget"] > 0, 0, IDLE),
                          cut=tf.zeros_like(row["count"]), counts=self.counts.value()[:batch],
                          seen=self.seen.value()[:batch])
        if stops[1] is not None:
            step_state["recent"] = self.recent.value()[:batch, STOP_TOKENS - stops[1][1]:]
        if stops[0] is not None:
            step_state["prefixes"] = self.prefixes.value()[:batch, :stops[0][0], :stops[0][1]]
        start = dict(j=tf.constant(0), token=row["token"], position=row["position"], cache=self._read(window),
                     step=step_state, tokens=tf.zeros([batch, self.steps], tf.int32), logprob=zeros,
                     top=(tf.zeros([batch, self.steps, MAX_LOGPROBS], tf.int32),
                          tf.zeros([batch, self.steps, MAX_LOGPROBS])))

        def body(s):
            alive = tf.equal(s["step"]["finish"], 0)
            at = tf.where(alive, s["position"], self.length - 1)  # a stopped row writes past its window
            logits, cache = call_with_slots(self.model, s["token"][:, None], s["cache"], at, window=window,
                                            layouts=self._layouts(batch), head=self.head)
            token, stepped, _ = per_token.step(logits, s["step"], controls)
            spent = tf.equal(stepped["finish"], 0) & (stepped["count"] - row["count"] >= row["budget"])
            stepped["finish"] = tf.where(spent, IDLE, stepped["finish"])
            column = tf.stack([tf.range(batch), tf.fill([batch], s["j"])], axis=1)
            chosen, top = tf.cond(tf.reduce_any(row["logprobs"] > 0),
                                  lambda: per_token.log_probabilities(logits, token),
                                  lambda: (zeros[:, 0], tuple(t[:, 0] for t in start["top"])))
            return (dict(j=s["j"] + 1, token=tf.where(alive, token, s["token"]),
                         position=s["position"] + tf.cast(alive, tf.int32), cache=cache, step=stepped,
                         tokens=tf.tensor_scatter_nd_update(s["tokens"], column, token),
                         logprob=tf.tensor_scatter_nd_update(s["logprob"], column, chosen),
                         top=tuple(tf.tensor_scatter_nd_update(o, column, t) for o, t in zip(s["top"], top))),)

        s = tf.while_loop(lambda s: tf.reduce_any(tf.equal(s["step"]["finish"], 0)), body, (start,),
                          maximum_iterations=self.steps)[0]
        self._store(s["cache"])
        end = s["step"]
        self.counts[:batch].assign(end["counts"])
        if stops[1] is not None:
            self.recent[:batch, STOP_TOKENS - stops[1][1]:].assign(end["recent"])
        if stops[0] is not None:
            self.prefixes[:batch, :stops[0][0], :stops[0][1]].assign(end["prefixes"])
        return s["tokens"], end["count"] - row["count"], end["finish"], end["cut"], s["logprob"], s["top"]

    def _layouts(self, rows):
        """The layouts of a decode step of `rows` rows: `layouts.rows` (by the kernels) at most
        `layouts.ROWS` rows where there are; else at one row, `layouts.split` for a float32
        model (its own weights, a tenth faster there than the copies) and `layouts.one_row16` for a
        16-bit one (read in 16 bits, not as the float32 copies)."""
        if self.rows is not None and rows <= layouts.ROWS:
            return self.rows
        if self.layouts is not None and rows == 1:
            return layouts.split(self.model) if self.one_row16 is None else self.one_row16
        return self.layouts

    def _controls(self, row, seed, batch, stops):
        """The step's controls for the first `batch` slots: their rows of the call and of the
        variables; the stops' only where `stops` (their shapes) says a row has some."""
        controls = dict(temperature=row["temperature"], top_k=row["top_k"], top_p=row["top_p"], seed=seed,
                        length=row["length"], stop_at_eot=row["stop_at_eot"] > 0, eot=tf.constant(self.eot, tf.int32),
                        min_p=row["min_p"], bias=self.bias.value()[:batch], min_tokens=row["min_tokens"],
                        ends=self.ends.value()[:batch], include_stop=row["include_stop"] > 0,
                        **{key: row[key] for key in control.PENALTIES})
        used = [row["biased"] > 0] + [row[key] != off for key, off in control.OFF.items()]
        controls["adjusting"] = tf.reduce_any(tf.stack(used))  # else the logits stay as they are
        texts, ids = stops
        if ids is not None:
            controls["stop_ids"] = self.stop_ids.value()[:batch, :ids[0], STOP_TOKENS - ids[1]:]
        if texts is not None:
            controls.update(stops=self.stops.value()[:batch, :texts[0], :texts[1]],
                            stop_lengths=self.stop_lengths.value()[:batch, :texts[0]],
                            vocabulary=(self.vocabulary_bytes.value(), self.vocabulary_lengths.value()))
        return controls

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


def windows(n_ctx):
    """The attention windows the warm-up compiles a decode step over: each of whole blocks of the
    cache (`cache.BLOCK`: 64, 128, 192, ...) up to a quarter of n_ctx, and n_ctx."""
    quarter = window(n_ctx // 4, n_ctx)
    return list(dict.fromkeys([*range(BLOCK, quarter + 1, BLOCK), quarter, n_ctx]))


def stop_shape(request):
    """The shapes of a request's stops as a decode program takes them: ((stop strings, bytes of
    the longest) or None, (stop token sequences, tokens of the longest) or None), powers of two
    (`stops.stop_bytes`)."""
    texts = None
    if request.stop:
        data, _ = text_stops.stop_bytes([request.stop])
        texts = data.shape[1:]
    ids = None
    if request.stop_token_ids:
        ids = (_power_of_two(len(request.stop_token_ids)), _power_of_two(max(map(len, request.stop_token_ids))))
    return texts, ids


def specs_of(*arrays):
    """The tensor specs of numpy arrays."""
    return tuple(tf.TensorSpec(np.shape(a), tf.as_dtype(np.asarray(a).dtype)) for a in arrays)


def padded(values, length):
    """`values` (numpy) with zeros after its last axis' end, to `length`."""
    more = length - np.shape(values)[-1]
    return np.pad(values, [(0, 0)] * (np.ndim(values) - 1) + [(0, more)]) if more else values


def wider(a, b):
    """The stop shape that holds both (`stop_shape`)."""
    return tuple(x if y is None else y if x is None else tuple(map(max, x, y)) for x, y in zip(a, b))


def _power_of_two(n):
    return 1 << (n - 1).bit_length()
