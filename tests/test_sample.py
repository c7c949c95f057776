"""Sampling and the compiled generation loop: against the reference, against the uncached
model, and the statistics of top-k, top-p and temperature."""
import concurrent.futures
import dataclasses
import gc
import logging
import re
import weakref

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
import tensorflow as tf
from tensorflow.compiler.xla import xla_data_pb2

from tests.helpers import ATOL, all_nodes, chi_square, filtered_softmax, prompts_for
from tfgpt2 import kernels, load_model
from tfgpt2.model import Conv1D
from tfgpt2.products import cpus_only
from tfgpt2.decoding import layouts
from tfgpt2.decoding.cache import call_with_cache, empty_cache, project
from tfgpt2.decoding.layouts import SPLIT_K, transpose_pays
from tfgpt2.decoding.generator import Generator, generator_for
from tfgpt2.decoding.buckets import bucket_sizes
from tfgpt2.decoding import batch as whole_batch
from tfgpt2.decoding import step
from tfgpt2.decoding.request import check_request
from tfgpt2.decoding import sampler
from tfgpt2.decoding.sampler import CDF_BLOCK, choose, inverse_cdf
from tfgpt2.sample import generate, sample_sequence, top_k_logits, top_p_logits
from tfgpt2.seeds import seed_of

BF16_STEP = 2 ** -7  # bfloat16's rounding step, relative (8 significant bits)

pytestmark = pytest.mark.own_process  # it compiles hundreds of programs (tests/own_process.py)


def assert_greedy(model, prompt, row):
    """`row` is `prompt` and its greedy continuation by the model without a cache: each new
    token the argmax of the logits after the tokens before it, all read from one forward pass
    over the row (causal, so the same as a pass over each prefix)."""
    row = np.asarray(row)
    assert row[:len(prompt)].tolist() == list(prompt)
    logits = model(row[None, :-1])["logits"].numpy()[0, len(prompt) - 1:]
    np.testing.assert_array_equal(row[len(prompt):], logits.argmax(-1))


# ---- the cache path against the uncached model ----------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("pad", [0, 3])
def test_cached_steps_equal_full_forward(tiny, pad):
    """Prefill then one token at a time through the fixed-size cache, at every position,
    against one uncached pass over the whole sequence; with and without left padding."""
    tokens = np.array(prompts_for(1, [12, 12]))
    full = tiny(tokens)["logits"].numpy()
    pads = tf.constant([pad, pad])
    padded = np.concatenate([np.zeros([2, pad], np.int64), tokens[:, :5]], axis=1)
    logits, cache = call_with_cache(tiny, tf.constant(padded), empty_cache(tiny, 2, 32), 0, pad=pads)
    np.testing.assert_allclose(logits.numpy(), full[:, 4], atol=ATOL, rtol=0)
    for t in range(5, 12):
        logits, cache = call_with_cache(tiny, tf.constant(tokens[:, t:t + 1]), cache, pad + t, pad=pads)
        np.testing.assert_allclose(logits.numpy(), full[:, t], atol=ATOL, rtol=0, err_msg=f"position {t}")


def test_past_is_the_originals_and_generation_leaves_it_alone(tiny):
    """`past`/`present` stay the original's 6-D tensors; the cache is another argument."""
    tokens = np.array(prompts_for(13, [6]))
    first = tiny(tokens[:, :4])
    assert first["present"].shape == (1, tiny.hparams.n_layer, 2, tiny.hparams.n_head, 4, 16)
    later = tiny(tokens[:, 4:], first["present"])
    np.testing.assert_allclose(later["logits"].numpy(), tiny(tokens)["logits"].numpy()[:, 4:], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="past must be"):
        tiny(tokens[:, 4:], empty_cache(tiny, 1, 8))


@pytest.mark.slow
@pytest.mark.parametrize("jit_compile", [True, False])
def test_compiled_greedy_equals_uncached_greedy(tiny, jit_compile):
    prompt = prompts_for(2, [4])[0]
    ours = generate(tiny, [prompt], 20, top_k=1, jit_compile=jit_compile)[0]
    assert len(ours) == len(prompt) + 20
    assert_greedy(tiny, prompt, ours)
    for at in (len(prompt), -1):  # the check itself: one token changed fails it
        wrong = ours.copy()
        wrong[at] = (wrong[at] + 1) % tiny.hparams.n_vocab
        with pytest.raises(AssertionError):
            assert_greedy(tiny, prompt, wrong)


@pytest.mark.slow
def test_weight_layouts_give_the_same_logits(wide_dir):
    """The [nf, nx] copies and the split products generation uses on a CPU: prefill and one
    cached step under XLA, against the model's own weights (on any device: the layout is
    passed explicitly; the split applies to the one-row step)."""
    model = load_model(wide_dir)
    hp = model.hparams
    weights = layouts.transposed(model)
    assert [tuple(w.shape) for w in weights[0]] == [
        (3 * hp.n_embd, hp.n_embd), (hp.n_embd, hp.n_embd), (4 * hp.n_embd, hp.n_embd), (hp.n_embd, 4 * hp.n_embd)]

    @tf.function(jit_compile=True, autograph=False)
    def two_steps(tokens, weights):
        logits, cache = call_with_cache(model, tokens[:, :5], empty_cache(model, 1, 16), 0, layouts=weights)
        return logits, call_with_cache(model, tokens[:, 5:6], cache, 5, layouts=weights)[0]

    tokens = np.array(prompts_for(11, [6]))
    full = model(tokens)["logits"].numpy()
    for weights_used in (weights, layouts.split(model, SPLIT_K), layouts.split(model, 3), None):  # 3: nx % 3, plain
        prefill, step = two_steps(tf.constant(tokens), weights_used)
        np.testing.assert_allclose(prefill.numpy()[0], full[0, 4], atol=ATOL, rtol=0)
        np.testing.assert_allclose(step.numpy()[0], full[0, 5], atol=ATOL, rtol=0)


