"""GGUF files for llama.cpp (`tfgpt2.formats.gguf_file`, `tfgpt2 convert --to gguf`), read back
with `gguf` (the llama.cpp project's package) and, where llama-cpp-python is installed, run by
llama.cpp itself against tfgpt2's logits and tokenizer."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package (requirements.txt) is not installed")

from tests.helpers import TINY  # noqa: E402
from tfgpt2.cli import convert as convert_cli  # noqa: E402
from tfgpt2.encoder import ASSETS_DIR, default_encoder  # noqa: E402
from tfgpt2.formats.gguf_file import export_gguf, write_gguf  # noqa: E402
from tfgpt2.formats.hf_kerashub import load, read  # noqa: E402
from tfgpt2.hparams import default_hparams  # noqa: E402
from tfgpt2.testing.checkpoints import make_checkpoint  # noqa: E402

VOCAB = [os.path.join(ASSETS_DIR, name) for name in ("encoder.json", "vocab.bpe")]
TOKENS = np.random.default_rng(3).integers(0, 50257, size=40).tolist()
# llama.cpp's names for one block's tensors, with the checkpoint's, written out independently
# of the module (llama.cpp's gguf-py: MODEL_ARCH.GPT2)
BLOCK = {"attn_norm.weight": "ln_1/g", "attn_norm.bias": "ln_1/b", "attn_qkv.weight": "attn/c_attn/w",
         "attn_qkv.bias": "attn/c_attn/b", "attn_output.weight": "attn/c_proj/w",
         "attn_output.bias": "attn/c_proj/b", "ffn_norm.weight": "ln_2/g", "ffn_norm.bias": "ln_2/b",
         "ffn_up.weight": "mlp/c_fc/w", "ffn_up.bias": "mlp/c_fc/b", "ffn_down.weight": "mlp/c_proj/w",
         "ffn_down.bias": "mlp/c_proj/b"}
TYPES = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0"}


def expected_tensors(tensors, n_layer):
    """llama.cpp's name -> (the checkpoint's value as llama.cpp's [out, in], whether a matrix
    in the file's own type)."""
    names = {"token_embd.weight": "model/wte", "position_embd.weight": "model/wpe",
             "output_norm.weight": "model/ln_f/g", "output_norm.bias": "model/ln_f/b"}
    names.update({f"blk.{i}.{theirs}": f"model/h{i}/{ours}" for i in range(n_layer) for theirs, ours in BLOCK.items()})
    if "model/out_head" in tensors:
        names["output.weight"] = "model/out_head"
    return {theirs: (tensors[ours][0].T if tensors[ours].ndim == 3 else tensors[ours],
                     tensors[ours].ndim > 1 and theirs != "position_embd.weight") for theirs, ours in names.items()}


