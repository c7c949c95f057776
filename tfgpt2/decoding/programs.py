"""The compiled programs of the server's slots (`slots.Slots`), and which of them a step runs.

A program is a concrete function for XLA, traced once per key (its name, its arguments' shapes
and its Python values) and compiled at its first call. A few wide ones are compiled before the
server answers (`warm`), so that every step has one ready: a step whose own program is not
compiled yet runs the narrowest compiled one that holds it (`stand_in`: the same name, at least
its step width, prefill chunk, attention window and stop shapes), while a thread compiles its
own (`background`, only on a CPU the steps leave idle: `yield_cpu`); once that is done, the
step runs its own. A compile off the engine thread runs the program once on copies of the
variables of the slots (`shadows`): it never touches what the engine runs on, and XLA keeps
the compiled program for the real calls.

Each compile is counted by where it ran (`compiled`): "warmup", "background", or "request"
(on the engine thread, a step waiting on it: where nothing compiled can stand in).

XLA's CPU backend maps each kernel's code into memory apart (three memory maps a kernel: a
124M decode step over 1024 positions takes about 3,000), and Linux bounds the maps of a
process (`vm.max_map_count`, 65,530 by default), past which LLVM aborts the process (a model
of twice 124M's layers takes twice the maps: its whole warm-up would not fit). So past the
programs that hold every step, the warm-up and the background compile only while the maps left
hold twice the most any compile took, besides a tenth of the bound; past that nothing more is
compiled (`refused`), and the stand-ins serve.
"""
import collections
import os
import sys
import threading

import tensorflow as tf

WIDE = ("window", "stops")  # the Python values of a key that a stand-in may hold more of


def key_of(name, specs, static):
    """A program's key: (name, ((shape, dtype) of each argument), sorted Python values)."""
    return name, tuple((tuple(s.shape), s.dtype) for s in specs), tuple(sorted(static.items()))


class Programs:
    """Programs made by `build(name, static values)` (a function of the arguments, traced for
    their specs), each compiled once; `variables`: those the programs write (copied for a
    compile off the engine thread)."""

    def __init__(self, build, variables, maps=None):
        self.build, self.variables = build, variables
        self.maps = maps or memory_maps  # () -> (this process's memory maps, the most it may hold) or None
        self.most = 0  # the most memory maps a compile took
        self.refused = set()  # keys left uncompiled (warm-up or background): too few memory maps left
        self.traced, self.compiled = {}, {}  # key: the concrete function; key: where it compiled
        self.stand_ins = 0  # steps that ran a stand-in
        self.wanted = collections.deque()  # keys for the background thread
        self.lock = threading.Condition()
        self.worker = None  # the background thread, while it has keys
        self.closed = False

    def __iter__(self):
        return iter(list(self.compiled))

    def __len__(self):
        return len(self.compiled)

    @property
    def pending(self):
        """Programs queued for the background thread (or compiling there)."""
        return len(self.wanted)

    def count(self, where):
        """Programs compiled at `where` ("warmup", "background", "request")."""
        with self.lock:
            return sum(1 for at in self.compiled.values() if at == where)

    def trace(self, key):
        """The concrete function of `key`."""
        if key not in self.traced:
            name, specs, static = key
            run = self.build(name, dict(static))
            function = tf.function(run, jit_compile=True, autograph=False).get_concrete_function(
                *(tf.TensorSpec(shape, dtype) for shape, dtype in specs))
            with self.lock:
                self.traced.setdefault(key, function)
        return self.traced[key]

    def ready(self, key):
        """The key of the program a step of `key` runs, and its concrete function: its own where
        it is compiled; else, where one compiled holds it, that one (its own queued for the
        background thread); else its own, compiled on this call ("request")."""
        with self.lock:
            if key not in self.compiled:
                stand_in = min((k for k in self.compiled if holds(k, key)), key=cost, default=None)
                if stand_in is not None:
                    self._want(key)
                    self.stand_ins += 1
                    return stand_in, self.traced[stand_in]
                self.compiled[key] = "request"
        return key, self.trace(key)

    def warm(self, keys, needed=()):
        """Compiles the programs of `needed`, then those of `keys` while the memory maps leave
        room (`_room`; the others refused), before the engine runs ("warmup")."""
        shadows = {}
        for key in dict.fromkeys([*needed, *keys]):
            if key in needed or self._room():
                self._compile(key, shadows)
                self.compiled.setdefault(key, "warmup")
            else:
                self.refused.add(key)

    def close(self):
        """Drops the keys queued for the background thread but the one it compiles (it ends after
        that one, at the priority of the thread that closes: the server's exit waits on it, and
        at the lowest a busy machine can hold it off for minutes); no more are queued."""
        with self.lock:
            self.closed = True
            while len(self.wanted) > 1:
                self.wanted.pop()
            if self.worker is not None:
                hasten(self.worker.native_id)

    def idle(self, timeout=None):
        """Waits until the background thread has compiled every key it was given; whether it has."""
        with self.lock:
            return self.lock.wait_for(lambda: self.worker is None, timeout)

    def _want(self, key):
        """`key` for the background thread (under the lock), started where none runs."""
        if self.closed or key in self.wanted or key in self.refused:
            return
        if self.refused:  # out of memory maps: the stand-ins serve
            self.refused.add(key)
            return
        self.wanted.append(key)
        if self.worker is None:
            self.worker = threading.Thread(target=self._background, name="tfgpt2-compile", daemon=True)
            self.worker.start()

    def _background(self):
        """Compiles the wanted keys one at a time, then ends (the copies let go with it)."""
        with self.lock:
            if not self.closed:  # else `close` has given it its priority already
                yield_cpu()
        shadows = {}
        while True:
            with self.lock:
                if not self.wanted:
                    self.worker = None
                    self.lock.notify_all()
                    return
                key = self.wanted[0]
            if not self._room():  # (reading the maps off the lock: tens of thousands of lines)
                with self.lock:
                    self.refused.update(self.wanted)
                    self.wanted.clear()
                continue
            self._compile(key, shadows)
            with self.lock:
                self.wanted.popleft()
                self.compiled.setdefault(key, "background")

    def _room(self):
        """Whether a compile fits in the memory maps left: twice the most one took, besides a
        tenth of the bound (True where the maps are not known)."""
        held = self.maps()
        return held is None or held[0] + 2 * self.most + held[1] // 10 <= held[1]

    def _compile(self, key, shadows):
        """Compiles `key` by running it once, on zeros, over copies of the variables it writes
        (`shadows`: handle id -> copy, filled as needed); counts the memory maps it took."""
        before = self.maps()
        self._run(key, shadows)
        after = self.maps()
        if before is not None and after is not None:
            self.most = max(self.most, after[0] - before[0])

    def _run(self, key, shadows):
        function = self.trace(key)
        written = {id(v.handle): v for v in self.variables}
        for captured in function.captured_inputs:
            if id(captured) in written and id(captured) not in shadows:
                variable = written[id(captured)]
                shadows[id(captured)] = tf.Variable(tf.zeros(variable.shape, variable.dtype), trainable=False)
        captures = [shadows[id(c)].handle if id(c) in shadows else c for c in function.captured_inputs]
        function._call_flat([tf.zeros(shape, dtype) for shape, dtype in key[1]], captures)