@pytest.mark.slow
def test_a_16_bit_models_generation_holds_its_cache_in_float32_under_xla_on_a_cpu(wide_dir):
    """Under XLA on a CPU a bfloat16 model's generation holds its cache in float32
    (`cache.slot_dtype`: XLA's CPU backend would convert a 16-bit cache whole at each step), its
    bfloat16 values exactly: the prompt's keys and values as a bfloat16 cache holds them, and the
    next step's logits over it those over a bfloat16 cache. Without XLA it holds bfloat16."""
    if not cpus_only():
        pytest.skip("the cache is held in float32 under XLA on a CPU only")
    model = load_model(wide_dir, dtype="bfloat16")
    prompt_len, generator, (weights, prompt, pad, tokens, _, controls) = loop_args(model, 1, 6, 16)
    prompt = tf.constant(prompts_for(11, [prompt_len]))
    held = generator.start(weights, prompt, pad, tokens, controls)["cache"]
    assert {part.dtype for layer in held for part in layer} == {tf.float32}
    plain = generator_for(model, jit_compile=False).start((None, None), prompt, pad, tokens, controls)["cache"]
    assert {part.dtype for layer in plain for part in layer} == {tf.bfloat16}  # TensorFlow's kernels read 16 bits

    @tf.function(jit_compile=True, autograph=False)
    def prompt_then_step(cache):
        _, cache = call_with_cache(model, prompt[:, :-1], cache, 0)
        return cache, call_with_cache(model, prompt[:, -1:], cache, prompt_len - 1)[0]

    own, logits = prompt_then_step(empty_cache(model, 1, tokens.shape[1]))
    assert {part.dtype for layer in own for part in layer} == {tf.bfloat16}
    for held_part, own_part in zip(tf.nest.flatten(held), tf.nest.flatten(own)):
        np.testing.assert_array_equal(held_part.numpy(), tf.cast(own_part, tf.float32).numpy())
    _, widened = prompt_then_step(empty_cache(model, 1, tokens.shape[1], tf.float32))
    assert np.abs(logits.numpy()).max() > 1  # logits of std 0.1 weights, not near-uniform ones
    np.testing.assert_allclose(widened.numpy(), logits.numpy(), atol=BF16_STEP * np.abs(logits.numpy()).max(), rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("rows", [False, True], ids=["xla", "row-kernels"])
def test_a_16_bit_models_one_row_reads_its_transposed_copy_as_its_own_weights(wide_dir, rows):
    """`layouts.one_row16`: a bfloat16 model's block weights as [nf, nx] in bfloat16, attention's
    c_proj as a float32 [nx, nf]; `layouts.rows`: each as [nf, nx] in bfloat16, read by the row
    kernels (`layouts.Rows`); a cached step at one row that reads them under XLA gives the
    logits of the step that reads the layers' own weights, to a rounding of the bfloat16 logits
    (the products sum in another order); so do a prompt and a step that read `layouts.widened`."""
    if rows and not layouts.kernels.supports(tf.bfloat16):
        pytest.skip("no row kernels here: the CPU lacks AVX-512 BF16, or they could not be built (tfgpt2.kernels)")
    model = load_model(wide_dir, dtype="bfloat16")
    hp = model.hparams
    weights = layouts.rows(model) if rows else layouts.one_row16(model)
    if rows:
        assert all(isinstance(w, layouts.Rows) for w in weights[0])
        c_proj = weights[0][1].w
        assert (tuple(c_proj.shape), c_proj.dtype) == ((hp.n_embd, hp.n_embd), tf.bfloat16)
        np.testing.assert_array_equal(c_proj.numpy(), tf.transpose(model.h[0].attn.c_proj.w[0]).numpy())
    else:
        c_proj, = weights[0][1]
        assert (tuple(c_proj.shape), c_proj.dtype) == ((hp.n_embd, hp.n_embd), tf.float32)
        np.testing.assert_array_equal(c_proj.numpy(), tf.cast(model.h[0].attn.c_proj.w[0], tf.float32).numpy())
    c_attn, c_fc, mlp_proj = (tf.nest.flatten(w)[0] for w in (weights[0][0], *weights[0][2:]))
    assert [(tuple(w.shape), w.dtype) for w in (c_attn, c_fc, mlp_proj)] == [
        ((3 * hp.n_embd, hp.n_embd), tf.bfloat16), ((4 * hp.n_embd, hp.n_embd), tf.bfloat16),
        ((hp.n_embd, 4 * hp.n_embd), tf.bfloat16)]
    np.testing.assert_array_equal(c_attn.numpy(), tf.transpose(model.h[0].attn.c_attn.w[0]).numpy())

    widened = layouts.widened(model)  # its prompt's: float32 copies [nx, nf]
    assert [(tuple(w.shape), w.dtype) for (w,) in widened[0]] == [
        ((hp.n_embd, 3 * hp.n_embd), tf.float32), ((hp.n_embd, hp.n_embd), tf.float32),
        ((hp.n_embd, 4 * hp.n_embd), tf.float32), ((4 * hp.n_embd, hp.n_embd), tf.float32)]

    @tf.function(jit_compile=True, autograph=False)
    def two_steps(tokens, prompt_weights, weights):
        logits, cache = call_with_cache(model, tokens[:, :5], empty_cache(model, 1, 16), 0, layouts=prompt_weights)
        return logits, call_with_cache(model, tokens[:, 5:6], cache, 5, layouts=weights)[0]

    tokens = tf.constant(prompts_for(11, [6]))
    own = [t.numpy()[0] for t in two_steps(tokens, None, None)]
    assert np.abs(own).max() > 1  # logits of std 0.1 weights, not near-uniform ones
    for copied in (two_steps(tokens, widened, weights), two_steps(tokens, None, widened)):
        for logits, expected in zip(copied, own):
            np.testing.assert_allclose(logits.numpy()[0], expected, atol=BF16_STEP * np.abs(own).max(), rtol=0)


def graph_def(function, *args):
    """The GraphDef of a tf.function traced for args (its loops' and branches' functions in its
    library); nothing compiled."""
    return function.get_concrete_function(*args).graph.as_graph_def()


def while_loops(graph_def):
    return sum(n.op in ("While", "StatelessWhile") for n in all_nodes(graph_def))


def is_product(op_type):
    """tf.matmul's ops, XLA's dot (`tfgpt2.products`' float32 products), or the kernels' products
    (`tfgpt2.kernels`)."""
    return (op_type in ("MatMul", "RowProduct", "BiasedRowProduct", "ColumnProduct")
            or op_type.startswith(("BatchMatMul", "XlaDot")))


def is_batched(op):
    if op.type.startswith("XlaDot"):
        return bool(xla_data_pb2.DotDimensionNumbers.FromString(op.get_attr("dimension_numbers")).lhs_batch_dimensions)
    return op.type.startswith("BatchMatMul")


def products(graph_def):
    return [n for n in all_nodes(graph_def) if is_product(n.op)]


@pytest.mark.parametrize("layout, rows, batched", [(8, 1, True), (8, 2, False), (None, 1, False), (7, 1, False)])
def test_split_layout_is_one_batched_product_of_the_weight_as_stored(layout, rows, batched):
    """At one row, `layout` k is one product with a batch dimension whose weight operand is the
    variable itself, reshaped (a reshape of a row-major array, which XLA makes a bitcast: no
    copy, no transpose); at more rows, without it, or where k does not divide nx, the plain
    product. The same numbers either way."""
    conv = Conv1D(64, 32)
    conv.build()
    x = tf.random.normal([rows, 64])
    graph = tf.function(lambda x: project(conv, x, layout)).get_concrete_function(x).graph
    (product,) = [op for op in graph.get_operations() if is_product(op.type)]
    assert is_batched(product) == batched, product.type
    if batched:
        weight = product.inputs[1].op
        while weight.type in ("Identity", "Cast"):
            weight = weight.inputs[0].op
        assert weight.type == "Reshape" and weight.outputs[0].shape == (8, 8, 32), weight
        source = weight.inputs[0].op
        while source.type in ("Identity", "Cast"):
            source = source.inputs[0].op
        assert source.type == "ReadVariableOp", source  # the variable as stored
    np.testing.assert_allclose(project(conv, x, layout).numpy(), conv(x).numpy(), atol=1e-5)


SAMPLED = (tf.constant(1.0), tf.constant(0), tf.constant(1.0))  # temperature, top_k, top_p


def loop_args(model, batch, longest, length, *, prompt=None, seed=0):
    """Arguments of `Generator.generate_padded` for `batch` prompts of at most `longest` tokens
    (ones, or `prompt` [batch, prompt_len]) and `length` new ones, sampled at temperature 1, top_k
    0, top_p 1 (the controls, `step.controls_for`; `choose`'s filters follow them): (prompt_len,
    the generator, the arguments)."""
    generator = generator_for(model)
    prompt_len, total = (int(n) for n in bucket_sizes(longest, length, model.hparams.n_ctx))
    prompt = tf.ones([batch, prompt_len], tf.int32) if prompt is None else prompt
    request = check_request(n_vocab=model.hparams.n_vocab, n_ctx=model.hparams.n_ctx, length=length, seed=seed)
    controls, _ = step.controls_for([dataclasses.replace(request, seed=seed_of(seed, r)) for r in range(batch)],
                                    model.hparams.n_vocab)
    return prompt_len, generator, (
        generator.weights_for(length, batch, prompt_len), prompt, tf.zeros([batch], tf.int32),
        tf.zeros([batch, total], tf.int32), tf.constant(length), controls)


@pytest.fixture(scope="module")
def loop_graph(tiny):
    """The GraphDef of the tiny model's generation program for `loop_args(tiny, batch, longest,
    40)` (and `choose`'s filters, if given), each traced once for the module, never compiled;
    `loop_graph.chooses[key]` names the graph of each call of `choose` while tracing it."""
    graphs, chooses = {}, {}

    def counted(*args, **kwargs):
        calls.append(tf.compat.v1.get_default_graph().name)
        return choose(*args, **kwargs)
    generator, calls = Generator(tiny), []

    def traced(batch, longest, *filters):
        key = (batch, longest, filters)
        if key not in graphs:
            calls.clear()
            args = loop_args(tiny, batch, longest, 40)[2]
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(step, "choose", counted)
                graphs[key], chooses[key] = graph_def(generator.generate_padded, *args, *filters), list(calls)
        return graphs[key]
    traced.chooses = chooses
    return traced


def kind(op):
    """An op's type, its versions as one (BatchMatMulV2, V3, XLA's dot as `tfgpt2.products`
    writes the attention's; While, StatelessWhile)."""
    return "BatchMatMul" if op.startswith(("BatchMatMul", "XlaDot")) else "While" if op.endswith("While") else op


def readers(nodes, name):
    """The kinds of the nodes that read node `name`'s output, less a custom gradient's IdentityN
    (which forwards a product's operands for its gradient, unread here: XLA drops it)."""
    return sorted(kind(n.op) for n in consumers(nodes, name) if n.op != "IdentityN")


def consumers(nodes, name):
    """The nodes of a function (or graph) that read node `name`'s output."""
    return [n for n in nodes if any(i.lstrip("^").split(":")[0] == name for i in n.input if not i.startswith("^"))]


@pytest.mark.parametrize("batch,longest", [(1, 1), (1, 5)])
def test_generation_updates_the_cache_in_place(tiny, loop_graph, batch, longest):
    """The generation loop writes each step's keys and values into the loop's cache buffers
    (`XlaDynamicUpdateSlice` of the loop variable) and its attention products read the updated
    buffers as they are, as does the next step: no reshape, transpose or copy of a whole cache
    between an update and its readers, which XLA would turn into a copy of the cache at each
    step (with a [batch, heads, T, features] cache reshaped for the product, XLA copied it four
    times a step at batch 1: 1.65x the time per token at 800 new tokens on 124M). Where the row
    kernels run (`kernels`), the attention kernel writes and reads the loop's buffers itself,
    and its updated buffers are the next step's. The prompt's pass (longest > 1) hands its
    updated buffers to the loop as they are too."""
    hp = tiny.hparams
    graph = loop_graph(batch, longest)
    (body,) = [f for f in graph.library.function if f.signature.name.startswith("while_body")]
    inputs = {a.name for a in body.signature.input_arg}
    returned = {value.split(":")[0] for value in body.ret.values()}
    updates = [n for n in body.node_def if n.op == "XlaDynamicUpdateSlice"]
    attends = [n for n in body.node_def if n.op == "CachedAttention"]
    if kernels.supports(tf.float32):
        assert not updates and len(attends) == hp.n_layer
        for attend in attends:
            assert set(attend.input[7:9]) <= inputs, f"{attend.name} reads {attend.input[7:9]}, not the loop's buffers"
            nexts = [n for n in consumers(body.node_def, attend.name) if n.op == "Identity"]
            assert len(nexts) == 2 and {n.name for n in nexts} <= returned, f"{attend.name}'s buffers are not the next"
    else:
        assert len(updates) == 2 * hp.n_layer and not attends
    for update in updates:
        assert update.input[0] in inputs, f"{update.name} updates {update.input[0]}, not the loop's buffer"
        assert readers(body.node_def, update.name) == ["BatchMatMul", "Identity"], update.name
        (out,) = [n for n in consumers(body.node_def, update.name) if n.op == "Identity"]
        assert f"{out.name}:output:0" in body.ret.values(), f"{update.name} is not the loop's next buffer"
    prefill = [n for n in graph.node if n.op == "XlaDynamicUpdateSlice"]
    assert len(prefill) == (2 * hp.n_layer if longest > 1 else 0)
    for update in prefill:
        assert readers(graph.node, update.name) == ["BatchMatMul", "While"], update.name


def test_the_sampler_is_compiled_once(tiny, loop_graph):
    """As the original's `sample_sequence`, the prompt but its last token fills the cache and
    the loop does the rest, so the program holds the sampler (its bisection loops) once, in the
    loop, not a second time for the first new token (about 30 MB less peak RSS for 124M)."""
    graph = loop_graph(1, 5)
    calls = loop_graph.chooses[1, 5, ()]
    assert len(calls) == 1 and "while_body" in calls[0], calls
    alone = graph_def(tf.function(lambda logits, t, k, p: choose(logits, temperature=t, top_k=k, top_p=p,
                                                                 seed=[[0, 0]])),
                      tf.zeros([1, tiny.hparams.n_vocab]), *SAMPLED)
    assert while_loops(alone) >= 1 and while_loops(graph) == 1 + while_loops(alone)


class Asked:
    """In place of the compiled loop: records the filters `generate` asks for and returns the
    token buffer as given (the prompts, then zeros) with `length` new tokens a row."""
    def __init__(self):
        self.filters = []

    def weights_for(self, length, batch, prompt_len):
        return None

    def run(self, weights, prompt, pad, tokens, length, controls, filters, top):
        self.filters.append(filters)
        tokens = tf.concat([prompt, tokens[:, prompt.shape[1]:]], axis=1)
        rows = tokens.shape[0]
        return dict(tokens=tokens, count=tf.fill([rows], length), finish=tf.fill([rows], step.LENGTH),
                    cut=tf.zeros([rows], tf.int32))


def test_filters_a_request_cannot_use_are_left_out(tiny, loop_graph, monkeypatch):
    """At top_k 0 and top_p 1 (the sample scripts' defaults) `generate` asks for neither filter,
    and a program traced without them holds no bisection loop: the generation loop is its only
    one."""
    both, neither = while_loops(loop_graph(1, 5)), while_loops(loop_graph(1, 5, (False, False)))
    assert neither == 1 < both, (neither, both)
    asked = Asked()
    monkeypatch.setattr(whole_batch, "generator_for", lambda *args, **kwargs: asked)
    for kwargs in ({}, dict(top_k=40), dict(top_p=0.9), dict(top_k=1, top_p=0.5)):
        generate(tiny, [[1, 2]], 3, seed=0, **kwargs)
    assert asked.filters == [(False, False), (True, False), (False, True), (True, True)], asked.filters


@pytest.mark.slow
def test_leaving_the_filters_out_draws_the_same_tokens(tiny):
    """The program without the filters draws what the one holding both draws, where the
    request cannot use them, and `generate` returns those tokens."""
    length = 20
    prompt = tf.constant(prompts_for(4, [16, 16]), tf.int32)
    prompt_len, generator, args = loop_args(tiny, 2, 16, length, prompt=prompt, seed=5)
    both, neither = (generator.generate_padded(*args, f)["tokens"].numpy() for f in [(True, True), (False, False)])
    np.testing.assert_array_equal(neither, both)
    rows = generate(tiny, prompt.numpy().tolist(), length, seed=5)
    np.testing.assert_array_equal(np.stack(rows), neither[:, :prompt_len + length])


def test_a_one_token_prompt_compiles_the_loop_alone(tiny, loop_graph):
    """A one-token prompt (the sample scripts' start token) is the loop's first input: the
    program holds the blocks once, in the loop (a longer prompt adds its own pass over them, as
    many products again), which lowers the compile time and the peak memory of unconditional
    sampling."""
    one_len, five_len = (int(bucket_sizes(longest, 40, tiny.hparams.n_ctx)[0]) for longest in (1, 5))
    # the block weights' products (a step's attention may be the kernel's, `kernels.cached_attention`)
    one, five = (len([n for n in products(loop_graph(1, longest)) if re.search(r"/(c_attn|c_proj|c_fc)", n.name)])
                 for longest in (1, 5))
    assert one_len == 1 and five_len > 1 and one == 4 * tiny.hparams.n_layer and five == 2 * one, (one, five)


@pytest.mark.parametrize("flags, native", [("fpu avx2 avx512f avx512_bf16 fma", True), ("fpu avx2 amx_bf16", True),
                                           ("fpu avx2 avx512f avx512_vnni avx512_fp16", False), (None, False)])
def test_native_bfloat16_reads_the_cpus_flags(tmp_path, flags, native):
    """BF16 instructions are AVX-512 BF16's or AMX's, as /proc/cpuinfo names them; no such file
    (not Linux), none."""
    info = tmp_path / "cpuinfo"
    if flags is not None:
        info.write_text(f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    assert layouts.native_bfloat16(str(info)) is native


def test_transpose_policy():
    """The planner's rule, whatever device the tests run on."""
    assert bool(transpose_pays(16, cpu=True))
    assert not bool(transpose_pays(15, cpu=True))
    assert not bool(transpose_pays(100, cpu=False))
    assert not bool(transpose_pays(100, cpu=True, jit_compile=False))


@pytest.mark.slow
def test_generation_uses_the_layouts_where_they_pay(wide_dir):
    """On a CPU under XLA, from TRANSPOSE_FROM new tokens: split products at batch 1, the
    transposed copies at more rows, and the steps of a few rows by the kernels where they run
    (tests/test_kernels.py); a 16-bit model's prompt reads float32 copies, and so do its steps
    where no other layout pays; the same greedy tokens as the uncached model."""
    model = load_model(wide_dir)
    gen = generator_for(model)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layouts.kernels, "supports", lambda dtype: False)  # a CPU without the kernels
        plain = Generator(model)
        assert plain.weights_for(16, 1, 5) == (layouts.split(model, SPLIT_K),) * 2  # (the prompt's, the steps')
        prompt, steps = plain.weights_for(16, 2, 5)
        assert prompt is steps and len(steps) == model.hparams.n_layer
        assert plain.weights_for(15, 2, 5) == plain.weights_for(15, 1, 5) == (None, None)
    if layouts.kernels.supports(tf.float32):  # the steps by the kernels: the model's own weights, at any length
        for length, batch in ((16, 1), (15, 1), (16, 2), (15, layouts.ROWS)):
            prompt, steps = gen.weights_for(length, batch, 5)
            assert layouts.by_rows(steps) and prompt is not steps
    assert generator_for(model, jit_compile=False).weights_for(16, 2, 5) == (None, None)
    bf16_model = load_model(wide_dir, dtype="bfloat16")
    sixteen = generator_for(bf16_model)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layouts, "native_bfloat16", lambda: False)  # a CPU without BF16 instructions
        patch.setattr(layouts.kernels, "supports", lambda dtype: False)  # (nor the row kernels)
        prompt, steps = sixteen.weights_for(16, 1, 5)  # the prompt: float32 copies; one row: `one_row16`
        assert [w.dtype for (w,) in prompt[0]] == [tf.float32] * 4
        assert [tf.nest.flatten(w)[0].dtype for w in steps[0]] == [tf.bfloat16, tf.float32, tf.bfloat16, tf.bfloat16]
        assert sixteen.weights_for(16, 1, 1)[0] is None  # a one-token prompt has no pass to read copies
        prompt, steps = sixteen.weights_for(15, 1, 5)  # too few steps for another layout: the float32 copies
        assert prompt is steps and [w.dtype for (w,) in steps[0]] == [tf.float32] * 4
        prompt, steps = sixteen.weights_for(16, 2, 5)
        assert prompt is steps and [w.dtype for w in steps[0]] == [tf.float32] * 4
        patch.setattr(layouts, "native_bfloat16", lambda: True)  # with them, the prompt's pass apart: no copies
        for length, batch in ((16, 1), (15, 1), (16, 2)):
            prompt, steps = sixteen.weights_for(length, batch, 5)
            assert prompt is None and steps is not None and sixteen.prompt_apart(5)
    prompts = prompts_for(12, [3, 1, 6])
    copies, transposed = [], gen.transposed
    gen.transposed = lambda: copies.append(1) or transposed()
    try:
        together = generate(model, prompts, 40, top_k=1)
        alone = generate(model, prompts[:1], 40, top_k=1)
    finally:
        gen.transposed = transposed
    assert copies == [1], "generate did not use the transposed copies at batch 3, or used them at batch 1"
    for prompt, row in zip(prompts, together):
        assert len(row) == len(prompt) + 40
        assert_greedy(model, prompt, row)
    assert alone[0].tolist() == together[0].tolist()


