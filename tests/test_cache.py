"""tfgpt2/decoding/cache.py, the declared second forward pass: `call_with_cache` (left-padded
rows, the whole batch's loop and LiteRT's) and `call_with_slots` (the server's slots, each row at
a position of its own, across cache blocks) give `GPT2.call`'s logits, for each option of the
layers (LoRA, int8, bfloat16, an untied head) and each weight layout (`layouts`), at a prompt
and at the step after it."""
import re

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import prompts_for
from tfgpt2.decoding import layouts as layout
from tfgpt2.decoding.cache import BLOCK, call_with_cache, call_with_slots, empty_cache, slot_cache
from tfgpt2.hparams import default_hparams
from tfgpt2.model import GPT2

HPARAMS = dict(n_vocab=300, n_ctx=2 * BLOCK, n_embd=32, n_head=4, n_layer=2)
PROMPTS = prompts_for(3, [BLOCK + 2, 5], n_vocab=300)  # the first crosses a cache block
NEXT = [[7], [11]]  # one more token per row
# max |cache - call| / max |call| over the logits: float32 differs by the order of its sums
# only; bfloat16 by its rounding of the same products taken in blocks (measured: at most 6e-7
# and 1.1e-2, at logits of about 2.5)
TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2}


def model_with(option):
    """A model of HPARAMS, weights of std 0.3 (0.1 for the matrices LoRA adds to), with the option."""
    model = GPT2(default_hparams().override_from_dict(HPARAMS), tie_embeddings=option != "untied",
                 dtype="bfloat16" if option == "bfloat16" else None)
    rng = np.random.default_rng(0)
    for v in model.weights:
        v.assign(tf.cast(rng.standard_normal(v.shape) * 0.3, v.dtype))
    if option == "lora":
        model.enable_lora(2, ["c_attn", "c_fc", "mlp/c_proj"], seed=1)
        for name, conv in model.conv1d_layers():
            if conv.lora_enabled:
                conv.lora_kernel_b.assign(tf.cast(rng.standard_normal(conv.lora_kernel_b.shape) * 0.1, tf.float32))
    if option == "int8":
        model.quantize("int8")
    return model


def assert_close(actual, expected, dtype, what):
    scale = np.abs(expected).max()
    assert scale > 1, f"{what}: logits too small to compare"
    assert np.abs(np.asarray(actual, np.float32) - expected).max() <= TOLERANCE[dtype] * scale, what


def weights(model, name):
    """The layouts `name` of the model's blocks, or None (the layers' own products)."""
    return {"own": lambda model: None, "split": layout.split, "transposed": layout.transposed}[name](model)


OPTIONS = ("float32", "lora", "int8", "bfloat16", "untied")
# Each option with the layers' own products; the layouts (which int8 weights do not take, and
# for which the head is not a block weight) with the options that change the block products
CASES = [(option, "own") for option in OPTIONS] + [(option, "split") for option in ("float32", "lora", "bfloat16")] + [
    pytest.param((option, "transposed"), marks=pytest.mark.slow, id=f"{option}-transposed")  # XLA: compiles
    for option in ("float32", "lora", "bfloat16")]


def test_transposed_layouts_are_float32_copies(model_for):
    """A 16-bit model's transposed block weights are float32 copies of its own: XLA's CPU
    backend multiplies 16 bits as float32, converting the weights again at each call (each token
    of a server's step) where they are held in 16 bits."""
    model = model_for("bfloat16")
    copies = layout.transposed(model)
    assert all(t.dtype == tf.float32 for block in copies for t in block)
    w = model.h[0].attn.c_attn.w
    np.testing.assert_array_equal(copies[0][0].numpy(), np.transpose(tf.cast(w, tf.float32).numpy()[0]))
    np.testing.assert_array_equal(layout.head(model).numpy(), tf.cast(model.wte, tf.float32).numpy())
    assert layout.head(model_for("float32")) is None


@pytest.fixture(scope="module")
def model_for():
    """option -> its model, made once for the file."""
    models = {}

    def get(option):
        if option not in models:
            models[option] = model_with(option)
        return models[option]
    return get


def pick(values, rows):
    return tf.constant([values[i] for i in rows])


