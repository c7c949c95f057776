"""`tfgpt2.decoding.programs`: which compiled program a step runs (its own, or a wider one that
stands in while its own compiles in the background), and that a compile off the engine thread
never touches the variables the programs write."""
import os
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf

from tfgpt2.decoding.programs import Programs, covers, holds, key_of, memory_maps


def adds(variable):
    """Programs "add" (x [n], a Python `window`): variable[:n] += x * window + 1 (a call on zeros
    writes too); returns window."""
    def build(name, static):
        def run(x):
            n = x.shape[0]
            variable[:n].assign(variable[:n] + x * static["window"] + 1)
            return tf.constant(static["window"])
        return run
    return build


def key(n, window):
    return key_of("add", [tf.TensorSpec([n], tf.float32)], dict(window=window))


def test_a_step_runs_its_own_program_a_stand_in_or_compiles_where_none_holds_it():
    """After the warm-up (n 4, window 2), a step of n 2, window 1 runs it (its own queued for
    the background), one of n 8 compiles on the step ("request"); once the background has
    compiled n 2, window 1, the step runs that. The warm-up's and the background's compiles
    leave the variable as it was; the steps' own calls add."""
    variable = tf.Variable(tf.zeros([8]))
    programs = Programs(adds(variable), [variable])
    programs.warm([key(4, 2)])
    assert programs.count("warmup") == len(programs) == 1 and not variable.numpy().any()
    ran, run = programs.ready(key(2, 1))
    assert ran == key(4, 2) and programs.stand_ins == 1 and int(run(tf.ones([4]))) == 2
    assert programs.idle(timeout=120) and programs.count("background") == 1 and programs.pending == 0
    np.testing.assert_array_equal(variable.numpy(), [3, 3, 3, 3, 0, 0, 0, 0])  # the stand-in's call alone
    assert programs.ready(key(2, 1))[0] == key(2, 1) and programs.stand_ins == 1
    assert programs.ready(key(8, 1))[0] == key(8, 1) and programs.count("request") == 1
    programs.close()
    assert programs.ready(key(1, 1))[0] == key(2, 1) and programs.pending == 0  # closed: nothing queued


def test_the_background_compiles_at_the_lowest_cpu_priority():
    """The background thread's compile runs under SCHED_IDLE at nice 19 (Linux), the engine's
    thread as it was."""
    if not sys.platform.startswith("linux"):
        pytest.skip("a thread has its own CPU priority on Linux only")
    variable, niceness = tf.Variable(tf.zeros([8])), {}

    def build(name, static):
        thread = threading.get_native_id()
        niceness[thread == engine] = os.getpriority(os.PRIO_PROCESS, thread), os.sched_getscheduler(thread)
        return adds(variable)(name, static)

    engine = threading.get_native_id()
    programs = Programs(build, [variable])
    programs.warm([key(4, 2)])
    programs.ready(key(2, 1))
    assert programs.idle(timeout=120) and programs.count("background") == 1
    assert niceness == {True: (os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0)),
                        False: (19, os.SCHED_IDLE)}


def test_a_stand_in_holds_a_steps_shapes_and_values():
    """Longer arguments in each dimension, a window at least as long, stop shapes at least as
    large (None: no stops); another program or a value that is not a window or stop never."""
    assert holds(key(4, 2), key(2, 2)) and holds(key(4, 2), key(4, 1)) and not holds(key(2, 2), key(4, 2))
    assert not holds(key(4, 1), key(4, 2)) and not holds(key_of("other", [tf.TensorSpec([4])], dict(window=2)),
                                                         key(4, 2))
    assert not holds(key_of("add", [tf.TensorSpec([4])], dict(window=2, size=2)),
                     key_of("add", [tf.TensorSpec([4])], dict(window=2, size=1)))
    assert covers(((4, 16), (2, 2)), ((4, 8), None)) and covers(((4, 16), None), (None, None))
    assert not covers((None, (2, 2)), ((4, 8), None)) and not covers(((4, 8), None), ((8, 8), None))


def test_after_close_the_compile_under_way_ends_and_no_other_starts():
    """What the server's shutdown waits on (`Scheduler.join`): a thread still in TensorFlow as
    Python exits aborts the process (SIGABRT)."""
    variable = tf.Variable(tf.zeros([8]))
    programs = Programs(adds(variable), [variable])
    programs.warm([key(8, 4)])
    for n in (1, 2, 3):
        programs.ready(key(n, 1))  # queued for the background thread
    programs.close()
    assert programs.idle(timeout=120) and programs.pending == 0 and programs.worker is None
    assert programs.ready(key(5, 1))[0] == key(8, 4) and programs.worker is None  # a stand-in, nothing queued