@pytest.mark.slow
def test_compiled_functions_live_and_die_with_the_model(tiny_dir):
    """A model that has generated keeps its Generator across calls (`generator_for`), and is
    freed once dropped: the Generator kept for it does not hold it."""
    model = load_model(tiny_dir)
    generate(model, [[1, 2]], 3, seed=0)
    kept = generator_for(model)
    generate(model, [[1, 2]], 3, seed=0, progress=lambda n: None)
    assert generator_for(model) is kept and kept.traces == 3  # the whole loop, then its two pieces
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None, "the model is still referenced after del and gc.collect()"


@pytest.mark.slow
def test_a_loop_is_compiled_afresh_for_lora_and_int8(tiny_dir):
    """Generation after `enable_lora` reaches the adapters (greedy tokens: the argmax of the
    adapted model's forward passes, other than before); after `quantize` the model gets another
    Generator (the loop compiled before read the float weights)."""
    model, prompt = load_model(tiny_dir), [5, 6, 7]
    before = generate(model, [prompt], 6, top_k=1, jit_compile=False)[0]
    model.enable_lora(2, seed=0)
    rng = np.random.default_rng(0)
    for _, conv in model.conv1d_layers():
        if conv.lora_enabled:
            conv.lora_kernel_b.assign(rng.normal(0.0, 0.5, conv.lora_kernel_b.shape))
    after = generate(model, [prompt], 6, top_k=1, jit_compile=False)[0]
    assert_greedy(model, prompt, after)
    assert after.tolist() != before.tolist()
    model = load_model(tiny_dir)
    float_loop = generator_for(model)
    model.quantize("int8")
    assert generator_for(model) is not float_loop