def expected_logits(model):
    """GPT2.call's logits of each prompt and its next token, every position: [T + 1, n_vocab] each."""
    return [model(np.array([row + next_]))["logits"].numpy()[0] for row, next_ in zip(PROMPTS, NEXT)]


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_call_with_cache_is_gpt2_call(model_for, case):
    """Two rows, the shorter left-padded, read whole, then a token each (`split` is for one row:
    there the rows go one at a time). Eagerly (no compile), but for `transposed`, which needs
    XLA (where the loops run them all)."""
    name, layouts = case
    model = model_for(name)
    w = weights(model, layouts)
    longest = max(map(len, PROMPTS))
    pad = [longest - len(row) for row in PROMPTS]
    padded = [[0] * p + row for p, row in zip(pad, PROMPTS)]

    def run(rows):
        prompt, cache = call_with_cache(model, pick(padded, rows), empty_cache(model, len(rows), 2 * BLOCK), 0,
                                        pad=pick(pad, rows), layouts=w)
        return prompt, call_with_cache(model, pick(NEXT, rows), cache, longest, pad=pick(pad, rows), layouts=w)[0]
    run = tf.function(run, jit_compile=True, autograph=False) if layouts == "transposed" else run
    expected, dtype = expected_logits(model), "bfloat16" if name == "bfloat16" else "float32"
    for rows in [[0], [1]] if layouts == "split" else [[0, 1]]:
        prompt, step = run(rows)
        for j, i in enumerate(rows):
            assert_close(prompt[j].numpy(), expected[i][-2], dtype, f"{name}, {layouts}: row {i}'s prompt")
            assert_close(step[j].numpy(), expected[i][-1], dtype, f"{name}, {layouts}: row {i}'s next token")


def slots_run(model, held=False):
    """The compiled program of `test_call_with_slots_is_gpt2_call`; `held`: with the server's
    transposed layouts and float32 `wte` (`layouts.head`)."""
    first, second = PROMPTS[0], PROMPTS[1][:1]
    w, head = (layout.transposed(model), layout.head(model)) if held else (None, None)

    @tf.function(jit_compile=True, autograph=False)
    def run():
        prompt, cache = call_with_slots(model, tf.constant([first]), slot_cache(model, 3, 2 * BLOCK),
                                        tf.constant([0]), window=2 * BLOCK, slot=tf.constant([1]), every_position=True,
                                        layouts=w, head=head)
        step, _ = call_with_slots(model, tf.constant([NEXT[0], second]), cache, tf.constant([len(first), 0]),
                                  window=2 * BLOCK, slot=tf.constant([1, 0]), layouts=w, head=head)
        return prompt[0], step
    return run


@pytest.mark.slow  # XLA: a slot's write past a block is dropped by XLA alone
@pytest.mark.parametrize("name", OPTIONS + ("bfloat16-held",))
def test_call_with_slots_is_gpt2_call(model_for, name):
    """The first prompt read into the second slot across the first cache block (every
    position's logits), then a step of two rows at positions of their own: that prompt's next
    token, and the second prompt's first token at position 0 of the first slot."""
    model = model_for(name.split("-")[0])
    second = PROMPTS[1][:1]
    prompt, step = slots_run(model, held=name.endswith("-held"))()
    expected, dtype = expected_logits(model)[0], "bfloat16" if name.startswith("bfloat16") else "float32"
    assert_close(prompt.numpy(), expected[:-1], dtype, f"{name}: the prompt")
    assert_close(step[0].numpy(), expected[-1], dtype, f"{name}: its next token")
    assert_close(step[1].numpy(), model(np.array([second]))["logits"].numpy()[0, 0], dtype, f"{name}: a first token")


@pytest.mark.slow  # XLA: compiles the loop
def test_bfloat16_logits_read_bfloat16_in_a_loop(model_for):
    """In a decoding loop on a CPU, the one-row logits product reads the bfloat16 `wte` at each
    step (`held_logits`), not a float32 copy that XLA would hoist out of the loop (twice the
    bytes read at every step); the logits those steps give are GPT2.call's."""
    from tfgpt2.products import cpus_only
    model = model_for("bfloat16")
    w = layout.split(model)

    @tf.function(jit_compile=True, autograph=False)
    def run(prompt):
        def body(i, token, cache, logits):
            step, cache = call_with_cache(model, token, cache, i, layouts=w)
            return i + 1, tf.gather(prompt, [tf.minimum(i + 1, prompt.shape[1] - 1)], axis=1), cache, step
        return tf.while_loop(lambda i, *_: i < prompt.shape[1], body,
                             (0, prompt[:, :1], empty_cache(model, 1, BLOCK), tf.zeros([1, HPARAMS["n_vocab"]])))[3]
    prompt = tf.constant([PROMPTS[1]])
    assert_close(run(prompt)[0].numpy(), expected_logits(model)[1][-2], "bfloat16", "the last step's logits")
    if not cpus_only():
        pytest.skip("the copies checked for are XLA's CPU backend's")
    hlo = run.experimental_get_compiler_ir(prompt)(stage="optimized_hlo")
    made = {name: (shape, op, operand) for name, shape, op, operand
            in re.findall(r"%([\w.-]+) = (\w+\[[\d,]*\])\S* ([\w-]+)\(%?([\w.-]*)", hlo)}
    (weight,) = [b for a, b in re.findall(rf"= f32\[{HPARAMS['n_vocab']}\]\S* dot\(%([\w.-]+), %([\w.-]+)\)", hlo)]
    # the product's weight converted where it is read, from the bfloat16 variable
    _, op, source = made[weight]
    assert op == "convert" and made[source][0] == f"bf16[{HPARAMS['n_vocab']},{HPARAMS['n_embd']}]", (made[weight], hlo)


