"""LiteRT export (`tfgpt2.formats.litert`): the two signatures read by a greedy loop written
here against the documented contract (docs/litert.md), with `ai_edge_litert` alone, give
`generate`'s tokens; the int8 file agrees with the float32 one and is under 0.35 of its size;
the host loop (`generate_litert`) samples as `generate`; bad input fails naming the value.

One model, std 0.1 weights, n_embd 128 (at n_embd 64 the token table is 99% of the weights
and the int8 file's per-row scales, 0.6 MB per signature, alone keep it above 0.35)."""
import numpy as np
import pytest

from tests.helpers import TINY

pytest.importorskip("ai_edge_litert", reason="ai-edge-litert is not installed (requirements.txt)")

from tfgpt2.cli.export import main as export_main  # noqa: E402
from tfgpt2.cli.generate import main as generate_main  # noqa: E402

pytestmark = pytest.mark.own_process  # its programs compiled in a process of its own (tests/own_process.py)

HPARAMS = dict(TINY, n_embd=128)
PROMPTS = ([464], [464, 3290, 286, 1204, 318, 257, 1332, 11, 290, 340, 373])  # 1 and 11 tokens


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The model folder, its model, and its LiteRT files {quantize: path}, float32 and int8."""
    from tfgpt2 import load_model
    from tfgpt2.formats.litert import export_litert
    from tfgpt2.hparams import default_hparams
    from tfgpt2.testing.checkpoints import make_checkpoint
    folder = tmp_path_factory.mktemp("litert")
    model_dir = make_checkpoint(str(folder / "small"), default_hparams().override_from_dict(HPARAMS), std=0.1, seed=2)
    model = load_model(model_dir)
    files = {q: str(folder / f"{q}.tflite") for q in ("none", "int8")}
    assert export_main(["--format", "litert", "--quiet", "--model_dir", model_dir, files["none"]]) == 0
    export_litert(model, files["int8"], quantize="int8")
    return model_dir, model, files


def greedy(path, prompt, steps):
    """The contract, read with ai_edge_litert alone: prefill the prompt, then decode the argmax
    at each position. Returns the new tokens and each step's logits."""
    from ai_edge_litert.interpreter import Interpreter
    interpreter = Interpreter(model_path=path)
    prefill, decode = interpreter.get_signature_runner("prefill"), interpreter.get_signature_runner("decode")
    out = prefill(input_ids=np.array([prompt], np.int32))
    tokens, logits = [], []
    for i in range(steps):
        logits.append(out["logits"][0])
        tokens.append(int(np.argmax(out["logits"][0])))
        cache = {name: value for name, value in out.items() if name.startswith("cache")}
        out = decode(input_ids=np.array([[tokens[-1]]], np.int32), position=np.array(len(prompt) + i, np.int32),
                     **cache)
    return tokens, np.stack(logits)


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS, ids=["1-token", "11-tokens"])
def test_float32_greedy_loop_is_generate(small, prompt):
    """Exactly `generate`'s tokens at temperature 0, and every step's logits within 1e-4 of one
    uncached forward pass over the whole sequence."""
    from tfgpt2 import generate
    _, model, files = small
    steps = 24
    tokens, logits = greedy(files["none"], prompt, steps)
    expected = generate(model, [prompt], steps, temperature=0)[0]
    assert tokens == expected[len(prompt):].tolist()
    full = model([prompt + tokens[:-1]])["logits"][0, len(prompt) - 1:].numpy()
    np.testing.assert_allclose(logits, full, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_int8_agrees_with_float32_and_is_small(small):
    """The int8 file's greedy choice along the float32 file's greedy sequence (teacher forced),
    32 steps after each of 4 prompts: measured 0.91 to 1.0 a prompt over 12 random prompts
    (these weights' logits are flat: std 0.1 random weights), 0.94 on average; max logit
    difference 0.14 to 0.21. Size: 0.31 of the float32 file (measured), which holds each weight
    once."""
    import os
    from ai_edge_litert.interpreter import Interpreter
    _, _, files = small
    runners = {q: Interpreter(model_path=files[q]) for q in files}
    rng = np.random.default_rng(0)
    agree = []
    for length in (1, 5, 12, 25):
        prompt = rng.integers(0, HPARAMS["n_vocab"], length).tolist()
        tokens, _ = greedy(files["none"], prompt, 32)
        outs = {q: runner.get_signature_runner("prefill")(input_ids=np.array([prompt], np.int32))
                for q, runner in runners.items()}
        for i, token in enumerate(tokens):
            agree.append(int(np.argmax(outs["int8"]["logits"][0])) == token)
            assert int(np.argmax(outs["none"]["logits"][0])) == token
            outs = {q: runners[q].get_signature_runner("decode")(
                input_ids=np.array([[token]], np.int32), position=np.array(length + i, np.int32),
                **{k: v for k, v in outs[q].items() if k.startswith("cache")}) for q in runners}
    assert np.mean(agree) >= 0.9, f"int8 agreed at {np.mean(agree):.2f} of {len(agree)} steps"
    ratio = os.path.getsize(files["int8"]) / os.path.getsize(files["none"])
    assert ratio <= 0.35, f"int8 file is {ratio:.2f} of the float32 file"
    # each weight once, shared by both signatures (measured 1.002 of 4 bytes a parameter)
    assert os.path.getsize(files["none"]) <= 1.01 * 4 * small[1].count_params()


@pytest.mark.slow
def test_host_loop_samples_as_generate(small):
    """`generate_litert` draws what `generate` draws (same seed, top-k, rows of two lengths),
    and stops at eot as it does."""
    from tfgpt2 import generate
    from tfgpt2.formats.litert import generate_litert
    _, model, files = small
    prompts = [list(p) for p in PROMPTS]
    options = dict(temperature=1.0, top_k=40, top_p=0.9, seed=7)
    expected = generate(model, prompts, 12, **options)
    got = generate_litert(files["none"], prompts, 12, **options)
    assert [g.tolist() for g in got] == [e.tolist() for e in expected]
    eot = int(expected[1][len(prompts[1]) + 3])  # a token the second row draws at its fourth step
    stopped = generate_litert(files["none"], prompts, 12, stop_at_eot=True, eot=eot, **options)
    assert stopped[1].tolist() == expected[1][:len(prompts[1]) + 4].tolist()


@pytest.mark.slow
def test_bad_input_is_named(small, tmp_path):
    """An unknown quantization, a prompt over n_ctx, a position past the cache, an id outside
    the vocabulary: ValueErrors naming the value; the file itself answers NaN at a position
    past its cache (a file cannot raise)."""
    from tfgpt2.formats.litert import LiteRTModel, export_litert, generate_litert
    _, model, files = small
    with pytest.raises(ValueError, match="quantize must be one of none, float16, int8; got 'int4'"):
        export_litert(model, str(tmp_path / "x.tflite"), quantize="int4")
    assert not list(tmp_path.iterdir())
    litert = LiteRTModel(files["none"])
    n_ctx = HPARAMS["n_ctx"]
    with pytest.raises(ValueError, match=f"prefill takes 1 to n_ctx={n_ctx} token ids; got shape \\[{n_ctx + 1}\\]"):
        litert.prefill([1] * (n_ctx + 1))
    logits, cache = litert.prefill([1, 2, 3])
    with pytest.raises(ValueError, match=f"position {n_ctx} is past the cache of n_ctx={n_ctx} slots"):
        litert.decode(4, n_ctx, cache)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, n_vocab=50257\); got \[50257\]"):
        litert.decode(50257, 3, cache)
    with pytest.raises(ValueError, match=rf"prompt of 60 tokens \+ length 10 - 1"
                       rf" exceeds the context window n_ctx={n_ctx}"):
        generate_litert(litert, [[1] * 60], 10)
    raw = litert._decode(input_ids=np.array([[4]], np.int32), position=np.array(n_ctx, np.int32), **cache)
    assert np.isnan(raw["logits"]).all()
    assert np.isfinite(litert.decode(4, 3, cache)[0]).all()