def test_temperature_zero_is_greedy():
    """`choose` at temperature 0 takes each row's largest logit, whatever the filters and seed."""
    logits = tf.constant(np.random.default_rng(0).normal(size=[4, 300]).astype(np.float32) * 3)
    for top_k, top_p, seed in [(0, 1.0, [0, 0]), (5, 0.5, [3, 1])]:
        token = choose(logits, temperature=tf.constant(0.0), top_k=tf.constant(top_k), top_p=tf.constant(top_p),
                       seed=tf.constant(seed, tf.int64))
        np.testing.assert_array_equal(token.numpy(), np.argmax(logits.numpy(), axis=-1))


@pytest.mark.slow
def test_generation_at_temperature_zero_is_greedy(tiny):
    prompt = prompts_for(3, [3])
    a = generate(tiny, prompt, 12, temperature=0)[0]
    b = generate(tiny, prompt, 12, top_k=1, seed=5)[0]
    np.testing.assert_array_equal(a, b)


# ---- batches of different lengths and compiles -----------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("folder", ["tiny_dir", "wide_dir"])
def test_variable_length_batch_rows_equal_rows_alone(folder, request):
    model = load_model(request.getfixturevalue(folder))
    prompts = prompts_for(4, [1, 7, 3, 12])
    together = generate(model, prompts, 10, top_k=1)
    for prompt, row in zip(prompts, together):
        alone = generate(model, [prompt], 10, top_k=1)[0]
        np.testing.assert_array_equal(row, alone)
        assert row[:len(prompt)].tolist() == prompt