@pytest.mark.slow  # XLA: compiles
def test_bfloat16_slots_convert_no_block_and_no_wte(model_for):
    """A bfloat16 model's slot steps, as the server runs them, convert neither a cache block nor
    `wte` whole. The slots hold float32 (`cache.slot_dtype`): XLA's CPU backend gives attention's
    products a 16-bit block as a float32 copy made at each step, and writes a row of one by
    converting it to float32 and back; so no 16-bit block is made, and no block is converted.
    A row of a 16-bit `wte` is gathered from `layouts.head`, not from a float32 copy of `wte`
    made at each call."""
    from tfgpt2.products import cpus_only
    if not cpus_only():
        pytest.skip("the copies checked for are XLA's CPU backend's")
    model = model_for("bfloat16")
    hp = model.hparams
    block, table = f",{BLOCK},{hp.n_embd // hp.n_head}]", f"[{hp.n_vocab},{hp.n_embd}]"  # a block, or its rows read

    hlo = slots_run(model, held=True).experimental_get_compiler_ir()(stage="optimized_hlo")
    # the instructions of a block's or wte's shape, fused ones included
    made = {(shape, op) for shape, op in re.findall(r"= (\w+\[[\d,]*\])\S* ([\w-]+)\(", hlo)
            if shape.endswith((block, table))}
    assert not [(shape, op) for shape, op in made if shape.startswith("bf16") and shape.endswith(block)], made
    assert not [(shape, op) for shape, op in made if shape.endswith(block) and "convert" in op], made
    assert {op for shape, op in made if shape.endswith(table)} <= {"parameter", "get-tuple-element", "tuple"}, made


def test_slots_move_save_and_load_carry_a_slots_rows_of_every_block(model_for):
    """`move` (a sequence down into a free slot), and `save` and `load` through the prefix
    cache's pool, from and into the first slot and others: each carries the slot's rows of each
    block it names and leaves every other slot's as they were."""
    from tfgpt2.decoding.slots import Slots
    model = model_for("float32")
    hp = model.hparams
    slots = Slots(model, max_batch=3, chunk=BLOCK, steps=1, eot=0, pool=2)
    rng = np.random.default_rng(2)
    for variable in tf.nest.flatten(slots.cache):
        variable.assign(rng.standard_normal(variable.shape).astype(np.float32))

    def held():  # [layers, keys and values, blocks, slots, heads, BLOCK, head_dim]
        return np.array([[[block.numpy().reshape(3, hp.n_head, BLOCK, -1) for block in blocks] for blocks in layer]
                         for layer in slots.cache])
    expected = held()
    slots.save(2, [(0, 1)])  # slot 2's first block into pool block 1
    slots.load(0, [1])  # and into slot 0's first block
    expected[:, :, 0, 0] = expected[:, :, 0, 2]
    np.testing.assert_array_equal(held(), expected)
    slots.save(0, [(1, 0)])  # slot 0's second block into pool block 0
    slots.load(1, [0])  # and into slot 1's first block
    expected[:, :, 0, 1] = expected[:, :, 1, 0]
    np.testing.assert_array_equal(held(), expected)
    slots.move(2, 0)  # every block of slot 2 into slot 0
    expected[:, :, :, 0] = expected[:, :, :, 2]
    np.testing.assert_array_equal(held(), expected)
    slots.move(0, 1)
    expected[:, :, :, 1] = expected[:, :, :, 0]
    np.testing.assert_array_equal(held(), expected)