@pytest.mark.slow
def test_generate_command_runs_the_file(small, capsys):
    """`tfgpt2 generate --litert FILE` prints the file's greedy continuation."""
    from tfgpt2.encoder import default_encoder
    _, _, files = small
    enc = default_encoder()
    prompt = "The meaning of life is"
    generate_main(["--litert", files["none"], "--prompt", prompt, "--length", "6", "--temperature", "0", "--quiet"])
    tokens, _ = greedy(files["none"], enc.encode(prompt), 6)
    assert capsys.readouterr().out.endswith("\n" + enc.decode(tokens) + "\n")


def test_export_command_refuses_bad_flags(tmp_path, capsys):
    """An unknown --quantize, --quantize for a SavedModel, SavedModel flags for LiteRT: usage
    errors before any model is loaded."""
    for argv, message in [
        (["--format", "litert", "--quantize", "int4"], "argument --quantize: invalid choice: 'int4'"),
        (["--quantize", "int8"], "--quantize applies to --format litert"),
        (["--format", "litert", "--version", "2"], "--version do not apply to --format litert"),
    ]:
        with pytest.raises(SystemExit) as exit:
            export_main(argv + ["--model_dir", str(tmp_path / "none"), str(tmp_path / "out")])
        assert exit.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_an_existing_file_is_kept_and_another_file_named(tmp_path, capsys, signals):
    """`export --format litert` over an existing file: refused (it is unchanged) unless
    --overwrite, before any model is loaded; `generate --litert` on a file that is no LiteRT
    file names it; --overwrite is a usage error for a SavedModel (a version is never replaced)."""
    path = tmp_path / "gpt2.tflite"
    path.write_bytes(b"an earlier export")
    with pytest.raises(SystemExit) as exit:
        export_main(["--format", "litert", "--model_dir", str(tmp_path / "none"), str(path)])
    assert exit.value.code == 1
    assert capsys.readouterr().err == f"error: {path} exists; choose another name, or pass --overwrite to replace it\n"
    with pytest.raises(SystemExit) as exit:  # with --overwrite it goes on, to the missing model
        export_main(["--format", "litert", "--overwrite", "--model_dir", str(tmp_path / "none"), str(path)])
    assert "none: no such model folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        export_main(["--overwrite", "--model_dir", str(tmp_path / "none"), str(tmp_path / "exports")])
    assert exit.value.code == 2 and "--overwrite applies to --format litert" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        generate_main(["--litert", str(path), "--nsamples", "1"])
    assert exit.value.code == f"error: {path}: not a LiteRT file (The model is not a valid Flatbuffer buffer)"
    assert path.read_bytes() == b"an earlier export"


@pytest.mark.slow
def test_client_example_needs_no_tfgpt2(small):
    """examples/litert_client.py imports neither tfgpt2 nor TensorFlow, and its greedy
    continuation is the contract's."""
    import ast
    import subprocess
    import sys
    from tests.helpers import ROOT
    script = ROOT / "examples" / "litert_client.py"
    imported = {alias.name.split(".")[0] for node in ast.walk(ast.parse(script.read_text()))
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(ast.parse(script.read_text()))
                 if isinstance(node, ast.ImportFrom)}
    assert imported == {"argparse", "numpy", "ai_edge_litert", "tiktoken"}
    _, _, files = small
    prompt = list(PROMPTS[1])
    out = subprocess.run([sys.executable, str(script), files["none"], "--ids", ",".join(map(str, prompt)),
                          "--length", "8", "--temperature", "0"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ",".join(map(str, greedy(files["none"], prompt, 8)[0]))