@pytest.mark.slow
def test_one_compile_per_bucket(tiny_dir):
    """On a model of its own: the file's shared `tiny` may have traced these buckets already,
    in whatever order the tests ran."""
    model = load_model(tiny_dir)
    gen = generator_for(model)
    for length, new in [(3, 5), (5, 6), (9, 2), (16, 8)]:  # prompt bucket 16, total bucket 24
        generate(model, prompts_for(length, [length, length]), new, seed=1)
    assert gen.traces == 1
    generate(model, prompts_for(7, [17, 17]), 5, seed=1)  # prompt bucket 24: one more
    assert gen.traces == 2


@pytest.mark.slow
def test_twenty_prompt_lengths_compile_at_most_seven_times(tiny_dir):
    model = load_model(tiny_dir)
    for n in range(1, 60, 3):
        generate(model, prompts_for(n, [n]), 5, seed=0)
    assert generator_for(model).traces <= 7


@pytest.mark.slow
def test_threads_generate_as_one(tiny):
    """Four threads sharing the model's compiled functions get what each call gets alone."""
    requests = [(prompts_for(20 + i, [3 + i, 5]), 9 + i) for i in range(4)]
    alone = [generate(tiny, prompts, 12, seed=seed) for prompts, seed in requests]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda r: generate(tiny, r[0], 12, seed=r[1]), requests * 2))
    for got, expected in zip(together, alone * 2):
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_stop_at_eot_per_row(tiny):
    prompts = prompts_for(5, [3, 6])
    free = generate(tiny, prompts, 15, top_k=1)
    stop = int(free[0][3 + 4])  # the 5th token row 0 generates stands in for <|endoftext|>
    rows = generate(tiny, prompts, 15, top_k=1, stop_at_eot=True, eot=stop)
    for free_row, row, prompt in zip(free, rows, prompts):
        new = free_row[len(prompt):].tolist()
        cut = new.index(stop) + 1 if stop in new else len(new)
        assert row[len(prompt):].tolist() == new[:cut]
    assert len(rows[0]) == 3 + 5


