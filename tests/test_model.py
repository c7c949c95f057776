"""The Keras model against OpenAI's own graph on the same checkpoint, and its input checks."""

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import ATOL, all_nodes, require_reference
from tfgpt2 import GPT2, load_model
from tfgpt2.decoding.cache import padded_mask
from tfgpt2.hparams import default_hparams
from tfgpt2 import model as model_module
from tfgpt2.formats.variables import variable_shapes
from tfgpt2.model import attn_probs, gelu, normalize, past_shape
from tfgpt2.train.losses import window_loss
from tfgpt2.sample import sample_sequence
from tfgpt2.testing.reference import Reference

pytestmark = pytest.mark.own_process  # its programs compiled in a process of its own (tests/own_process.py)


def assert_close(ours, theirs, what):
    ours = np.asarray(ours)
    assert ours.shape == theirs.shape, f"{what}: shape {ours.shape} vs reference {theirs.shape}"
    diff = np.abs(ours - theirs)
    rel = (diff / np.maximum(np.abs(theirs), 1e-3)).max()
    assert diff.max() <= ATOL, f"{what}: max abs diff {diff.max():.3g} (max rel {rel:.3g}) > {ATOL}"


def random_tokens(seed, batch, length, n_vocab):
    return np.random.default_rng(seed).integers(0, n_vocab, size=(batch, length), dtype=np.int32)


@pytest.fixture(scope="module", params=["tiny_dir", "wide_dir", "gpt2_124m_dir"])
def pair(request):
    """(our model, the reference process) on one model folder."""
    require_reference()
    if request.param == "gpt2_124m_dir":  # both once per worker
        yield request.getfixturevalue("gpt2_124m"), request.getfixturevalue("reference_124m")
    elif request.param == "tiny_dir":
        yield load_model(request.getfixturevalue("tiny_dir")), request.getfixturevalue("reference_tiny")
    else:
        model_dir = request.getfixturevalue(request.param)
        with Reference(str(require_reference()), model_dir) as ref:
            yield load_model(model_dir), ref


@pytest.mark.slow
@pytest.mark.parametrize("length", [1, 4, 17])
def test_logits_and_present_match_reference(pair, length):
    model, ref = pair
    tokens = random_tokens(length, 2, length, model.hparams.n_vocab)
    theirs = ref.model(tokens)
    ours = model(tokens)
    assert ours["logits"].shape == (2, length, model.hparams.n_vocab)
    assert np.abs(theirs["logits"]).max() > 3, "weights too small for a meaningful comparison"
    assert_close(ours["logits"], theirs["logits"], "logits")
    assert_close(ours["present"], theirs["present"], "present")


@pytest.mark.slow
def test_greedy_matches_reference_124m(gpt2_124m, reference_124m):
    """Generation (tfgpt2.sample_sequence), kept beside the 124M comparisons so that one worker
    starts the 124M reference. Batch 2, 32 new tokens; the reference's sample_sequence only runs
    at batch 1 (its top_p_logits fails above), so each of our rows is compared with the
    reference on that row."""
    model, ref = gpt2_124m, reference_124m
    context = random_tokens(0, 2, 5, model.hparams.n_vocab)
    ours = sample_sequence(model=model, context=context, length=32, top_k=1, seed=0)
    assert ours.shape == (2, 5 + 32)
    for row in range(2):
        theirs, _ = ref.sample_sequence(context=context[row:row + 1], length=32, top_k=1, seed=0)
        np.testing.assert_array_equal(ours[row], theirs[0], err_msg=f"row {row}")
        if row == 0:  # alone: at batch 1, 32 >= TRANSPOSE_FROM new tokens run on the split products
            alone = sample_sequence(model=model, context=context[:1], length=32, top_k=1, seed=0)
            np.testing.assert_array_equal(alone[0], theirs[0], err_msg="row 0 alone")
    assert len(set(ours[0, 5:].tolist())) > 5, "degenerate continuation; weights too small?"


@pytest.mark.slow
@pytest.mark.parametrize("split", [1, 6])
def test_past_matches_reference(pair, split):
    """A prompt fed in two calls, the second with `past`, against the reference fed the same past."""
    model, ref = pair
    tokens = random_tokens(split + 100, 2, 9, model.hparams.n_vocab)
    first = model(tokens[:, :split])
    ours = model(tokens[:, split:], past=first["present"])
    theirs = ref.model(tokens[:, split:], past=ref.model(tokens[:, :split])["present"])
    assert_close(ours["logits"], theirs["logits"], "logits with past")
    assert_close(ours["present"], theirs["present"], "present with past")
    # and the same as one call over the whole prompt
    whole = model(tokens)
    assert_close(ours["logits"], whole["logits"].numpy()[:, split:], "logits with past vs without")


