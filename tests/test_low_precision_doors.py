"""bfloat16 and int8 (`--dtype int8`: `model.quantize("int8")`) generation at every door the
engine serves, against the model's own eager logits at that precision: each greedy token, fed
back, is the eager argmax, and the log-probabilities the doors report are the eager ones.

int8 is exact to float32's rounding: the tokens are identical. bfloat16 rounds the logits to 8
significant bits (1/8 at 16-32), and XLA's programs keep float32 between fused operations where
eager rounds after each, so the same step differs by about one such step of the logits:
there a token may be another within `TOLERANCE` of the eager maximum (a near tie), never one
further below it. How far they part depends on the CPU's kernels (native BF16 products or
float32 ones rounded). Measured on this file's model and prompts (logits 10-14, a bfloat16
step 1/16): int8 log-probabilities within 5e-6 of eager; bfloat16 within 0.11 on an Intel Xeon
with AVX-512 BF16 and 0.19 on an AMD EPYC with AVX2 alone, tokens identical but for near ties
of 0.19 or less (3 steps of the logits).

The commands and bulk generation load the module's model through `load_model` (patched: the
test checks the --dtype each one asks for); the server's app and the SavedModel's `generate`
run their own programs over it."""
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tfgpt2 import kernels
from tfgpt2.decoding import layouts
from tfgpt2.encoder import get_encoder

# compiles every door's programs, twice, in a process of its own (tests/own_process.py)
pytestmark = [pytest.mark.slow, pytest.mark.own_process]
LENGTH = 12
PROMPTS = ["The cat sat on", "Every effort moves you, and"]
TOLERANCE = {"int8": 1e-4, "bfloat16": 0.25}  # log-probabilities and near ties, in nats and logits


@pytest.fixture(scope="module", params=["bfloat16", "int8"])
def dtype(request):
    return request.param


@pytest.fixture(scope="module")
def model(tiny_dir, dtype):
    from tfgpt2 import load_model
    return load_model(tiny_dir, dtype=dtype)


@pytest.fixture(scope="module")
def enc(tiny_dir):
    return get_encoder(os.path.basename(tiny_dir), os.path.dirname(tiny_dir))


@pytest.fixture(scope="module")
def prompts(enc):
    return [enc.encode(p) for p in PROMPTS]


@pytest.fixture
def asked(model, monkeypatch):
    """The dtypes the commands ask `load_model` for; each gets the module's model."""
    from tfgpt2.formats import checkpoint
    dtypes = []

    def load_model(folder, dtype=None, **options):
        dtypes.append(dtype)
        return model
    monkeypatch.setattr(checkpoint, "load_model", load_model)
    return dtypes


def eager_logits(model, prompt, tokens):
    """The float32 logits [len(tokens), n_vocab] before each new token: one eager forward pass
    over the prompt and the new tokens (no cache, no XLA)."""
    return model(tf.constant([prompt + tokens[:-1]]))["logits"].numpy()[0, len(prompt) - 1:]


def assert_eager(model, dtype, prompt, tokens, logprobs=None):
    """`tokens` greedy by the eager logits (exactly, or within TOLERANCE of the maximum in
    bfloat16), and `logprobs` (of each token, where a door reports them) the eager ones."""
    assert len(tokens) == LENGTH
    logits = eager_logits(model, prompt, tokens)
    chosen = logits[np.arange(LENGTH), tokens]
    if dtype == "int8":
        assert tokens == logits.argmax(-1).tolist()
    else:
        below = logits.max(-1) - chosen
        assert below.max() <= TOLERANCE[dtype], f"a token {below.max():.3f} below the eager maximum"
    if logprobs is not None:
        expected = tf.nn.log_softmax(logits).numpy()[np.arange(LENGTH), tokens]
        np.testing.assert_allclose(logprobs, expected, atol=TOLERANCE[dtype], rtol=0)