@pytest.mark.slow
@pytest.mark.parametrize("stop_at_eot", [False, True])
def test_generation_in_pieces_with_progress(tiny, stop_at_eot):
    """`progress` runs the loop a chunk at a time: same tokens, counts that grow to the end."""
    prompts = prompts_for(8, [2, 5])
    whole = generate(tiny, prompts, 23, seed=3)
    eot = int(whole[0][2 + 9]) if stop_at_eot else 50256
    whole = generate(tiny, prompts, 23, seed=3, stop_at_eot=stop_at_eot, eot=eot)
    seen = []
    pieces = generate(tiny, prompts, 23, seed=3, stop_at_eot=stop_at_eot, eot=eot, progress=seen.append, chunk=5)
    for a, b in zip(whole, pieces):
        np.testing.assert_array_equal(a, b)
    assert seen == sorted(seen) and seen[0] == 0 and len(seen) >= 3
    assert seen[-1] == max(len(row) - len(p) for row, p in zip(whole, prompts))


# ---- sampling statistics ----------------------------------------------------------------

def reference_top_k(logits, k):
    kth = np.sort(logits, axis=-1)[:, ::-1][:, k - 1:k]
    return np.where(logits < kth, -1e10, logits)


def reference_top_p(logits, p):
    """The original rule, row by row (the original itself only runs at batch 1)."""
    out = []
    for row in logits:
        s = np.sort(row)[::-1]
        probs = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        n = max(int((np.cumsum(probs) <= p).sum()) - 1, 0)
        out.append(np.where(row < s[n], -1e10, row))
    return np.array(out)


@pytest.mark.parametrize("k", [1, 2, 7, 40, 50])
def test_top_k_logits_matches_sorting(k):
    logits = np.random.default_rng(k).normal(size=[3, 50]).astype(np.float32) * 3
    logits[1, :5] = logits[1, 5]  # ties
    np.testing.assert_array_equal(top_k_logits(tf.constant(logits), tf.constant(k)).numpy(),
                                  reference_top_k(logits, k))
    np.testing.assert_array_equal(top_k_logits(tf.constant(logits), 0).numpy(), logits)


@pytest.mark.parametrize("p", [0.0, 0.3, 0.9, 0.999])
def test_top_p_logits_matches_original_rule_for_any_batch(p):
    logits = np.random.default_rng(int(p * 1000)).normal(size=[4, 200]).astype(np.float32) * 2
    np.testing.assert_array_equal(top_p_logits(tf.constant(logits), tf.constant(p)).numpy(),
                                  reference_top_p(logits, p))
    np.testing.assert_array_equal(top_p_logits(tf.constant(logits), 1.0).numpy(), logits)


def draws(logits, n, **kwargs):
    """n independent draws from one row of logits (n rows in one call)."""
    batch = tf.constant(np.repeat(logits[None], n, axis=0))
    args = dict(temperature=tf.constant(1.0), top_k=tf.constant(0), top_p=tf.constant(1.0),
                seed=tf.constant([7, 0], tf.int64))
    args.update({k: tf.constant(v, dtype=args[k].dtype) for k, v in kwargs.items()})
    return tf.function(choose, jit_compile=True, autograph=False)(batch, **args).numpy()


@pytest.mark.slow
def test_samples_lie_in_top_k_and_nucleus():
    logits = np.random.default_rng(0).normal(size=300).astype(np.float32) * 2
    in_top_k = set(np.argsort(-logits)[:10].tolist())
    assert set(draws(logits, 5000, top_k=10).tolist()) <= in_top_k
    nucleus = set(np.flatnonzero(reference_top_p(logits[None], 0.6)[0] > -1e9).tolist())
    seen = set(draws(logits, 5000, top_p=0.6).tolist())
    assert seen <= nucleus and len(seen) > 1
    both = set(np.flatnonzero(reference_top_p(reference_top_k(logits[None], 20), 0.5)[0] > -1e9).tolist())
    assert set(draws(logits, 5000, top_k=20, top_p=0.5).tolist()) <= both


@pytest.mark.slow
@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.8), (8, 0.7)])
def test_distribution_matches_filtered_softmax(top_k, top_p):
    """20,000 draws with top-k, top-p or both against the softmax renormalised over the kept
    tokens: a sampler that always takes the most likely token (or ignores the filter) fails."""
    logits = np.random.default_rng(2).normal(size=40).astype(np.float32)
    kept = logits[None]
    if top_k:
        kept = reference_top_k(kept, top_k)
    kept = reference_top_p(kept, top_p)[0] > -1e9
    assert kept.sum() >= 3
    probs = filtered_softmax(logits.astype(np.float64), kept)
    counts = np.bincount(draws(logits, 20_000, top_k=top_k, top_p=top_p), minlength=40)
    df = int(kept.sum()) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * np.sqrt(2 / (9 * df))) ** 3  # chi-square p = 0.001 (Wilson-Hilferty)
    assert chi_square(counts, probs) < critical


def test_distribution_test_rejects_a_greedy_sampler():
    """The statistic above is not toothless: argmax draws fail it by orders of magnitude."""
    logits = np.random.default_rng(2).normal(size=40).astype(np.float32)
    kept = reference_top_k(logits[None], 5)[0] > -1e9
    counts = np.bincount(np.full(20_000, np.argmax(logits)), minlength=40)
    assert chi_square(counts, filtered_softmax(logits.astype(np.float64), kept)) > 1000


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_distribution_matches_softmax(temperature):
    """Chi-square test of 40,000 draws over 12 tokens against softmax(logits / T)."""
    logits = np.random.default_rng(1).normal(size=12).astype(np.float32)
    n = 40_000
    counts = np.bincount(draws(logits, n, temperature=temperature), minlength=12)
    expected = np.exp(logits / temperature) / np.exp(logits / temperature).sum() * n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 31.26, f"chi-square {chi2:.1f} >= 31.26 (df 11, p = 0.001)"