def test_variables_named_and_shaped_as_checkpoint():
    hp = default_hparams().override_from_dict(dict(n_vocab=100, n_ctx=16, n_embd=32, n_head=4, n_layer=3))
    for tie in (True, False):
        model = GPT2(hp, tie_embeddings=tie)
        assert {v.path: list(v.shape) for v in model.weights} == variable_shapes(hp, tie_embeddings=tie)
    assert variable_shapes(hp)["model/h0/attn/c_attn/w"] == [1, 32, 96]


def test_tied_output_layer_owns_no_variable():
    hp = default_hparams().override_from_dict(dict(n_vocab=100, n_ctx=16, n_embd=32, n_head=4, n_layer=1))
    tied, untied = GPT2(hp), GPT2(hp, tie_embeddings=False)
    assert len(untied.weights) == len(tied.weights) + 1
    assert "model/out_head" not in {v.path for v in tied.weights}
    # the tied logits are h . wte^T: changing wte's row 7 changes only logit 7's dependence
    tokens = np.array([[1, 2, 3]])
    before = tied(tokens)["logits"].numpy()
    tied.wte.assign(tf.tensor_scatter_nd_add(tied.wte, [[7]], tf.ones([1, 32])))
    after = tied(tokens)["logits"].numpy()
    changed = np.flatnonzero(np.abs(after - before).max(axis=(0, 1)) > 0)
    assert changed.tolist() == [7]
    # untied: the head is separate, so perturbing it leaves the embedding path alone
    untied_before = untied(tokens)["logits"].numpy()
    untied.out_head.assign(untied.out_head * 2)
    np.testing.assert_allclose(untied(tokens)["logits"].numpy(), untied_before * 2, rtol=1e-5, atol=1e-5)


def test_past_shape():
    hp = default_hparams()
    assert past_shape(hparams=hp, batch_size=2, sequence=5) == [2, 12, 2, 12, 5, 64]
    assert past_shape(hparams=hp) == [None, 12, 2, 12, None, 64]


@pytest.fixture(scope="module")
def small_model():
    hp = default_hparams().override_from_dict(dict(n_vocab=100, n_ctx=16, n_embd=32, n_head=4, n_layer=2))
    return GPT2(hp)


@pytest.mark.parametrize("bad_id", [-1, 100, 12345])
def test_out_of_range_token_ids_raise(small_model, bad_id):
    tokens = np.array([[1, 2, bad_id]])
    with pytest.raises(tf.errors.InvalidArgumentError, match="token ids must be"):
        small_model(tokens)
    traced = tf.function(lambda x: small_model(x)["logits"])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"token ids must be"):
        traced(tf.constant(tokens))
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"in \[0, n_vocab=100\); got\] \[{bad_id}\]"):
        traced(tf.constant(tokens))


def test_input_longer_than_context_raises(small_model):
    with pytest.raises(ValueError, match="n_ctx=16"):
        small_model(np.zeros([1, 17], np.int32))
    past = small_model(np.zeros([1, 10], np.int32))["present"]
    with pytest.raises(tf.errors.InvalidArgumentError, match="n_ctx=16"):
        small_model(np.zeros([1, 7], np.int32), past=past)
    traced = tf.function(lambda x: small_model(x)["logits"],
                         input_signature=[tf.TensorSpec([None, None], tf.int32)])
    with pytest.raises(tf.errors.InvalidArgumentError, match="n_ctx=16"):
        traced(tf.zeros([1, 17], tf.int32))
    assert traced(tf.zeros([1, 16], tf.int32)).shape == (1, 16, 100)


@pytest.mark.slow
def test_compiled_call_poisons_rows_it_cannot_refuse(small_model):
    """Under XLA asserts are dropped and tf.gather clamps; a bad row comes out NaN, the
    others as computed without it."""
    compiled = tf.function(lambda x: small_model(x)["logits"], jit_compile=True)
    good = np.array([[1, 2]])
    for bad in ([1, 100], [1, -5], [1, 60000]):
        logits = compiled(tf.constant(np.array([bad, [1, 2]], np.int32))).numpy()
        assert np.isnan(logits[0]).all(), f"ids {bad} gave numbers under XLA"
        np.testing.assert_allclose(logits[1], small_model(good)["logits"].numpy()[0], atol=1e-5, rtol=0)
    step = tf.function(lambda x, past: small_model(x, past)["logits"], jit_compile=True)
    past = small_model(np.zeros([1, 15], np.int32))["present"]
    assert np.isnan(step(tf.zeros([1, 2], tf.int32), past).numpy()).all(), "position 16 of n_ctx=16 under XLA"
    assert np.isfinite(step(tf.zeros([1, 1], tf.int32), past).numpy()).all()


@pytest.mark.parametrize("tokens", [[[1, 2, 3]], np.array([[1, 2, 3]]), np.array([[1, 2, 3]], np.int64),
                                    tf.constant([[1, 2, 3]])])