def test_load_model_dtype(model, dtype):
    """bfloat16: every variable; int8: the blocks' weights int8 with float32 scales, and an int8
    copy of wte for the logits, the rest float32."""
    kinds = {v.path.split("/")[-1]: v.dtype for v in model.weights}
    if dtype == "bfloat16":
        assert set(kinds.values()) == {"bfloat16"}
    else:
        assert kinds["w"] == "int8" and kinds["w_scale"] == "float32" and kinds["wte"] == "float32"
        assert kinds["wte_int8"] == "int8" and kinds["wte_scale"] == "float32"
        assert all(conv.quantization_mode == "int8" for block in model.h
                   for conv in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj))


@pytest.fixture(scope="module")
def library(model, dtype, prompts, enc):
    """The library's greedy completions of both prompts, in one batch, with log-probabilities."""
    from tfgpt2 import generate
    return generate(model, prompts, LENGTH, temperature=0, logprobs=1, encoder=enc)


def test_library(library, model, dtype, prompts):
    for prompt, row in zip(prompts, library):
        assert_eager(model, dtype, prompt, row.new_tokens.tolist(), [lp for lp, _ in row.logprobs])


def test_a_bfloat16_prompt_read_apart_from_xla(model, dtype, prompts, enc, monkeypatch):
    """Where the CPU has BF16 instructions (forced here, on any CPU) a bfloat16 prompt's pass runs
    outside XLA, on TensorFlow's kernels (`Generator.prompt_apart`), the loop in XLA after it:
    the library's completions, whole and streamed, are still greedy by the eager logits. int8
    reads its prompt in XLA."""
    from tfgpt2 import generate
    from tfgpt2.decoding import layouts
    from tfgpt2.decoding.generator import generator_for
    monkeypatch.setattr(layouts, "native_bfloat16", lambda: True)
    generator = generator_for(model)
    assert generator.prompt_apart(8) is (dtype == "bfloat16") and not generator.prompt_apart(1)
    if dtype == "bfloat16":  # neither XLA program that reads a prompt is there to run
        monkeypatch.setattr(generator, "generate_padded", None)
        monkeypatch.setattr(generator, "start", None)
    rows = generate(model, prompts, LENGTH, temperature=0, logprobs=1, encoder=enc)
    for prompt, row in zip(prompts, rows):
        assert_eager(model, dtype, prompt, row.new_tokens.tolist(), [lp for lp, _ in row.logprobs])
    streamed = list(generate(model, prompts, LENGTH, temperature=0, encoder=enc, stream=True))
    assert ["".join(texts) for texts in zip(*streamed)] == [row.text for row in rows]


def test_generate_command_prints_the_library_text(tiny_dir, library, dtype, asked, capsys):
    from tfgpt2.cli import generate
    for prompt, row in zip(PROMPTS, library):
        generate.main(["--model_dir", tiny_dir, "--prompt", prompt, "--length", str(LENGTH), "--temperature", "0",
                       "--dtype", dtype, "--quiet"])
        assert capsys.readouterr().out.split("=" * 40 + " SAMPLE 1 " + "=" * 40 + "\n")[1].startswith(row.text)
    assert asked == [dtype] * 2


def test_generate_batch(tiny_dir, model, dtype, prompts, asked, tmp_path):
    from tfgpt2.cli import generate_batch
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(dict(prompt=p, temperature=0)) + "\n" for p in PROMPTS))
    assert generate_batch.main(["--model_dir", tiny_dir, "--input", str(src), "--output", str(out), "--length",
                                str(LENGTH), "--batch_size", "2", "--dtype", dtype, "--quiet"]) == 0
    rows = sorted((json.loads(line) for line in open(out)), key=lambda r: r["line"])
    assert len(rows) == 2 and asked == [dtype]
    for prompt, row in zip(prompts, rows):
        assert_eager(model, dtype, prompt, row["tokens"])