@pytest.mark.parametrize("n", [12, CDF_BLOCK, 3 * CDF_BLOCK + 77])
def test_inverse_cdf_is_the_quantile_of_the_weights(n):
    """At evenly spaced u (in [0, 1)), each index is picked as often as its share of the weights,
    to one either way (a float64 inverse CDF): whole blocks, the tail and a vocabulary under a
    block, weights of very different sizes and zero ones (filtered tokens) never picked."""
    rng = np.random.default_rng(n)
    weights = np.exp(rng.normal(size=n) * 3).astype(np.float32)
    weights[rng.random(n) < 0.4] = 0
    draws = 20_000
    u = ((np.arange(draws) + 0.5) / draws).astype(np.float32)
    got = tf.function(inverse_cdf, jit_compile=True)(tf.constant(np.repeat(weights[None], draws, 0)), tf.constant(u))
    counts = np.bincount(got.numpy(), minlength=n)
    assert len(counts) == n and counts[weights == 0].sum() == 0
    share = weights.astype(np.float64) / weights.astype(np.float64).sum()
    assert np.abs(counts - share * draws).max() <= 1, np.abs(counts - share * draws).max()


def test_inverse_cdf_picks_a_token_of_weight_above_zero_at_the_ends():
    """u 0 gives each row's first token of weight > 0 and u just under 1 its last, where it
    lies: in the first block, in a later one, in the tail (past the whole blocks), or alone."""
    n = 3 * CDF_BLOCK + 77
    weights = np.zeros([5, n], np.float32)
    for row, places in enumerate([[0, 5], [CDF_BLOCK + 3, 2 * CDF_BLOCK + 9], [3 * CDF_BLOCK + 1, n - 1], [n - 2]]):
        weights[row, places] = 1.0
    weights[4, [7, n - 1]], weights[4, CDF_BLOCK] = 1e-30, 1.0  # tiny weights at the ends, the rest in the middle
    pick = tf.function(inverse_cdf, jit_compile=True)
    first = pick(tf.constant(weights), tf.zeros([5])).numpy()
    last = pick(tf.constant(weights), tf.fill([5], np.float32(1 - 2 ** -24))).numpy()
    assert first.tolist() == [0, CDF_BLOCK + 3, 3 * CDF_BLOCK + 1, n - 2, 7]
    assert last.tolist() == [5, 2 * CDF_BLOCK + 9, n - 1, n - 2, CDF_BLOCK]
    # rows whose last block's running sum (summed in another order than its sum) ends short of
    # u times the total: still the last token of weight > 0, not one past it
    rng = np.random.default_rng(0)
    weights = np.exp(rng.normal(size=[4096, n]) * 2).astype(np.float32)
    weights[:, rng.random(n) < 0.3] = 0
    last = pick(tf.constant(weights), tf.fill([4096], np.float32(1 - 2 ** -24))).numpy()
    assert (last == np.flatnonzero(weights[0])[-1]).all(), np.unique(last)


@pytest.mark.slow
def test_seed_reproducible_and_seeds_differ(tiny):
    prompts = prompts_for(6, [4, 4])
    a = generate(tiny, prompts, 16, seed=123)
    b = generate(tiny, prompts, 16, seed=123)
    c = generate(tiny, prompts, 16, seed=124)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_a_loop_traced_after_a_draw_for_any_rows_keeps_its_shapes(tiny_dir):
    """The draw's uniforms (`sampler._uniform`, one tf.function for every caller) traced for rows
    of any number (a SavedModel's signature) are reused by a later loop's trace for a known
    number: the loop's state keeps its static shapes (else tf.while_loop refuses it)."""
    sampler._uniform.get_concrete_function(tf.TensorSpec([], tf.int32), tf.TensorSpec([None, 2], tf.int64))
    model = load_model(tiny_dir)  # a model of its own: its loop is traced now
    prompts = prompts_for(6, [3])
    tokens = generate(model, prompts, 5, seed=7)[0]
    assert len(tokens) == 3 + 5 and np.array_equal(tokens, generate(model, prompts, 5, seed=7)[0])


# ---- bad input ---------------------------------------------------------------------------