def test_lists_arrays_and_tensors_are_token_ids(small_model, tokens):
    out = small_model(tokens)
    assert out["logits"].shape == (1, 3, 100)
    np.testing.assert_allclose(out["logits"].numpy(), small_model(tf.constant([[1, 2, 3]]))["logits"].numpy())


@pytest.mark.parametrize("tokens, message", [
    ([1, 2, 3], r"token ids must be \[batch, time\], got shape \[3\]"),
    ([[1, 2], [3]], "rows of equal length"),
    ([[1.5, 2.0]], "token ids must be integers, got dtype float64"),
    (tf.constant([[1.0]]), "token ids must be integers, got dtype float32"),
    (np.zeros([1, 2, 3], np.int32), r"got shape \[1, 2, 3\]"),
])
def test_malformed_token_ids_fail_naming_them(small_model, tokens, message):
    with pytest.raises(ValueError, match=message):
        small_model(tokens)


@pytest.mark.parametrize("shape", [[1, 3, 2, 4, 5, 8], [1, 2, 2, 2, 5, 8], [2, 2, 2, 4, 5, 8], [1, 2, 2, 4, 5]])
def test_past_of_the_wrong_shape_fails_naming_both_shapes(small_model, shape):
    """Expected [1, 2, 2, 4, T, 8] for batch 1 of the small model."""
    with pytest.raises(ValueError, match=r"past must be \[batch, n_layer, 2, n_head, sequence, n_embd // n_head\] "
                                         r"= \[1, 2, 2, 4, '\?', 8\], got shape"):
        small_model(np.zeros([1, 2], np.int32), past=np.zeros(shape, np.float32))


def value_and_gradient(f, x, weight):
    """f(x) and the gradient of sum(f(x) * weight) with respect to x, as arrays."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = f(x)
        loss = tf.reduce_sum(y * weight)
    return y.numpy(), tape.gradient(loss, x).numpy()


@pytest.mark.parametrize("dtype, rtol", [(tf.float64, 1e-12), (tf.float32, 1e-5)])
def test_norm_gradient_is_autodiffs(dtype, rtol):
    """normalize's written-out gradient against TensorFlow's own of the same formula."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(2.0, 3.0, [3, 5, 64]), dtype)
    weight = tf.constant(rng.normal(size=[3, 5, 64]), dtype)

    def plain(x, epsilon):
        u = tf.reduce_mean(x, axis=-1, keepdims=True)
        return (x - u) * tf.math.rsqrt(tf.reduce_mean(tf.square(x - u), axis=-1, keepdims=True) + epsilon)
    grads = [value_and_gradient(lambda x: f(x, 1e-5), x, weight)[1] for f in (normalize, plain)]
    np.testing.assert_allclose(grads[0], grads[1], rtol=rtol, atol=rtol * np.abs(grads[1]).max())


@pytest.mark.parametrize("dtype, atol", [(tf.float32, 1e-5), (tf.bfloat16, 2e-2)])
def test_gelu_gradient_is_autodiffs(dtype, atol):
    """gelu's written-out gradient (one XLA program, in float32) against autodiff of the same
    formula in float64, over the range where its slope bends (negative below 0), and the
    same values as the formula in float32, rounded once to the dtype. Measured in float32:
    3.5e-6 off (autodiff's own: 4.2e-6)."""
    x = tf.cast(tf.linspace(-6.0, 6.0, 4001), dtype)
    weight = tf.cast(tf.sin(tf.range(4001, dtype=tf.float32)), dtype)

    def plain(x):
        return 0.5 * x * (1 + tf.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * tf.pow(x, 3))))
    value, grad = value_and_gradient(gelu, x, weight)
    _, exact = value_and_gradient(plain, tf.cast(x, tf.float64), tf.cast(weight, tf.float64))
    assert value.dtype == grad.dtype == dtype.as_numpy_dtype
    np.testing.assert_array_equal(value, tf.cast(plain(tf.cast(x, tf.float32)), dtype).numpy())
    np.testing.assert_allclose(grad.astype(np.float64), exact, rtol=0, atol=atol)
    assert exact.min() < -0.05 and exact.max() > 1