def test_close_gives_the_compile_under_way_the_closing_threads_priority():
    """The server's exit waits on the background compile under way (`Scheduler.join`): once
    closed it runs at the priority of the thread that closed, not the lowest, which a busy
    machine holds off for minutes."""
    if not sys.platform.startswith("linux"):
        pytest.skip("a thread has its own CPU priority on Linux only")
    if os.geteuid() != 0:
        pytest.skip("raising a thread's CPU priority needs root (or CAP_SYS_NICE)")
    variable, started, closed, seen = tf.Variable(tf.zeros([8])), threading.Event(), threading.Event(), []

    def build(name, static):
        thread = threading.get_native_id()
        if thread != engine:  # the background thread, at its lowest, until the engine closes
            seen.append((os.getpriority(os.PRIO_PROCESS, thread), os.sched_getscheduler(thread)))
            started.set()
            assert closed.wait(120)
            seen.append((os.getpriority(os.PRIO_PROCESS, thread), os.sched_getscheduler(thread)))
        return adds(variable)(name, static)

    engine = threading.get_native_id()
    programs = Programs(build, [variable])
    programs.warm([key(4, 2)])
    programs.ready(key(2, 1))
    assert started.wait(120)
    programs.close()
    closed.set()
    assert programs.idle(timeout=120) and programs.count("background") == 1
    assert seen == [(19, os.SCHED_IDLE), (os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0))]


def mapping(variable, held):
    """`adds`, each program's compile taking 100 of the memory maps counted in held["maps"] (as
    it is traced)."""
    def build(name, static):
        held["maps"] += 100
        return adds(variable)(name, static)
    return build


def test_the_background_stops_compiling_before_the_memory_maps_run_out():
    """XLA's CPU backend maps each kernel's code apart, and Linux aborts a process past its bound
    of memory maps (`vm.max_map_count`): the background compiles while the maps left hold twice
    the most a compile took besides a tenth of the bound; then it compiles nothing more (each
    key refused, once), and the stand-ins serve. Here each compile takes 100 of 1,000 maps."""
    variable, held = tf.Variable(tf.zeros([8])), {"maps": 500}
    programs = Programs(mapping(variable, held), [variable], maps=lambda: (held["maps"], 1000))
    programs.warm([key(8, 4)])
    assert programs.most == 100 and held["maps"] == 600
    for n in (1, 2, 3):
        programs.ready(key(n, 1))
    assert programs.idle(timeout=120) and programs.count("background") == 2 and held["maps"] == 800
    assert programs.refused == {key(3, 1)} and programs.pending == 0  # 800 + 2 x 100 + 100 > 1000
    assert programs.ready(key(3, 1))[0] == key(8, 4) and programs.ready(key(5, 1))[0] == key(8, 4)
    assert programs.refused == {key(3, 1), key(5, 1)} and programs.pending == 0 and programs.worker is None
    assert int(programs.ready(key(5, 1))[1](tf.ones([8]))) == 4  # the stand-in runs the step
    if sys.platform.startswith("linux"):  # what the server's programs count by default
        used, limit = memory_maps()
        assert 0 < used < limit


def test_the_warm_up_compiles_what_holds_every_step_then_the_rest_while_the_memory_maps_leave_room():
    """A model of more layers takes more memory maps a program (a 16-row step over 1024
    positions: about 3,000 at 12 layers, 5,300 at 24), so a larger model's whole warm-up would
    pass the bound: the programs that hold every step compile first, whatever the maps; the
    others while the maps leave room, as the background's; the rest are refused, and stand-ins
    serve them. Here each compile takes 100 of 1,000 maps."""
    variable, held = tf.Variable(tf.zeros([8])), {"maps": 500}
    programs = Programs(mapping(variable, held), [variable], maps=lambda: (held["maps"], 1000))
    programs.warm([key(1, 1), key(8, 4), key(2, 1), key(4, 1)], needed=[key(8, 4)])
    assert list(programs) == [key(8, 4), key(1, 1), key(2, 1)] and programs.count("warmup") == 3
    assert programs.refused == {key(4, 1)} and held["maps"] == 800
    assert programs.ready(key(4, 1))[0] == key(8, 4) and programs.pending == 0 and programs.worker is None