@pytest.mark.parametrize("prompts, length, kwargs, message", [
    ([[1, 50257]], 4, {}, r"prompt 0: token ids must be in \[0, n_vocab=50257\), got \[50257\]"),
    ([[1], [-3]], 4, {}, r"prompt 1: token ids must be in \[0, n_vocab=50257\), got \[-3\]"),
    ([[1] * 65], 6, {}, r"prompt of 65 tokens exceeds the context window n_ctx=64"),
    ([[1] * 65], 2**31 - 1, {}, r"prompt of 65 tokens exceeds the context window n_ctx=64"),
    ([[1, 2]], 2**31, {}, r"length must be an integer in \[1, 2\*\*31\), got 2147483648"),
    ([[1, 2]], 2**40, {}, r"length must be an integer in \[1, 2\*\*31\)"),
    ([[1]], 0, {}, r"length must be an integer in \[1, 2\*\*31\), got 0"),
    ([[1]], 3.7, {}, r"length must be an integer in \[1, 2\*\*31\), got 3.7"),
    ([[]], 3, {}, r"at least one token"),
    ([], 3, {}, r"non-empty list"),
    ([[1.7, 2.2]], 3, {}, r"prompt 0: token ids must be a flat list of integers, got dtype float64"),
    ([[1], [[2]]], 3, {}, r"prompt 1: token ids must be a flat list of integers"),
    ([[1]], 3, {"top_k": -1}, r"top_k must be an integer in \[0, 2\*\*31\), got -1"),
    ([[1]], 3, {"top_k": 2.5}, r"top_k must be an integer in \[0, 2\*\*31\), got 2.5"),
    ([[1]], 3, {"top_k": 2**31}, r"top_k must be an integer in \[0, 2\*\*31\), got 2147483648"),
    ([[1]], 3, {"top_p": 1.5}, r"top_p must be a number in \[0, 1\], got 1.5"),
    ([[1]], 3, {"top_p": float("nan")}, r"top_p must be a number in \[0, 1\], got nan"),
    ([[1]], 3, {"temperature": -1}, r"temperature must be a finite number >= 0, got -1"),
    ([[1]], 3, {"temperature": float("nan")}, r"temperature must be a finite number >= 0, got nan"),
    ([[1]], 3, {"temperature": float("inf")}, r"temperature must be a finite number >= 0, got inf"),
    ([[1]], 3, {"temperature": "hot"}, r"temperature must be a finite number >= 0, got 'hot'"),
    ([[1]], 3, {"seed": 2**70}, r"seed must be an integer in \[0, 2\*\*63\), got 1180591620717411303424"),
    ([[1]], 3, {"seed": 2**63}, r"seed must be an integer in \[0, 2\*\*63\), got 9223372036854775808"),
    ([[1]], 3, {"seed": -1}, r"seed must be an integer in \[0, 2\*\*63\), got -1"),
    ([[1]], 3, {"seed": 1.5}, r"seed must be an integer in \[0, 2\*\*63\), got 1.5"),
    ([[1]], 3, {"stop_at_eot": "yes"}, r"stop_at_eot must be true or false, got 'yes'"),
    ([[1]], 3, {"eot": 50257}, r"eot must be a token id in \[0, n_vocab=50257\), got 50257"),
    ([[1]], 3, {"chunk": 0}, r"chunk must be an integer in \[1, 2\*\*31\), got 0"),
])
def test_bad_input(tiny, prompts, length, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(tiny, prompts, length, **kwargs)


def test_sample_sequence_api(tiny, monkeypatch):
    """The original's signature: start_token and batch_size, or a context (ragged: a list of
    rows); the loop itself replaced by `Asked` (test_sample_sequence_generates runs it)."""
    monkeypatch.setattr(whole_batch, "generator_for", lambda *args, **kwargs: Asked())
    out = sample_sequence(model=tiny, length=6, start_token=50256, batch_size=3, top_k=1)
    assert out.shape == (3, 7) and (out[:, 0] == 50256).all()
    ragged = sample_sequence(model=tiny, length=4, context=[[1, 2], [3]], top_k=1)
    assert [r.tolist() for r in ragged] == [[1, 2, 0, 0, 0, 0], [3, 0, 0, 0, 0]]
    same = sample_sequence(model=tiny, length=2, context=[[4, 5], [6, 7]])
    assert isinstance(same, np.ndarray) and same.tolist() == [[4, 5, 0, 0], [6, 7, 0, 0]]
    with pytest.raises(ValueError, match="exactly one of start_token and context"):
        sample_sequence(model=tiny, length=4)
    with pytest.raises(ValueError, match="start_token needs batch_size"):
        sample_sequence(model=tiny, length=4, start_token=50256)
    with pytest.raises(ValueError, match="prompt 0: token ids must be a flat list of integers"):
        sample_sequence(model=tiny, length=4, context=[[1.7, 2.2]])
    with pytest.raises(ValueError, match=r"length must be an integer in \[1, 2\*\*31\), got 3.7"):
        sample_sequence(model=tiny, length=3.7, context=[[1]])


@pytest.mark.slow
def test_sample_sequence_generates(tiny):
    out = sample_sequence(model=tiny, length=6, start_token=50256, batch_size=3, top_k=1)
    assert out.shape == (3, 7) and (out[:, 0] == 50256).all()
    assert (out == out[0]).all()
    ragged = sample_sequence(model=tiny, length=4, context=[[1, 2], [3]], top_k=1)
    assert [len(r) for r in ragged] == [6, 5]
    with pytest.raises(ValueError, match="exactly one of start_token and context"):
        sample_sequence(model=tiny, length=4)
    with pytest.raises(ValueError, match="prompt 0: token ids must be a flat list of integers"):
        sample_sequence(model=tiny, length=4, context=[[1.7, 2.2]])
    with pytest.raises(ValueError, match=r"length must be an integer in \[1, 2\*\*31\), got 3.7"):
        sample_sequence(model=tiny, length=3.7, context=[[1]])


def test_refused_request_returns_at_once(tiny, monkeypatch):
    """An overflowing length is refused before anything is planned, allocated or compiled."""
    def never(*args, **kwargs):
        raise AssertionError("reached after the checks")
    for name in ("bucket_sizes", "generator_for"):
        monkeypatch.setattr(whole_batch, name, never)
    with pytest.raises(ValueError, match=r"length must be an integer in \[1, 2\*\*31\), got 2147483648"):
        generate(tiny, [[10, 20]], 2**31)


VALUES = [0, 1, 3, -1, 2.5, float("nan"), float("inf"), 2**31 - 1, 2**63, True, "x", None]


@pytest.mark.slow
@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(context=st.lists(st.lists(st.sampled_from([0, 5, 50256, 50257, -1, 1.5]), min_size=0, max_size=4),
                        min_size=0, max_size=2),
       length=st.sampled_from([1, 3] * 4 + VALUES), temperature=st.sampled_from([0.0, 1.0] * 3 + VALUES),
       top_k=st.sampled_from([0, 1, 40] * 3 + VALUES), top_p=st.sampled_from([1.0, 0.9] * 3 + VALUES),
       seed=st.sampled_from([0, 7] * 3 + VALUES))
def test_fuzzed_arguments_succeed_or_name_the_argument(tiny, context, length, temperature, top_k, top_p, seed):
    args = dict(context=context, length=length, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    try:
        rows = sample_sequence(model=tiny, **args)
    except ValueError as e:
        assert any(word in str(e) for word in ("prompt", "token ids", "length", "temperature", "top_k", "top_p",
                                               "seed")), str(e)
        return
    assert len(rows) == len(context)
    for row, prompt in zip(rows, context):
        assert list(row[:len(prompt)]) == prompt and len(row) == len(prompt) + length
        assert ((0 <= row) & (row < 50257)).all()


@pytest.mark.slow
def test_bucketed_compiles_do_not_warn_of_retracing(tiny, caplog):
    """Compiling once per bucket is by design: TensorFlow's retracing warning stays silent for
    the generation loop (six batch sizes, six traces), and still speaks for other functions."""
    with caplog.at_level(logging.WARNING):
        for batch in range(1, 7):
            generate(tiny, prompts_for(batch, [2] * batch), 2, seed=0, jit_compile=False)
        assert not [r for r in caplog.records if "retracing" in r.getMessage()]
        square = tf.function(lambda x: x * x)
        for n in range(1, 8):
            square(tf.zeros([n]))
        assert [r for r in caplog.records if "retracing" in r.getMessage()]