def test_serve(tiny_dir, model, dtype, prompts, enc, asked, monkeypatch):
    """`tfgpt2 serve --dtype` hands the model to the app; its scheduler's slots answer greedy
    completions with their log-probabilities."""
    from fastapi.testclient import TestClient
    from tfgpt2.cli import serve
    from tfgpt2.decoding.text import token_text
    from tfgpt2.decoding.stops import Vocabulary
    from tfgpt2.serve import app
    from tfgpt2.serve.scheduler import Scheduler
    served = []
    monkeypatch.setattr(app, "serve", lambda model, encoder, **options: served.append(model))
    assert serve.main(["--model_dir", tiny_dir, "--dtype", dtype, "--quiet"]) == 0
    assert asked == [dtype] and served == [model]
    scheduler = Scheduler(model, max_batch=4, max_queue=8, chunk=16, eot=enc.eot_token, vocabulary=Vocabulary.of(enc))
    with TestClient(app.create_app(scheduler, model_name="tiny", encoder=enc, hparams=model.hparams)) as client:
        answer = client.post("/v1/completions", json=dict(model="tiny", prompt=prompts, max_tokens=LENGTH,
                                                          temperature=0, logprobs=1))
        # one prompt alone: steps of one row (a 16-bit model's read its 16-bit [nf, nx] copies, an
        # int8 model's its own weights by the row kernels where they run here)
        alone = client.post("/v1/completions", json=dict(model="tiny", prompt=prompts[0], max_tokens=LENGTH,
                                                         temperature=0, logprobs=1))
    assert answer.status_code == 200 and alone.status_code == 200, answer.text + alone.text
    one_row = scheduler.slots._layouts(1)
    rows = kernels.supports(dtype)
    assert layouts.by_rows(one_row) == rows and (one_row is not None or dtype == "int8")
    assert one_row is None or tf.nest.flatten(one_row[0][0])[0].dtype == tf.as_dtype(dtype)
    word = enc.encoding.decode_single_token_bytes
    ids = {token_text(word(t)): t for t in range(enc.n_vocab)}  # the tokens as OpenAI's logprobs show them
    choices = sorted(answer.json()["choices"], key=lambda c: c["index"]) + alone.json()["choices"]
    for prompt, choice in zip(prompts + prompts[:1], choices):
        assert_eager(model, dtype, prompt, [ids[t] for t in choice["logprobs"]["tokens"]],
                     choice["logprobs"]["token_logprobs"])


def test_saved_model(tiny_dir, model, dtype, prompts, asked, tmp_path):
    """`tfgpt2 export --dtype`: the SavedModel keeps the dtype's variables; its `generate`
    signature, loaded by TensorFlow alone, is greedy by the eager logits."""
    from tfgpt2.cli import export
    assert export.main(["--model_dir", tiny_dir, "--dtype", dtype, "--quiet", str(tmp_path / "export")]) == 0
    assert asked == [dtype]
    path = str(tmp_path / "export" / "1")
    stored = set(tf.train.load_checkpoint(os.path.join(path, "variables", "variables"))
                 .get_variable_to_dtype_map().values())
    assert tf.as_dtype(dtype) in stored
    if dtype == "int8":  # the int8 copy of wte the logits read
        shapes = tf.train.load_checkpoint(os.path.join(path, "variables", "variables")).get_variable_to_shape_map()
        assert model.logits_int8.shape.as_list() in shapes.values()
    width = max(map(len, prompts))
    ids = [[0] * (width - len(p)) + p for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    out = tf.saved_model.load(path).signatures["generate"](
        input_ids=tf.constant(ids), attention_mask=tf.constant(mask), max_new_tokens=tf.constant(LENGTH),
        temperature=tf.constant(0.0), top_k=tf.constant(0), top_p=tf.constant(1.0), seed=tf.constant(0, tf.int64))
    for prompt, row in zip(prompts, out["output_ids"].numpy().tolist()):
        assert_eager(model, dtype, prompt, row[width:])