def assert_rounded(got, value, kind, name):
    """got (read back) is value rounded to `kind`: F32 exactly; F16 to float16's half step;
    Q8_0 to half a step of its block's scale (abs max / 127, itself in float16)."""
    if kind == "F32":
        np.testing.assert_array_equal(got, value, err_msg=name)
        return
    error = np.abs(got - value)
    if kind == "F16":
        bound = np.abs(value) * 2.0 ** -11 + 2.0 ** -25
    else:
        blocks = np.abs(value).reshape(*value.shape[:-1], -1, 32).max(-1, keepdims=True)
        bound = np.broadcast_to(blocks / 127 * (0.5 + 2.0 ** -10), (*value.shape[:-1], value.shape[-1] // 32, 32))
        bound = bound.reshape(value.shape) + np.abs(value) * 2.0 ** -11
    assert (error <= bound).all(), f"{name}: {kind} off by {error.max():.3g} (> its rounding)"
    assert error.max() > 0, f"{name}: stored exactly, not as {kind}"


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    """Tiny hparams with its own output layer and 3 rows more than the vocabulary has tokens."""
    hparams = default_hparams().override_from_dict(dict(TINY, n_vocab=50260))
    return make_checkpoint(str(tmp_path_factory.mktemp("models") / "untied"), hparams, std=0.3, seed=5,
                           tie_embeddings=False)


class Written:
    """Each outtype's GGUF file and its reader, made once, when a test first asks (a reader
    parses every token and merge: seconds): f32 of `untied_dir`, f16 and q8_0 of `tiny_dir`."""

    def __init__(self, folder, models):
        self.folder, self.models, self.files, self.readers = folder, models, {}, {}

    def file(self, outtype):
        """(model folder, its GGUF file of `outtype`)."""
        if outtype not in self.files:
            model = self.models[outtype]
            self.files[outtype] = model, export_gguf(model, str(self.folder / f"{outtype}.gguf"), outtype=outtype)
        return self.files[outtype]

    def reader(self, outtype):
        if outtype not in self.readers:
            self.readers[outtype] = gguf.GGUFReader(self.file(outtype)[1])
        return self.readers[outtype]


@pytest.fixture(scope="module")
def written(tiny_dir, untied_dir, tmp_path_factory):
    return Written(tmp_path_factory.mktemp("gguf"), dict(f32=untied_dir, f16=tiny_dir, q8_0=tiny_dir))


@pytest.mark.parametrize("outtype", ["f32", pytest.param("f16", marks=pytest.mark.slow),
                                     pytest.param("q8_0", marks=pytest.mark.slow)])  # the quick tier: one reader
def test_every_tensor_reads_back_within_its_rounding(written, outtype):
    """Every tensor of the checkpoint (an untied output layer as `output.weight`) under
    llama.cpp's name, in llama.cpp's shape and the type's rounding of its value."""
    (model, _), reader = written.file(outtype), written.reader(outtype)
    hparams, tensors = read(model, "openai")
    expected = expected_tensors(tensors, hparams.n_layer)
    assert sorted(t.name for t in reader.tensors) == sorted(expected)
    for t in reader.tensors:
        value, matrix = expected[t.name]
        kind = TYPES[outtype] if matrix else "F32"
        assert t.tensor_type.name == kind, t.name
        assert list(t.shape) == list(value.shape[::-1]), t.name  # ggml's order: the fastest axis first
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(value.shape)
        assert_rounded(got.astype(np.float32), value, kind, t.name)
    assert field(reader, "general.file_type") == {"f32": 0, "f16": 1, "q8_0": 7}[outtype]


def field(reader, key):
    return reader.fields[key].contents()


def test_metadata_and_tokenizer(written):
    """The keys llama.cpp reads for GPT-2: hparams, and the byte-level BPE vocabulary in id
    order with its merges in rank order, <|endoftext|> a control token, BOS and EOS, not added;
    a model with more rows than tokens gets unused [PAD<i>] tokens."""
    reader = written.reader("f32")
    assert field(reader, "general.architecture") == "gpt2"
    assert field(reader, "general.name") == "untied"
    for key, value in (("context_length", TINY["n_ctx"]), ("embedding_length", TINY["n_embd"]),
                       ("feed_forward_length", 4 * TINY["n_embd"]), ("block_count", TINY["n_layer"]),
                       ("attention.head_count", TINY["n_head"])):
        assert field(reader, f"gpt2.{key}") == value, key
    assert field(reader, "gpt2.attention.layer_norm_epsilon") == pytest.approx(1e-5)
    assert (field(reader, "tokenizer.ggml.model"), field(reader, "tokenizer.ggml.pre")) == ("gpt2", "gpt-2")
    encoder = default_encoder()
    tokens = field(reader, "tokenizer.ggml.tokens")
    assert tokens == sorted(encoder.encoder, key=encoder.encoder.get) + ["[PAD50257]", "[PAD50258]", "[PAD50259]"]
    types = field(reader, "tokenizer.ggml.token_type")
    assert types[50256] == 3 and set(types[:50256]) == {1} and types[50257:] == [5, 5, 5]  # CONTROL, NORMAL, UNUSED
    with open(VOCAB[1], encoding="utf-8") as f:
        assert field(reader, "tokenizer.ggml.merges") == f.read().splitlines()[1:]
    assert field(reader, "tokenizer.ggml.bos_token_id") == field(reader, "tokenizer.ggml.eos_token_id") == 50256
    assert field(reader, "tokenizer.ggml.add_bos_token") is False


def test_a_vocabulary_larger_than_the_model_is_refused(tiny_dir, tmp_path):
    """llama.cpp needs a row of the embedding for each token: a model with fewer is refused."""
    hparams, tensors = read(tiny_dir, "openai")
    small = default_hparams().override_from_dict(dict(TINY, n_vocab=1000))
    tensors["model/wte"] = tensors["model/wte"][:1000]
    with pytest.raises(ValueError, match=r"encoder.json: the vocabulary has 50257 tokens, more than the model's "
                                         r"n_vocab 1000"):
        write_gguf(small, tensors, str(tmp_path / "small.gguf"), vocab=VOCAB)
    assert os.listdir(tmp_path) == []


def test_write_is_atomic(tiny_dir, tmp_path, monkeypatch):
    """A write that fails part way leaves no file, temporary or final."""
    def fail(self, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail)
    with pytest.raises(OSError, match="disk full"):
        export_gguf(tiny_dir, str(tmp_path / "tiny.gguf"))
    assert os.listdir(tmp_path) == []


def test_command_line_and_a_run_folder(tiny_dir, written, tmp_path, capsys):
    """`tfgpt2 convert --to gguf` from a training run folder (its latest model-<step>, here the
    tiny model's weights, under the same name): the files `export_gguf` writes from the model
    folder; --outtype only with gguf; an existing file kept unless --overwrite."""
    run = tmp_path / "checkpoint" / os.path.basename(tiny_dir)
    run.mkdir(parents=True)
    for name in os.listdir(tiny_dir):
        shutil.copy(os.path.join(tiny_dir, name), run / name.replace("model.ckpt", "model-7"))
    (run / "checkpoint").write_text('model_checkpoint_path: "model-7"\nall_model_checkpoint_paths: "model-7"\n')
    (run / "counter").write_text("7\n")
    dst = str(tmp_path / "run-q8_0.gguf")
    assert convert_cli.main(["--from", "openai", "--to", "gguf", str(run), dst, "--outtype", "q8_0"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert same_bytes(dst, written.file("q8_0")[1])
    with pytest.raises(SystemExit) as exit:
        convert_cli.main(["--from", "openai", "--to", "gguf", tiny_dir, dst])
    assert exit.value.code == 1 and "run-q8_0.gguf exists; choose another name, or pass --overwrite" in \
        capsys.readouterr().err
    assert convert_cli.main(["--from", "openai", "--to", "gguf", tiny_dir, dst, "--overwrite", "--quiet"]) == 0
    assert same_bytes(dst, written.file("f16")[1])  # f16, the default
    with pytest.raises(SystemExit) as exit:
        convert_cli.main(["--from", "openai", "--to", "hf", tiny_dir, str(tmp_path / "hf"), "--outtype", "f16"])
    assert exit.value.code == 2 and "--outtype is for --to gguf only" in capsys.readouterr().err


def same_bytes(a, b):
    with open(a, "rb") as f, open(b, "rb") as g:
        return f.read() == g.read()


# llama.cpp's logits of TOKENS and its ids for a text, in a child process (a crash of the
# library cannot take the test worker down); exit 3 where llama-cpp-python cannot be imported
LLAMA_CPP = """
import json, sys
import numpy as np
try:
    import llama_cpp
except Exception as e:
    print(f"{type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(3)
path, tokens, text, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
llm = llama_cpp.Llama(model_path=path, n_ctx=len(tokens), logits_all=True, verbose=False, n_threads=1,
                      type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
llm.eval(tokens)
np.savez(out, logits=np.asarray(llm.scores[:len(tokens)], np.float32),
         ids=np.asarray(llm.tokenize(text.encode(), add_bos=False, special=False)))
"""


def run_llama_cpp(path, tokens, text, out):
    """(llama.cpp's logits of `tokens` [T, n_vocab], its ids of `text`), or a skip saying why
    llama.cpp is not at hand."""
    done = subprocess.run([sys.executable, "-c", LLAMA_CPP, path, json.dumps(tokens), text, out],
                          capture_output=True, text=True)
    if done.returncode == 3:
        pytest.skip(f"llama.cpp is not at hand (pip install llama-cpp-python): {done.stderr.strip()}")
    assert done.returncode == 0, f"llama.cpp failed on {path}: exit {done.returncode}\n{done.stderr[-2000:]}"
    found = np.load(out)
    return found["logits"], found["ids"].tolist()


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_llama_cpp_gives_tfgpt2s_logits_and_tokens(written, tmp_path, outtype):
    """llama.cpp on the file: in f32 (the untied model; llama.cpp's cache in f32 too) the
    logits of tfgpt2's float32 model (but for llama.cpp's GELU, read from a float16 table);
    in q8_0 (its products quantize the activations too) close to them, with the same top token
    at almost every position. Its tokenizer gives tfgpt2's ids."""
    model, path = written.file(outtype)
    text = "Hello world, it's 2024!\n  GPT-2's tokenizer:\tdone <|endoftext|>"
    theirs, ids = run_llama_cpp(path, TOKENS, text, str(tmp_path / "llama.npz"))
    ours = load(model, "openai")([TOKENS])["logits"].numpy()[0]
    scale = np.abs(ours).max()
    assert scale > 3, "weights too small for a meaningful comparison"
    error = np.abs(theirs - ours)
    bound = {"f32": (1e-3, 1e-4), "q8_0": (0.1, 0.01)}[outtype]  # (max, mean) as parts of the scale
    assert error.max() <= bound[0] * scale and error.mean() <= bound[1] * scale, (error.max(), error.mean(), scale)
    assert (theirs.argmax(-1) == ours.argmax(-1)).mean() >= (1 if outtype == "f32" else 0.9)
    assert ids == default_encoder().encode(text)
