"""Continuous batching: sequences wait in a queue, take a free slot of `decoding.slots.Slots`,
are prefilled a chunk at a time (one call between decode steps reads a chunk of each of the
first few waiting prompts, so running streams keep flowing and a burst of prompts is read in
a few calls), then join the running batch at the next step; each leaves where the per-token step
ends it (its length, end-of-text, a stop string or stop token sequence: `decoding.step`) or on a
cancel, and its slot is reused at once.
A decode step runs the slots up to the highest in use (`width`), not all `max_batch`; where
sequences leave low slots while a high one runs on, it moves down into a free one. With a
prefix cache (`decoding.prefix`), a prompt's whole blocks are kept once its prefill has written
them (after the step that makes its first token), and a later prompt that starts the same way
copies them into its slot instead of reading them.

One engine thread runs every TensorFlow program (`Scheduler.run`); the rest of the process only
queues and cancels sequences (thread-safe) and hears from them through their `sink`.
"""
import collections
import threading
import time
import traceback

import numpy as np

from ..decoding.buckets import bucket
from ..decoding.cache import BLOCK, window
from ..decoding.controls import PENALTIES
from ..decoding.prefix import PrefixCache
from ..decoding.slots import FLOATS, IDLE, INTS, Slots, wider
from ..decoding.step import LENGTH

ERROR = -2  # a sink's `finish` where the step failed
PER_SLOT = ("top_k", "length", "logprobs", "biased", "stop_at_eot", "min_tokens", "include_stop")  # a request's ints

MIN_CHUNK = 16  # the shortest prefill chunk (chunks are length buckets up to `chunk`)
# tokens per decode call for a sequence alone while nothing waits: the host's cost of a call (2-3 ms
# on a CPU, a third of a 124M token's time in 16 bits) spread over them, so that one client runs as
# fast as `tfgpt2.generate`; a request that comes meanwhile waits for at most that call
LONE_STEPS = 16


class QueueFull(Exception):
    """More sequences than the queue holds: try again later."""


class Sequence:
    """One completion to generate: `prompt` (token ids) continued as `request` (a
    `decoding.request.Request`: its length, controls, stops, seed, log-probabilities and
    context_keep, going on past n_ctx from the last that many tokens). `sink(tokens, logprobs,
    finish, cut)` hears each group of new tokens, from the engine thread (`finish`: 0 while the
    sequence runs, then how the step ended it, `decoding.step`, with what to `cut`; ERROR where
    the step failed; logprobs: (log-probability, top ids, their log-probabilities) per token, or
    None). With `score_prompt`, `prompt_logprobs` holds those of the prompt's tokens but the
    first, as `logprobs` with each one's rank (filled before the first tokens). With `generate`
    false it makes no token: it ends (at its length) once its prompt is read (or at once where
    nothing is scored)."""

    def __init__(self, prompt, request, sink, *, score_prompt=False, generate=True):
        self.prompt, self.request, self.sink = list(prompt), request, sink
        self.max_tokens, self.context_keep = request.length, request.context_keep
        self.logprobs = request.logprobs is not None
        self.score_prompt, self.prompt_logprobs, self.generate = score_prompt, [], generate
        self.stop_shape = (None, None)  # the shapes of its stops, as a decode program takes them
        self.generated = []
        self.slot = None
        self.context, self.prefilled = self.prompt, 0  # what the slot's cache holds (a window, past n_ctx)
        self.cached = 0  # the prompt's first blocks in its slot that the prefix cache holds
        self.since_context = 0  # new tokens since the context was set
        self.cancelled = False
        self.submitted = self.admitted = time.monotonic()  # when it was queued, when it took a slot

    @property
    def position(self):
        """Where the next token is fed (the context's last token, then each new one)."""
        return len(self.context) - 1 + self.since_context

    @property
    def prefilling(self):
        return self.prefilled < len(self.context) - 1