def memory_maps():
    """(the memory maps this process holds, `vm.max_map_count`), or None where Linux's /proc
    does not say."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f), limit
    except (OSError, ValueError):
        return None


def yield_cpu():
    """Runs the calling thread only on a CPU nothing else wants (Linux's SCHED_IDLE, per
    thread; nice 19 where that is refused): XLA compiles on the thread that first calls a
    program, and a step's thread that wakes takes the core from it at once (at nice 19 alone,
    the compile still held the core for a while as the steps' threads woke, and slowed them)."""
    if sys.platform.startswith("linux"):
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, 19)
        try:
            os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass


def hasten(thread):
    """Gives the thread of native id `thread` the calling thread's CPU priority (undoes
    `yield_cpu`), where the system lets this process raise it (root, or CAP_SYS_NICE)."""
    if sys.platform.startswith("linux"):
        try:
            os.sched_setscheduler(thread, os.sched_getscheduler(0), os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, 0))
        except OSError:
            pass


def holds(big, small):
    """Whether the program of key `big` can run a step of key `small`: the same program, its
    arguments at least as long in each dimension (padded: rows that make nothing, chunk
    positions past the prompt), each of its WIDE values at least `small`'s."""
    if big[0] != small[0] or len(big[1]) != len(small[1]):
        return False
    if any(len(b) != len(s) or any(x < y for x, y in zip(b, s)) for (b, _), (s, _) in zip(big[1], small[1])):
        return False
    wide, narrow = dict(big[2]), dict(small[2])
    return set(wide) == set(narrow) and all(covers(wide[k], narrow[k]) if k in WIDE else wide[k] == narrow[k]
                                            for k in narrow)


def covers(big, small):
    """Whether a WIDE value `big` holds `small`: a window at least as long; stop shapes
    ((strings, bytes) or None, (sequences, tokens) or None) at least as large in each."""
    if isinstance(small, int):
        return big >= small
    return all(s is None or (b is not None and all(x >= y for x, y in zip(b, s))) for b, s in zip(big, small))


def cost(key):
    """The order in which stand-ins are tried: the fewest argument elements, then the shortest
    window, then the smallest stop shapes."""
    size = sum(int(tf.TensorShape(shape).num_elements()) for shape, _ in key[1])
    static = dict(key[2])
    stops = [n for shape in static.get("stops", ()) if shape is not None for n in shape]
    return size, static.get("window", 0), sum(stops)
