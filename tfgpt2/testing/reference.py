"""Run OpenAI's original `src/` (unmodified, TensorFlow 1 code) for side-by-side comparisons.

The original needs `tf.compat.v1` with v2 behaviour disabled and a stand-in for
`tensorflow.contrib.training.HParams`. Disabling v2 behaviour is process-wide and cannot be
fully undone, so the reference runs in a child process (this file run as a script, so that
the child imports nothing of tfgpt2 or Keras) and arrays travel over a pipe: the calling
process keeps TensorFlow 2 untouched.

    with Reference("path/to/gpt-2/src", "models/124M") as ref:
        out = ref.model(tokens)                 # {'logits', 'present', 'hidden'} as numpy
        tokens, seconds = ref.sample_sequence(context=tokens[:1], length=20, top_k=1)
        grads = ref.gradients(windows)["gradients"]   # the forks' loss, tf.gradients per variable
"""
import os
import pickle
import subprocess
import sys
import tempfile

import numpy as np


class ReferenceError(RuntimeError):
    """The reference process failed; the message carries its error and log tail."""


class Reference:
    """A child process that holds OpenAI's graph for one model folder."""

    def __init__(self, reference_src, model_dir):
        reference_src = os.path.abspath(reference_src)
        if not os.path.isfile(os.path.join(reference_src, "model.py")):
            raise FileNotFoundError(f"{reference_src}: no model.py (expected the original gpt-2 repository's src/)")
        if not os.path.isfile(os.path.join(model_dir, "hparams.json")):
            raise FileNotFoundError(f"{model_dir}: no hparams.json (expected a model folder)")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        self._log = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen(
            # -I: isolated, so that sys.path holds neither this folder nor the caller's PYTHONPATH
            [sys.executable, "-I", os.path.abspath(__file__), reference_src, os.path.abspath(model_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env)

    def _call(self, op, **kwargs):
        try:
            pickle.dump((op, kwargs), self._proc.stdin)
            self._proc.stdin.flush()
            ok, result = pickle.load(self._proc.stdout)
        except (EOFError, BrokenPipeError, pickle.UnpicklingError):
            ok, result = False, f"the reference process exited (code {self._proc.poll()})"
        if not ok:
            self._log.seek(0)
            tail = "".join(self._log.readlines()[-20:])
            raise ReferenceError(f"reference {op} failed: {result}\n--- reference log ---\n{tail}")
        return result

    def model(self, tokens, past=None, *, hidden=False):
        """The original `model.model(hparams, X, past)` on the folder's checkpoint; with `hidden`,
        also 'hidden' [batch, n_layer, T, n_embd]: each block's output."""
        past = None if past is None else np.asarray(past, np.float32)
        return self._call("model", tokens=np.asarray(tokens, np.int32), past=past, hidden=hidden)

    def sample_sequence(self, *, length, context=None, start_token=None, batch_size=None,
                        temperature=1, top_k=0, top_p=1, seed=None, repeats=1):
        """The original `sample.sample_sequence` in a fresh graph seeded with `seed`: returns
        (tokens, [seconds per run]) for `repeats` runs (each seconds is one `sess.run`)."""
        if context is not None:
            context = np.asarray(context, np.int32)
            batch_size = context.shape[0]
        return self._call("sample", length=length, context=context, start_token=start_token,
                          batch_size=batch_size, temperature=temperature, top_k=top_k,
                          top_p=top_p, seed=seed, repeats=repeats)

    def gradients(self, tokens, weights=None):
        """The forks' loss on windows `tokens` [batch, length] and its `tf.gradients` for every
        trainable variable: {'loss', 'gradients': {name: array}}. `weights` (name -> array)
        replaces the folder's checkpoint."""
        return self._call("gradients", tokens=np.asarray(tokens, np.int32), weights=weights)

    def adam_steps(self, batches, learning_rate, weights=None):
        """One `tf.compat.v1.train.AdamOptimizer(learning_rate)` step of the forks' loss per
        batch: {'losses': [...], 'weights': {name: array}} after the last."""
        return self._call("adam", batches=np.asarray(batches, np.int32), learning_rate=learning_rate,
                          weights=weights)

    @property
    def pid(self):
        """The child process (for measuring its memory)."""
        return self._proc.pid

    def close(self):
        if self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=60)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- the child process ------------------------------------------------------------------

def _import_original(reference_src):
    """Import the original `model` and `sample` modules under tf.compat.v1."""
    import types

    import tensorflow.compat.v1 as tf
    tf.disable_v2_behavior()
    # The oracle computes in float32 on every device: no TensorFloat-32 (on by default on NVIDIA
    # GPUs from Ampere on) in this process of its own
    tf.config.experimental.enable_tensor_float_32_execution(False)

    class HParams:
        """Stand-in for tensorflow.contrib.training.HParams (attributes + override_from_dict)."""

        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

        def override_from_dict(self, values):
            self.__dict__.update(values)
            return self

    training = types.ModuleType("tensorflow.contrib.training")
    training.HParams = HParams
    contrib = types.ModuleType("tensorflow.contrib")
    contrib.training = training
    sys.modules.update({"tensorflow": tf, "tensorflow.contrib": contrib,
                        "tensorflow.contrib.training": training})
    sys.path.insert(0, reference_src)
    import model
    import sample
    return tf, model, sample


class _Worker:
    def __init__(self, reference_src, model_dir):
        import json
        self.tf, self.model, self.sample = _import_original(reference_src)
        self.model_dir = model_dir
        self.hparams = self.model.default_hparams()
        with open(os.path.join(model_dir, "hparams.json")) as f:
            self.hparams.override_from_dict(json.load(f))
        self.graph = None

    def _restore(self, sess):
        self.tf.train.Saver().restore(sess, self.tf.train.latest_checkpoint(self.model_dir))

    def _build_model_graph(self):
        """One graph with the model called without and with `past`, variables shared; each
        block's output is recorded by wrapping the original `block` function."""
        tf, model = self.tf, self.model
        graph = tf.Graph()
        blocks = []
        original_block = model.block

        def recording_block(*args, **kwargs):
            x, present = original_block(*args, **kwargs)
            blocks[-1].append(x)
            return x, present

        model.block = recording_block
        try:
            with graph.as_default():
                self.X = tf.placeholder(tf.int32, [None, None])
                self.past = tf.placeholder(tf.float32, model.past_shape(hparams=self.hparams))
                blocks.append([])
                self.out = model.model(self.hparams, self.X, reuse=tf.AUTO_REUSE)
                self.out["hidden"] = tf.stack(blocks[-1], axis=1)
                blocks.append([])
                self.out_past = model.model(self.hparams, self.X, past=self.past, reuse=tf.AUTO_REUSE)
                self.out_past["hidden"] = tf.stack(blocks[-1], axis=1)
                self.sess = tf.Session(graph=graph)
                self._restore(self.sess)
        finally:
            model.block = original_block
        self.graph = graph

    def op_model(self, tokens, past, hidden):
        if self.graph is None:
            self._build_model_graph()
        fetches = self.out if past is None else self.out_past
        fetches = {k: v for k, v in fetches.items() if hidden or k != "hidden"}
        feed = {self.X: tokens} if past is None else {self.X: tokens, self.past: past}
        return self.sess.run(fetches, feed)

    def _training_graph(self):
        """A graph with the model on X [batch, length] and the forks' loss, in a session whose
        variables are not yet set."""
        tf = self.tf
        graph = tf.Graph()
        with graph.as_default():
            X = tf.placeholder(tf.int32, [None, None])
            logits = self.model.model(self.hparams, X)["logits"]
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=X[:, 1:], logits=logits[:, :-1]))
        return graph, X, loss

    def _set_weights(self, sess, weights):
        if weights is None:
            self.tf.train.Saver(var_list=self.tf.trainable_variables()).restore(
                sess, self.tf.train.latest_checkpoint(self.model_dir))
        else:
            for v in self.tf.trainable_variables():
                v.load(weights[v.op.name], sess)

    def op_gradients(self, tokens, weights):
        tf = self.tf
        graph, X, loss = self._training_graph()
        with graph.as_default(), tf.Session(graph=graph) as sess:
            variables = tf.trainable_variables()
            grads = [tf.convert_to_tensor(g) for g in tf.gradients(loss, variables)]  # wte: IndexedSlices
            self._set_weights(sess, weights)
            value, grads = sess.run((loss, grads), {X: tokens})
        return {"loss": value, "gradients": {v.op.name: g for v, g in zip(variables, grads)}}

    def op_adam(self, batches, learning_rate, weights):
        tf = self.tf
        graph, X, loss = self._training_graph()
        with graph.as_default(), tf.Session(graph=graph) as sess:
            train = tf.train.AdamOptimizer(learning_rate).minimize(loss)
            sess.run(tf.global_variables_initializer())
            self._set_weights(sess, weights)
            losses = [sess.run((loss, train), {X: batch})[0] for batch in batches]
            variables = tf.trainable_variables()
            values = sess.run(variables)
        return {"losses": losses, "weights": {v.op.name: x for v, x in zip(variables, values)}}

    def op_sample(self, length, context, start_token, batch_size, temperature, top_k, top_p, seed, repeats):
        import time
        tf = self.tf
        with tf.Session(graph=tf.Graph()) as sess:
            tf.set_random_seed(seed)
            ctx = None if context is None else tf.placeholder(tf.int32, [batch_size, None])
            output = self.sample.sample_sequence(
                hparams=self.hparams, length=length, start_token=start_token, batch_size=batch_size,
                context=ctx, temperature=temperature, top_k=top_k, top_p=top_p)
            self._restore(sess)
            feed = {} if ctx is None else {ctx: context}
            seconds = []
            for _ in range(repeats):
                start = time.perf_counter()
                tokens = sess.run(output, feed)
                seconds.append(time.perf_counter() - start)
        return tokens, seconds


def _serve(reference_src, model_dir):
    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything the reference prints goes to the log, not the pipe
    requests = sys.stdin.buffer
    try:
        worker = _Worker(reference_src, model_dir)
    except Exception as e:  # reported on the first request
        worker, startup_error = None, f"{type(e).__name__}: {e}"
    while True:
        try:
            op, kwargs = pickle.load(requests)
        except EOFError:
            return
        try:
            if worker is None:
                raise RuntimeError(startup_error)
            reply = (True, getattr(worker, f"op_{op}")(**kwargs))
        except Exception as e:
            reply = (False, f"{type(e).__name__}: {e}")
        pickle.dump(reply, channel)
        channel.flush()


if __name__ == "__main__":
    _serve(*sys.argv[1:3])