class Scheduler:
    """Runs sequences on `max_batch` slots of `model`: `submit`, `cancel`, and `run` in a thread
    of its own until `close`. At most `max_queue` sequences wait for a slot (`submit` raises
    QueueFull past that). `chunk`: the longest prefill chunk; `steps`: the most tokens a decode
    call makes while no prompt is waiting to be prefilled (more amortize the host's work per
    call, fewer let new requests in sooner), at least LONE_STEPS for a sequence alone;
    `prefix_blocks`: the blocks of the prefix cache's pool (0: no prefix cache); `vocabulary` (a
    `decoding.stops.Vocabulary`): the token bytes that stop strings are matched on."""

    def __init__(self, model, *, max_batch, max_queue, chunk=64, steps=1, eot, prefix_blocks=0, vocabulary=None):
        self.n_ctx, self.n_vocab, self.eot = model.hparams.n_ctx, model.hparams.n_vocab, eot
        self.max_batch, self.max_queue, self.chunk = max_batch, max_queue, chunk
        self.steps = steps
        self.slots = Slots(model, max_batch=max_batch, chunk=chunk, steps=max(steps, LONE_STEPS), eot=eot,
                           pool=prefix_blocks, vocabulary=vocabulary)
        self.prefix = PrefixCache(prefix_blocks) if prefix_blocks else None
        self.unkept = []  # sequences whose prompts' blocks the prefix cache is yet to keep (`_keep`)
        self.running = [None] * max_batch
        self.waiting = collections.deque()
        self.lock = threading.Condition()
        self.closed = False
        self.generated = 0  # tokens generated so far, all sequences
        # each slot's sampling values, as `Slots.decode` takes them
        self.floats = np.zeros([len(FLOATS), max_batch], np.float32)
        self.ints, self.seed = np.zeros([len(PER_SLOT), max_batch], np.int32), np.zeros(max_batch, np.int64)
        self.warmed = None  # the seconds of `warm_up`

    def warm_up(self):
        """Compiles the programs that stand in for every step's (`Slots.warm`: at each `width`), so
        that no request waits on a compile; before `run`. Returns its seconds."""
        start = time.monotonic()
        self.slots.warm(sorted({width(n, self.max_batch) for n in range(1, self.max_batch + 1)}))
        self.warmed = time.monotonic() - start
        return self.warmed

    # ---- any thread --------------------------------------------------------------------

    def submit(self, sequences):
        """Queue the sequences (all or none): QueueFull when more than `max_queue` would wait."""
        with self.lock:
            if len(self.waiting) + len(sequences) > self.max_queue + self.running.count(None):
                raise QueueFull(f"{len(self.waiting)} completions are waiting (--max_queue {self.max_queue})")
            self.waiting.extend(sequences)
            self.lock.notify()

    def cancel(self, sequences):
        """End the sequences where they are (a client that left): their slots free at the next step."""
        with self.lock:
            for sequence in sequences:
                sequence.cancelled = True
            self.lock.notify()

    def close(self):
        """Ends `run`, and the background compiles once the one under way is done."""
        self.slots.programs.close()
        with self.lock:
            self.closed = True
            self.lock.notify()

    def join(self):
        """Waits, after `close`, for the background compile under way to end: a thread still in
        TensorFlow as Python exits aborts the process."""
        self.slots.programs.idle()

    @property
    def occupied(self):
        return self.max_batch - self.running.count(None)

    @property
    def queued(self):
        return len(self.waiting)

    @property
    def idle(self):
        with self.lock:
            return not self.waiting and not self.occupied

    # ---- the engine thread -------------------------------------------------------------

    def run(self):
        """The engine loop: admit, prefill one chunk, decode; sleeps while there is nothing to
        do. Where a step fails, its sequences hear "error" (the traceback goes to stderr) and the
        loop goes on."""
        while True:
            with self.lock:
                while not self.closed and not self.waiting and not self.occupied:
                    self.lock.wait()
                if self.closed:
                    return
                self._drop_cancelled()
                admitted = self._take_waiting()
            try:
                for sequence in admitted:
                    self._admit(sequence)
                self._scored()
                self.step()
            except Exception:  # a program failed (out of memory, ...): end what runs, serve on
                traceback.print_exc()
                self._fail()

    def step(self):
        """One prefill call for the first prompts still to prefill (`_chunks`), then one decode
        call for the sequences that are ready."""
        prefilling = sorted((s for s in self.running if s is not None and s.prefilling), key=lambda s: s.submitted)
        if prefilling:
            self._prefill(self._chunks(prefilling))
        self._scored()
        ready = [s for s in self.running if s is not None and not s.prefilling]
        if ready:
            self._decode(ready, self._steps(ready))
        self._keep()
        self._compact()

    def _steps(self, ready):
        """The most tokens the decode call of the `ready` sequences makes: one while a prompt
        waits to be prefilled (read between calls) or a sequence is yet to make its first token
        (streamed at once); else `steps`, at least LONE_STEPS for a sequence alone."""
        if self.waiting or any(s is not None and s.prefilling for s in self.running) or any(
                not s.since_context for s in ready):
            return 1
        return self.steps if len(ready) > 1 else self.slots.steps

    def _keep(self):
        """The whole blocks of the prompts whose prefill ended this step, into the prefix
        cache's pool: after the decode that made their first tokens, which the copies would
        otherwise delay (a slot's blocks stay as they are until another sequence takes it)."""
        for sequence in self.unkept:
            whole = sequence.prefilled // BLOCK
            self.slots.save(sequence.slot, self.prefix.store(sequence.prompt, sequence.cached, whole))
            sequence.cached = whole
        self.unkept = []

    def _scored(self):
        """Ends the sequences that make no token whose prompts are read (`Sequence.generate`)."""
        for sequence in self.running:
            if sequence is not None and not sequence.generate and not (sequence.score_prompt and sequence.prefilling):
                self.running[sequence.slot] = None
                sequence.sink([], None, LENGTH, 0)

    def _drop_cancelled(self):
        self.waiting = collections.deque(s for s in self.waiting if not s.cancelled)
        for slot, sequence in enumerate(self.running):
            if sequence is not None and sequence.cancelled:
                self.running[slot] = None

    def _take_waiting(self):
        taken = []
        while self.waiting and None in self.running:
            sequence = self.waiting.popleft()
            sequence.slot, sequence.admitted = self.running.index(None), time.monotonic()
            self.running[sequence.slot] = sequence
            taken.append(sequence)
        return taken

    def _admit(self, sequence):
        """The slot's values for the sequence's request: sampling, seed, bias row, counts, seen
        prompt, stops."""
        r, slot = sequence.request, sequence.slot
        if not sequence.generate and not sequence.score_prompt:  # nothing to run: `_scored` ends it
            return
        self.floats[:, slot] = [getattr(r, PENALTIES.get(name, name)) for name in FLOATS]
        self.ints[:, slot] = [r.top_k, r.length, sequence.logprobs, bool(r.logit_bias), r.stop_at_eot, r.min_tokens,
                              r.include_stop_str_in_output]
        self.seed[slot] = r.seed
        sequence.stop_shape = self.slots.admit(slot, sequence.prompt, r)
        sequence.since_context = 0
        if self._cacheable(sequence):
            pool = self.prefix.lookup(sequence.prompt, self._whole_chunks(len(sequence.prompt) - 1))
            if pool:
                self.slots.load(slot, pool)
            sequence.cached, sequence.prefilled = len(pool), len(pool) * BLOCK

    def _chunks(self, prefilling):
        """The sequences (of `prefilling`, the first submitted first) whose next chunks one
        prefill call reads: the first, and up to `prefill_rows` in all; a prompt to score alone
        (another program)."""
        if _scoring(prefilling[0]):
            return prefilling[:1]
        return [s for s in prefilling if not _scoring(s)][:self.slots.prefill_rows]

    def _prefill(self, sequences):
        """The next chunk of each sequence's context, in one call (the context's last token is
        fed by `_decode`): what is left, up to `chunk` tokens, as a sequence alone reads it;
        each padded to the longest one's length bucket."""
        pieces = [s.context[s.prefilled:min(len(s.context) - 1, s.prefilled + self.chunk)] for s in sequences]
        size = max(min(self.chunk, bucket(len(piece), minimum=MIN_CHUNK)) for piece in pieces)
        tokens = np.zeros([len(sequences), size], np.int32)
        for row, piece in zip(tokens, pieces):
            row[:len(piece)] = piece
        first, piece = sequences[0], pieces[0]
        targets = None
        if _scoring(first):  # the next token of each
            targets = np.zeros(size, np.int32)
            targets[:len(piece)] = first.context[first.prefilled + 1:first.prefilled + len(piece) + 1]
        out = self.slots.prefill(tokens, [s.slot for s in sequences], [s.prefilled for s in sequences],
                                 max(window(s.prefilled + len(p), self.n_ctx) for s, p in zip(sequences, pieces)),
                                 targets)
        if targets is not None:
            first.prompt_logprobs += [tuple(values[j] for values in out) for j in range(len(piece))]
        for sequence, piece in zip(sequences, pieces):
            sequence.prefilled += len(piece)
            if self._cacheable(sequence) and not sequence.prefilling:  # its whole blocks go to the pool (`_keep`)
                self.unkept.append(sequence)

    def _cacheable(self, sequence):
        """Whether the prefix cache serves the sequence: its cache holds its prompt from the
        start (not a window past n_ctx), and its prompt is not scored (the scoring prefill is
        another program)."""
        return self.prefix is not None and sequence.context is sequence.prompt and not sequence.score_prompt

    def _whole_chunks(self, positions):
        """The whole blocks in the first `positions` positions that end where a prefill chunk
        ends: a prompt that reuses them is read on from there in the very chunks it would have
        been read in alone, so that its numbers are the same with the prefix cache or without."""
        per_chunk = max(1, self.chunk // BLOCK)
        return positions // (per_chunk * BLOCK) * per_chunk

    def _decode(self, ready, steps):
        """Up to `steps` new tokens for each of the `ready` sequences, handed to its sink."""
        rows = width(max(s.slot for s in ready) + 1, self.max_batch)  # the slots the step runs
        ints = dict(zip(INTS, np.zeros([len(INTS), rows], np.int32)), **dict(zip(PER_SLOT, self.ints[:, :rows])))
        stops = (None, None)
        for s in ready:
            ints["token"][s.slot] = s.generated[-1] if s.since_context else s.context[-1]
            ints["position"][s.slot], ints["count"][s.slot] = s.position, len(s.generated)
            ints["budget"][s.slot] = min(steps, s.max_tokens - len(s.generated), self.n_ctx - s.position)
            stops = wider(stops, s.stop_shape)
        tokens, count, finish, cut, logprobs = self.slots.decode(
            np.stack([ints[name] for name in INTS]), self.floats[:, :rows], self.seed[:rows],
            window(int(max(ints["position"] + ints["budget"])), self.n_ctx), stops)
        for s in ready:
            new = tokens[s.slot, :count[s.slot]].tolist()
            self._advance(s, new, [tuple(values[s.slot, j] for values in logprobs) for j in range(len(new))]
                          if s.logprobs else None, 0 if finish[s.slot] == IDLE else int(finish[s.slot]),
                          int(cut[s.slot]))

    def _advance(self, sequence, new, logprobs, finish, cut):
        """The sequence after its new tokens: ended (`finish`, the step's), slid past n_ctx
        (`context_keep`), or going on."""
        sequence.generated += new
        sequence.since_context += len(new)
        self.generated += len(new)
        if sequence.position >= self.n_ctx and not finish:  # the window is full: go on from its last tokens
            sequence.context = (sequence.prompt + sequence.generated)[-sequence.context_keep:]
            sequence.prefilled, sequence.since_context = 0, 0
        sequence.sink(new, logprobs, finish, cut)
        if finish:
            self.running[sequence.slot] = None

    def _compact(self):
        """Moves the sequence in the highest slot into the lowest free one while the step the
        sequences run is wider than as many sequences need."""
        used = [slot for slot, s in enumerate(self.running) if s is not None]
        while used and width(used[-1] + 1, self.max_batch) > width(len(used), self.max_batch):
            source, target = used.pop(), self.running.index(None)
            self.slots.move(source, target)
            for values in (self.floats, self.ints, self.seed):
                values[..., target] = values[..., source]
            sequence, self.running[source] = self.running[source], None
            self.running[target], sequence.slot = sequence, target
            used = sorted(used + [target])

    def _fail(self):
        self.unkept = []
        with self.lock:
            failed = [s for s in self.running if s is not None]
            self.running = [None] * self.max_batch
        for sequence in failed:
            sequence.sink([], None, ERROR, 0)


def _scoring(sequence):
    """Whether the sequence's prefill scores its prompt (its next chunk is of the prompt)."""
    return sequence.score_prompt and sequence.context is sequence.prompt


def width(slots, max_batch):
    """The width of a decode step (a compile bucket) whose sequences sit in the first `slots`
    slots: a power of two, at most max_batch. A sequence takes the first free slot, so a few
    sequences run a narrow step (one alone, at the speed of --max_batch 1)."""
    return min(1 << (slots - 1).bit_length(), max_batch)