@pytest.mark.parametrize("pad", [None, [0, 3]])
def test_attn_probs_gradient_is_autodiffs(pad):
    """attn_probs' written-out gradient (one XLA program) and its values against autodiff of
    the original's operations (scale, mask_attn_weights, exp(w - max) / sum), in float32,
    with the causal mask and with left padding."""
    rng = np.random.default_rng(0)
    w = tf.constant(rng.normal(0.0, 8.0, [2, 3, 5, 7]), tf.float32)
    weight = tf.constant(rng.normal(size=[2, 3, 5, 7]), tf.float32)
    mask = padded_mask(5, 7, dtype=tf.float32, pad=None if pad is None else tf.constant(pad))
    b = mask[None, None] if pad is None else mask[:, None]

    def plain(w):
        w = w * tf.math.rsqrt(tf.constant(4.0))
        w = w * b - 1e10 * (1 - b)
        ex = tf.exp(w - tf.reduce_max(w, axis=-1, keepdims=True))
        return ex / tf.reduce_sum(ex, axis=-1, keepdims=True)
    values, grads = zip(*(value_and_gradient(f, w, weight) for f in (lambda w: attn_probs(w, mask, 4), plain)))
    np.testing.assert_allclose(values[0], values[1], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-5 * np.abs(grads[1]).max())
    masked = ~np.broadcast_to(b.numpy(), grads[0].shape).astype(bool)
    assert np.abs(grads[0]).max() > 0.1 and not grads[0][masked].any() and masked.any()


def graph_of_gradient(model, tokens):
    """The graph (GraphDef, nested functions in its library) of the window loss's gradient, as
    training traces it; nothing compiled."""
    @tf.function
    def gradients(tokens):
        with tf.GradientTape() as tape:
            loss = window_loss(model, tokens)
        return tape.gradient(loss, model.trainable_variables)
    concrete = gradients.get_concrete_function(tokens)
    return concrete.graph, concrete.graph.as_graph_def()


def op_types(graph_def):
    return [n.op for n in all_nodes(graph_def)]


def test_the_gradient_uses_the_written_out_gradients(monkeypatch):
    """Training's gradient holds `normalize`'s, `gelu`'s and `attn_probs`' written-out
    gradients, not autodiff's (its RsqrtGrad and TanhGrad ops). Autodiff's norm gradient let
    XLA fuse each block's norm gradient, recomputed, into every block below it (fusions of 107
    operands at 6 blocks, 205 at 12, in XLA's optimized program: a figure of XLA's version, for
    the benchmarks). And the check itself: with autodiff's norm, RsqrtGrad is there."""
    hp = default_hparams().override_from_dict(dict(n_vocab=512, n_ctx=32, n_embd=64, n_head=4, n_layer=2))
    tokens = tf.constant(random_tokens(0, 2, 17, hp.n_vocab))
    _, graph_def = graph_of_gradient(GPT2(hp), tokens)
    ops = op_types(graph_def)
    assert "Rsqrt" in ops and "Tanh" in ops and not {"RsqrtGrad", "TanhGrad"} & set(ops)
    functions = " ".join(f.signature.name for f in graph_def.library.function)
    assert "gelu_grad" in functions and "attn_probs_grad" in functions, functions

    def autodiffs_norm(x, epsilon):
        u = tf.reduce_mean(x, axis=-1, keepdims=True)
        return (x - u) * tf.math.rsqrt(tf.reduce_mean(tf.square(x - u), axis=-1, keepdims=True) + epsilon)
    monkeypatch.setattr(model_module, "normalize", autodiffs_norm)
    assert "RsqrtGrad" in op_types(graph_of_gradient(GPT2(hp), tokens)[1])


def ancestors(tensor):
    """Every op a tensor's value depends on, through data and control inputs."""
    seen, todo = set(), [tensor.op]
    while todo:
        op = todo.pop()
        if op not in seen:
            seen.add(op)
            todo.extend([t.op for t in op.inputs] + list(op.control_inputs))
    return seen


@pytest.mark.parametrize("remat", [False, True])
def test_the_attention_mask_is_computed_from_the_input(remat, monkeypatch):
    """The model's attention mask depends on its input tokens in the traced graph, so that it
    is computed at run time: a mask known while tracing (its shape is) is folded into a constant,
    of which XLA's bridge gave every op reading it a copy of its own (3 a block, 5 with remat:
    124M's remat step at 1 x 1023 tokens compiled 60 of 4 MB). And the check itself: a mask of
    the static shape alone depends on no input."""
    hp = default_hparams().override_from_dict(dict(n_vocab=512, n_ctx=32, n_embd=64, n_head=4, n_layer=2))
    model = GPT2(hp, remat=remat)
    tokens = tf.constant(random_tokens(0, 1, 25, hp.n_vocab))
    masks, original = [], model_module.attention_mask
    monkeypatch.setattr(model_module, "attention_mask", lambda *a, **k: masks.append(original(*a, **k)) or masks[-1])
    graph, _ = graph_of_gradient(model, tokens)
    assert len(masks) == 1 and masks[0].shape == (24, 24)
    assert graph.inputs[0].op in ancestors(masks[0]), "the mask is a constant of the traced graph"
    with graph.as_default():
        constant = original(24, 24, dtype=tf.float32)
    assert not [op for op in ancestors(constant) if op.type == "Placeholder"]
