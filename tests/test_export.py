"""tfgpt2/formats/saved_model.py and `tfgpt2 export` (tfgpt2/cli/export.py): the SavedModel,
loaded with TensorFlow alone.

Requests to a loaded SavedModel run in one fresh process per model (`serve`), which must not
import tfgpt2; each test compares its share of the answers with the library in this process.
XLA compiles once per (batch, prompt bucket, total bucket), seconds each, so requests share
a few shapes.
"""
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

from tests.helpers import ATOL, products
from tfgpt2.formats.saved_model import by_device, checkpoint_bytes, export_saved_model, folder_bytes
from tfgpt2.sample import generate
from tfgpt2.cli.export import main as export_main

pytestmark = pytest.mark.slow  # SavedModels exported and served in fresh processes

SAVED_MODEL_CLI = os.path.join(os.path.dirname(sys.executable), "saved_model_cli")

CHILD = """
import pickle, sys
import tensorflow as tf
requests, results = sys.argv[1:]
loaded, answers = {}, {}
for name, (saved_model, signature, inputs) in pickle.load(open(requests, "rb")).items():
    if saved_model not in loaded:
        loaded[saved_model] = tf.saved_model.load(saved_model)
    try:
        outputs = loaded[saved_model].signatures[signature](**{k: tf.constant(v) for k, v in inputs.items()})
        answers[name] = {k: v.numpy() for k, v in outputs.items()}
    except Exception as e:
        answers[name] = f"{type(e).__name__}: {e}"
answers["tfgpt2 modules"] = [m for m in sys.modules if m.split(".")[0] == "tfgpt2"]
pickle.dump(answers, open(results, "wb"))
"""


def serve(requests, tmp, **environ):
    """Each request {name: (SavedModel path, signature, inputs)} answered by a fresh process that
    imports only TensorFlow (with `environ` added to its environment): {name: outputs as arrays,
    or 'ErrorType: message'}."""
    with open(tmp / "requests.pkl", "wb") as f:
        pickle.dump(requests, f)
    # the repository off the path (TensorFlow alone), but not where TensorFlow itself is
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and not os.path.isdir(os.path.join(p, "tfgpt2"))]
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **environ}
    if path:
        env["PYTHONPATH"] = os.pathsep.join(path)
    result = subprocess.run([sys.executable, "-c", CHILD, str(tmp / "requests.pkl"), str(tmp / "results.pkl")],
                            cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp / "results.pkl", "rb") as f:
        answers = pickle.load(f)
    assert answers.pop("tfgpt2 modules") == []
    return answers


def ids(seed, batch, length, n_vocab=50257):
    return np.random.default_rng(seed).integers(0, n_vocab, size=(batch, length), dtype=np.int32)


def left_pad(prompts, width):
    """(input_ids, attention_mask) with each prompt at the right end of a row of `width`."""
    input_ids = np.zeros([len(prompts), width], np.int32)
    mask = np.zeros([len(prompts), width], np.int32)
    for row, p in enumerate(prompts):
        input_ids[row, width - len(p):] = p
        mask[row, width - len(p):] = 1
    return input_ids, mask


def options(max_new_tokens, *, temperature=1.0, top_k=1, top_p=1.0, seed=0):
    return dict(max_new_tokens=np.int32(max_new_tokens), temperature=np.float32(temperature),
                top_k=np.int32(top_k), top_p=np.float32(top_p), seed=np.int64(seed))


def gen(prompts, width, max_new_tokens, **kwargs):
    input_ids, mask = left_pad(prompts, width)
    return "generate", dict(input_ids=input_ids, attention_mask=mask, **options(max_new_tokens, **kwargs))


def new_rows(answer, inputs):
    """Each row's prompt and new tokens, as `sample.generate` returns them."""
    width, real = inputs["input_ids"].shape[1], inputs["attention_mask"].sum(axis=1)
    return [answer["output_ids"][r, width - real[r]:width + answer["lengths"][r]] for r in range(len(real))]


LOGITS_SHAPES = [(1, 1), (2, 7), (3, 16), (4, 64)]
EQUAL = [list(row) for row in ids(1, 3, 6)]                                # shape (3, 16, 32)
VARIABLE = [list(ids(2, 1, n)[0]) for n in (3, 20, 9)]                     # shape (3, 32, 64)
ONE = [[5], [9]]                                                           # shape (2, 16, 48)
LONGEST = list(ids(3, 1, 60)[0])                                           # shape (1, 64, 128)
SAMPLING = dict(temperature=0.8, top_k=40, top_p=0.9, seed=7)
GOOD, BAD_IDS = np.array([[5, 6, 7]], np.int32), np.array([[5, 50257, 7]], np.int32)


def bad(**changes):
    """A good one-row `generate` request with some inputs changed."""
    return "generate", {**gen([[5, 6, 7]], 3, 5)[1], **changes}


REQUESTS = {
    **{f"logits {shape}": ("serving_default", dict(input_ids=ids(10, *shape))) for shape in LOGITS_SHAPES},
    "greedy": gen(EQUAL, 6, 10),
    "sampled": gen(EQUAL, 6, 10, **SAMPLING),
    "sampled again": gen(EQUAL, 6, 10, **SAMPLING),
    "variable": gen(VARIABLE, 40, 10),  # rows as the library's, which test_sample checks equal rows alone
    "greedy 20": gen(EQUAL, 6, 20),  # from TRANSPOSE_FROM = 16 tokens on, transposed weights
    "one token 20": gen(ONE, 3, 20),  # one-token prompts: the library runs the loop alone
    "instances": ("generate", dict(gen(EQUAL, 6, 10)[1], **{k: np.repeat(v, 3) for k, v in options(10).items()})),
    "whole context": gen([LONGEST], 60, 5),
    # bad requests
    "logits id out of range": ("serving_default", dict(input_ids=BAD_IDS)),
    "logits beyond n_ctx": ("serving_default", dict(input_ids=ids(11, 1, 65))),
    "logits rank 1": ("serving_default", dict(input_ids=GOOD[0])),
    "logits rank 3": ("serving_default", dict(input_ids=GOOD[None])),
    "logits int64": ("serving_default", dict(input_ids=GOOD.astype(np.int64))),
    "id out of range": bad(input_ids=BAD_IDS),
    "negative id": bad(input_ids=-GOOD),
    "beyond n_ctx": gen([LONGEST], 60, 6),
    "max_new_tokens 0": bad(max_new_tokens=np.int32(0)),
    "top_k -1": bad(top_k=np.int32(-1)),
    "top_p 1.5": bad(top_p=np.float32(1.5)),
    "seed -1": bad(seed=np.int64(-1)),
    "temperature -1": bad(temperature=np.float32(-1)),
    "right padding": bad(attention_mask=np.int32([[1, 1, 0]])),
    "mask of 2": bad(attention_mask=np.int32([[0, 2, 1]])),
    "empty row": bad(attention_mask=np.int32([[0, 0, 0]])),
    "mask shape": bad(attention_mask=np.int32([[1, 1]])),
    "rows disagree": bad(max_new_tokens=np.int32([5, 6])),
    "ids rank 1": bad(input_ids=GOOD[0], attention_mask=np.int32([1, 1, 1])),
    "ids int64": bad(input_ids=GOOD.astype(np.int64)),
    "top_p float64": bad(top_p=np.float64(1)),
    "max_new_tokens 2**31-1": gen([[10, 20]], 2, 2**31 - 1),
    "max_new_tokens 2**31-2": gen([[10, 20, 30]], 3, 2**31 - 2),
    "max_new_tokens -5": bad(max_new_tokens=np.int32(-5)),
    "temperature nan": bad(temperature=np.float32("nan")),
    "temperature nan per row": ("generate", dict(gen(EQUAL, 6, 5)[1], temperature=np.float32([np.nan] * 3))),
    "top_p nan": bad(top_p=np.float32("nan")),
}


OFF = dict(logit_bias=np.zeros(50257, np.float32), repetition_penalty=np.float32(1), presence_penalty=np.float32(0),
           frequency_penalty=np.float32(0), min_p=np.float32(0), stop=np.zeros([0, 1], np.int32))


def controlled(prompts, width, max_new_tokens, controls, *, per_row=False, **kwargs):
    """A `generate_with_controls` request for the library's `controls` (a value for all rows,
    or with `per_row` one per row, as TF Serving's instances format sends them)."""
    inputs = dict(gen(prompts, width, max_new_tokens, **kwargs)[1], **OFF)
    for token, value in controls.get("logit_bias", {}).items():
        inputs["logit_bias"][token] = value
    stops = controls.get("stop", [])
    if stops:
        inputs["stop"] = np.full([len(stops), max(map(len, stops))], -1, np.int32)
        for n, sequence in enumerate(stops):
            inputs["stop"][n, :len(sequence)] = sequence
    inputs.update((k, np.float32(v)) for k, v in controls.items() if k not in ("logit_bias", "stop"))
    if per_row:
        inputs.update((k, np.repeat(inputs[k][None], len(prompts), axis=0)) for k in OFF)
    return "generate_with_controls", inputs


def bad_control(**changes):
    """A good one-row `generate_with_controls` request with some controls changed."""
    return "generate_with_controls", {**controlled([[5, 6, 7]], 3, 5, {})[1], **changes}


CONTROL_REQUESTS = {
    # off: rows of -1 only are no stop sequence ([2, 2]: the compile of the requests below)
    "controls off": ("generate_with_controls", dict(controlled(VARIABLE, 40, 10, {}, top_k=1)[1],
                                                    stop=np.full([2, 2], -1, np.int32))),
    "bias nan": bad_control(logit_bias=np.where(np.arange(50257) == 9, np.nan, 0).astype(np.float32)),
    "bias inf": bad_control(logit_bias=np.where(np.arange(50257) == 9, np.inf, 0).astype(np.float32)),
    "bias size": bad_control(logit_bias=np.zeros(100, np.float32)),
    "bias bans all": bad_control(logit_bias=np.full(50257, -100, np.float32)),
    "bias rows": bad_control(logit_bias=np.zeros([2, 50257], np.float32)),
    "repetition -1": bad_control(repetition_penalty=np.float32(-1)),
    "presence -1": bad_control(presence_penalty=np.float32(-1)),
    "frequency nan": bad_control(frequency_penalty=np.float32("nan")),
    "min_p 2": bad_control(min_p=np.float32(2)),
    "stop id": bad_control(stop=np.int32([[5, 50257]])),
    "stop gap": bad_control(stop=np.int32([[5, -1, 6]])),
    "stop rank 1": bad_control(stop=np.int32([5, 6])),
}


@pytest.fixture(scope="module")
def controls(tiny):
    """Every control, with stop sequences that end rows 1 and 2 of VARIABLE early (greedy)."""
    chosen = dict(logit_bias={318: 4.0, 1000: -100}, repetition_penalty=1.7, presence_penalty=1.5,
                  frequency_penalty=0.5, min_p=0.2)
    rows = generate(tiny, VARIABLE, 10, top_k=1, stop=[[7, 7], [8]], **chosen)  # the same compile as below
    new = [row[len(p):].tolist() for row, p in zip(rows, VARIABLE)]
    return dict(chosen, stop=[new[1][4:6], [new[2][3]]])


@pytest.fixture(scope="module")
def exported(tiny_dir, tmp_path_factory):
    """The tiny model's SavedModel, written under the umask 022 (test_every_file_is_readable_by_others)."""
    umask = os.umask(0o022)
    try:
        return export_saved_model(tiny_dir, str(tmp_path_factory.mktemp("export") / "gpt2"))
    finally:
        os.umask(umask)


@pytest.fixture(scope="module")
def eot(tiny):
    """A token that greedy generation from EQUAL[0] reaches as its 4th new token."""
    return int(generate(tiny, EQUAL, 10, top_k=1)[0][len(EQUAL[0]) + 3])


@pytest.fixture(scope="module")
def answers(exported, tiny, eot, controls, tmp_path_factory):
    """Answers to REQUESTS and CONTROL_REQUESTS, requests with `controls`, and 'stop at eot'
    from an export that stops after `eot`."""
    stopping = export_saved_model(tiny, str(tmp_path_factory.mktemp("export") / "stop"), stop_at_eot=True, eot=eot)
    REQUESTS.update(CONTROL_REQUESTS, **{
        "controls greedy": controlled(VARIABLE, 40, 10, controls, top_k=1),
        "controls sampled": controlled(VARIABLE, 40, 10, controls, **SAMPLING),
        "controls instances": controlled(VARIABLE, 40, 10, controls, per_row=True, top_k=1)})
    requests = {name: (exported, *request) for name, request in REQUESTS.items()}
    requests["stop at eot"] = (stopping, *REQUESTS["greedy"])
    return serve(requests, tmp_path_factory.mktemp("serve"))


def test_layout_and_one_copy_of_the_weights(exported, tiny_dir):
    assert os.path.basename(exported) == "1"
    assert sorted(os.listdir(os.path.dirname(exported))) == ["1"]
    assert {"saved_model.pb", "variables"} <= set(os.listdir(exported))
    assert_one_copy(exported, tiny_dir)


def test_every_file_is_readable_by_others(exported):
    """Under the umask 022 the version folder and everything in it can be read by another user
    (TF Serving's): folders drwxr-xr-x, files -rw-r--r--, not a temporary folder's drwx------."""
    modes = {os.path.relpath(root, exported) + "/": os.stat(root).st_mode & 0o777 for root, _, _ in os.walk(exported)}
    files = {os.path.relpath(os.path.join(root, name), exported): os.stat(os.path.join(root, name)).st_mode & 0o777
             for root, _, names in os.walk(exported) for name in names}
    assert {"./", "variables/"} <= set(modes) and "saved_model.pb" in files
    assert modes == dict.fromkeys(modes, 0o755) and files == dict.fromkeys(files, 0o644)


def assert_one_copy(exported, model_dir):
    """The checkpoint's variables, each once, and the vocabulary's tokens (for stop strings and
    text: `generate_text`), once."""
    prefix = os.path.join(exported, "variables", "variables")
    stored = {name: shape for name, shape in tf.train.list_variables(prefix) if shape}
    (vocabulary,) = [name for name in stored if name.startswith("vocabulary/")]
    assert stored.pop(vocabulary) == [50257]
    checkpoint = {name: shape for name, shape in tf.train.list_variables(model_dir)}
    assert sorted(map(tuple, stored.values())) == sorted(map(tuple, checkpoint.values()))
    tokens = sum(map(len, tf.train.load_variable(prefix, vocabulary)))
    ratio = (folder_bytes(os.path.join(exported, "variables")) - tokens) / checkpoint_bytes(model_dir)
    assert 0.98 < ratio < 1.02, f"variables/ is {ratio:.3f} x the checkpoint (and the tokens)"


def test_existing_version_is_not_overwritten(exported, tiny):
    with pytest.raises(FileExistsError, match="exists"):
        export_saved_model(tiny, os.path.dirname(exported), 1)


def test_tool_writes_a_version_and_never_overwrites_it(tiny_dir, tmp_path, capsys):
    assert export_main(["--model_dir", tiny_dir, "--export_dir", str(tmp_path), "--version", "3"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / '3'}" in out and "saved_model_cli show" in out
    assert os.listdir(tmp_path) == ["3"]
    with pytest.raises(SystemExit):
        export_main(["--model_dir", tiny_dir, "--export_dir", str(tmp_path), "--version", "3"])


@pytest.mark.parametrize("shape", LOGITS_SHAPES)
def test_logits_match_the_keras_model(answers, tiny, shape):
    expected = tiny(REQUESTS[f"logits {shape}"][1]["input_ids"])["logits"].numpy()
    logits = answers[f"logits {shape}"]["logits"]
    assert logits.shape == expected.shape
    assert np.abs(logits - expected).max() <= ATOL


@pytest.mark.parametrize("name, prompts, new, kwargs", [
    ("greedy", EQUAL, 10, dict(top_k=1)),
    ("sampled", EQUAL, 10, SAMPLING),
    ("variable", VARIABLE, 10, dict(top_k=1)),
    ("greedy 20", EQUAL, 20, dict(top_k=1)),
    ("one token 20", ONE, 20, dict(top_k=1)),
])
def test_generate_matches_the_library(answers, tiny, name, prompts, new, kwargs):
    answer = answers[name]
    assert answer["output_ids"].shape == (len(prompts), REQUESTS[name][1]["input_ids"].shape[1] + new)
    np.testing.assert_array_equal(answer["output_ids"][:, :-new], REQUESTS[name][1]["input_ids"])
    np.testing.assert_array_equal(answer["lengths"], [new] * len(prompts))
    expected = generate(tiny, prompts, new, **kwargs)
    for row, (ours, theirs) in enumerate(zip(new_rows(answer, REQUESTS[name][1]), expected)):
        np.testing.assert_array_equal(ours, theirs, err_msg=f"row {row}")


def test_rows_stop_after_eot_where_exported_so(answers, tiny, eot):
    answer = answers["stop at eot"]
    expected = generate(tiny, EQUAL, 10, top_k=1, stop_at_eot=True, eot=eot)
    np.testing.assert_array_equal(answer["lengths"], [len(row) - len(p) for row, p in zip(expected, EQUAL)])
    assert answer["lengths"][0] < 10
    for row, (ours, theirs) in enumerate(zip(new_rows(answer, REQUESTS["greedy"][1]), expected)):
        np.testing.assert_array_equal(ours, theirs, err_msg=f"row {row}")
        assert (answer["output_ids"][row, 6 + answer["lengths"][row]:] == eot).all()


def test_same_seed_same_tokens_and_instances_format(answers):
    np.testing.assert_array_equal(answers["sampled"]["output_ids"], answers["sampled again"]["output_ids"])
    np.testing.assert_array_equal(answers["instances"]["output_ids"], answers["greedy"]["output_ids"])


def test_the_whole_context_window(answers, tiny):
    (row,) = new_rows(answers["whole context"], REQUESTS["whole context"][1])
    np.testing.assert_array_equal(row, generate(tiny, [LONGEST], 5, top_k=1)[0])


def test_greedy_matches_the_reference(answers, reference_tiny):
    for row, p in enumerate(EQUAL):
        theirs, _ = reference_tiny.sample_sequence(context=[p], length=10, top_k=1, seed=0)
        np.testing.assert_array_equal(answers["greedy"]["output_ids"][row], theirs[0], err_msg=f"row {row}")


@pytest.mark.parametrize("name, message", [
    ("logits id out of range", "token ids must be in [0, n_vocab=50257)"),
    ("logits beyond n_ctx", "exceeds the context window n_ctx=64"),
    ("logits rank 1", "is not compatible with expected shape [?,?]"),
    ("logits rank 3", "is not compatible with expected shape [?,?]"),
    ("logits int64", "expected to be a int32 tensor but is a int64 tensor"),
    ("id out of range", "token ids must be in [0, n_vocab=50257)] [50257]"),
    ("negative id", "token ids must be in [0, n_vocab=50257)] [-5 -6 -7]"),
    ("beyond n_ctx", "prompt tokens + max_new_tokens - 1 exceed the context window n_ctx=64"),
    ("max_new_tokens 0", "max_new_tokens must be an integer in [1, 2**31)"),
    ("top_k -1", "top_k must be an integer in [0, 2**31)"),
    ("top_p 1.5", "top_p must be a number in [0, 1]"),
    ("seed -1", "seed must be an integer in [0, 2**63)] [-1]"),
    ("temperature -1", "temperature must be a finite number >= 0"),
    ("right padding", "attention_mask must be left padding"),
    ("mask of 2", "attention_mask must hold only 0 and 1"),
    ("empty row", "every prompt needs at least one token"),
    ("mask shape", "attention_mask must have the shape of input_ids"),
    ("rows disagree", "max_new_tokens must be the same for every row"),
    ("ids rank 1", "is not compatible with expected shape [?,?]"),
    ("ids int64", "expected to be a int32 tensor but is a int64 tensor"),
    ("top_p float64", "expected to be a float tensor but is a double tensor"),
    # once overflowed the length check and ran until killed (a buffer of 2**31 tokens is 8 GB)
    ("max_new_tokens 2**31-1", "exceed the context window n_ctx=64"),
    ("max_new_tokens 2**31-2", "exceed the context window n_ctx=64"),
    ("max_new_tokens -5", "max_new_tokens must be an integer in [1, 2**31)"),
    ("temperature nan", "temperature must be a finite number >= 0"),
    ("temperature nan per row", "temperature must be a finite number >= 0"),
    ("top_p nan", "top_p must be a number in [0, 1]"),
])
def test_bad_requests_fail_with_a_message(answers, name, message):
    answer = answers[name]
    assert isinstance(answer, str), f"{name}: no error, got {answer}"
    assert answer.startswith("InvalidArgumentError") and message in answer, answer[:500]


@pytest.mark.parametrize("name, kwargs", [("controls greedy", dict(top_k=1)), ("controls sampled", SAMPLING)])
def test_controls_match_the_library(answers, tiny, controls, name, kwargs):
    """Every control at once, greedy and sampled: the library's tokens; `lengths` leave out the
    stop sequence that ends rows 1 and 2."""
    answer = answers[name]
    expected = generate(tiny, VARIABLE, 10, **kwargs, **controls)
    np.testing.assert_array_equal(answer["lengths"], [len(row) - len(p) for row, p in zip(expected, VARIABLE)])
    for row, (ours, theirs) in enumerate(zip(new_rows(answer, REQUESTS[name][1]), expected)):
        np.testing.assert_array_equal(ours, theirs, err_msg=f"row {row}")
    if name == "controls greedy":
        assert answer["lengths"].tolist()[1:] == [4, 3]
        np.testing.assert_array_equal(answers["controls instances"]["output_ids"], answer["output_ids"])


def test_controls_off_are_generate(answers):
    np.testing.assert_array_equal(answers["controls off"]["output_ids"], answers["variable"]["output_ids"])


@pytest.mark.parametrize("name, message", [
    ("bias nan", "logit_bias values must be a number < inf"),
    ("bias inf", "logit_bias values must be a number < inf"),
    ("bias size", "logit_bias must have n_vocab=50257 values per row"),
    ("bias bans all", "logit_bias bans every token"),
    ("bias rows", "logit_bias must have one value per row or one for all"),
    ("repetition -1", "repetition_penalty must be a finite number > 0"),
    ("presence -1", "presence_penalty must be a finite number >= 0"),
    ("frequency nan", "frequency_penalty must be a finite number >= 0"),
    ("min_p 2", "min_p must be a number in [0, 1]"),
    ("stop id", "stop token ids must be in [0, n_vocab=50257)"),
    ("stop gap", "stop sequences must be padded with -1 at their end only"),
    ("stop rank 1", "stop must have rank 2 (every row) or 3 (one per row)"),
])
def test_bad_controls_fail_with_a_message(answers, name, message):
    test_bad_requests_fail_with_a_message(answers, name, message)


def test_saved_model_cli_show_and_run(exported, tiny, tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    show = subprocess.run([SAVED_MODEL_CLI, "show", "--dir", exported, "--all"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert show.returncode == 0, show.stderr[-2000:]
    assert "signature_def['generate']" in show.stdout and "signature_def['serving_default']" in show.stdout
    # the rows of "greedy" (left padding in row 0), a shape whose programs XLA's cache holds
    prompts = [[5, 6, 7], *EQUAL[1:]]
    input_ids, mask = left_pad(prompts, 6)
    run = subprocess.run([SAVED_MODEL_CLI, "run", "--dir", exported, "--tag_set", "serve",
                          "--signature_def", "generate", "--outdir", str(tmp_path), "--input_exprs",
                          f"input_ids={input_ids.tolist()};attention_mask={mask.tolist()};max_new_tokens=10;"
                          "temperature=1.0;top_k=1;top_p=1.0;seed=0"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    output_ids = np.load(tmp_path / "output_ids.npy")
    assert output_ids[0, :3].tolist() == [0, 0, 0]
    for row, (ours, theirs) in enumerate(zip(new_rows(dict(output_ids=output_ids, lengths=[10] * 3),
                                                      dict(input_ids=input_ids, attention_mask=mask)),
                                             generate(tiny, prompts, 10, top_k=1))):
        np.testing.assert_array_equal(ours, theirs, err_msg=f"row {row}")
    np.testing.assert_array_equal(np.load(tmp_path / "lengths.npy"), [10] * 3)


FUZZ = """
import collections, sys
import numpy as np
import tensorflow as tf
from hypothesis import HealthCheck, given, settings, strategies as st

saved_model, n_vocab, n_ctx, examples = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
generate = tf.saved_model.load(saved_model).signatures["generate"]
DTYPES = dict(input_ids=np.int32, attention_mask=np.int32, max_new_tokens=np.int32, temperature=np.float32,
              top_k=np.int32, top_p=np.float32, seed=np.int64)
TF_NAMES = {np.int32: "int32", np.float32: "float", np.int64: "int64"}
OPTIONS = ["max_new_tokens", "temperature", "top_k", "top_p", "seed"]
NAN, INF = float("nan"), float("inf")
GOOD = dict(max_new_tokens=[1, 3, 8], temperature=[0.0, 1.0, 0.7, 1e30], top_k=[0, 1, 40, 2**31 - 1],
            top_p=[1.0, 0.9, 0.0], seed=[0, 7, 2**62, 2**63 - 1])
BAD = dict(max_new_tokens=[0, -5, -2**31, n_ctx, 2**31 - 2, 2**31 - 1], temperature=[NAN, INF, -INF, -1.0],
           top_k=[-5, -2**31], top_p=[NAN, INF, -INF, -1.0, 1.5, 1e30], seed=[-1, -2**63])
BAD_IDS = [n_vocab, -1, 2**31 - 1, -2**31]


def refusals(req):
    \"\"\"The messages the signature may refuse `req` with: one for each check that fails and
    whose inputs passed the checks before it (checks that do not depend on one another run in
    no fixed order, so where several fail, any one of them may be the error). Empty: the
    request must succeed.\"\"\"
    for field, dtype in DTYPES.items():
        if req[field].dtype != dtype:  # refused as the signature's input, before any check
            given = {"float64": "double"}.get(req[field].dtype.name, req[field].dtype.name)
            return {f"expected to be a {TF_NAMES[dtype]} tensor but is a {given} tensor"}
    found, option = set(), {}
    for name in OPTIONS:
        x = req[name]
        if x.ndim > 1:
            found.add(f"[{name} must be a scalar or one value per row")
        elif x.size == 0:
            found.add(f"[{name} is empty")
        elif not (np.all(x == x.flat[0]) or (np.isnan(x).all() if x.dtype.kind == "f" else False)):
            found.add(f"[{name} must be the same for every row]")
        else:
            option[name] = x.flat[0]
    ids, mask, lengths = req["input_ids"], req["attention_mask"], None
    for field, x in (("input_ids", ids), ("attention_mask", mask)):
        if x.ndim != 2:
            found.add(f"Shape of tensor {field} [{','.join(map(str, x.shape))}] is not compatible with expected "
                      "shape [?,?]")
    if ids.ndim == mask.ndim == 2:
        if ids.shape != mask.shape:
            found.add("[attention_mask must have the shape of input_ids]")
        else:
            zero_one, left = np.isin(mask, [0, 1]).all(), (mask[:, 1:] >= mask[:, :-1]).all()
            if not zero_one:
                found.add("[attention_mask must hold only 0 and 1]")
            if not left:
                found.add("[attention_mask must be left padding: 0s, then 1s, in each row")
            if zero_one and left:
                lengths, prompt = mask.sum(axis=1), np.where(mask == 1, ids, 0)
    if lengths is not None:
        if not (lengths > 0).all():
            found.add("[every prompt needs at least one token (<|endoftext|> for none)]")
        bad = prompt[(prompt < 0) | (prompt >= n_vocab)][:3]
        if bad.size:
            found.add(f"[token ids must be in [0, n_vocab={n_vocab})] [{' '.join(map(str, bad))}]")
    if "max_new_tokens" in option:
        length = int(option["max_new_tokens"])
        if length < 1:
            found.add(f"[max_new_tokens must be an integer in [1, 2**31)] [{length}]")
        if lengths is not None and int(lengths.max()) + length - 1 > n_ctx:
            found.add(f"[prompt tokens + max_new_tokens - 1 exceed the context window n_ctx={n_ctx}; the tokens of "
                      f"the longest prompt and max_new_tokens] [{int(lengths.max())}] [{length}]")
    if "temperature" in option and not (np.isfinite(option["temperature"]) and option["temperature"] >= 0):
        found.add(f"[temperature must be a finite number >= 0] [{float(option['temperature']):g}]")
    if "top_k" in option and option["top_k"] < 0:
        found.add(f"[top_k must be an integer in [0, 2**31)] [{int(option['top_k'])}]")
    if "top_p" in option and not 0 <= option["top_p"] <= 1:
        found.add(f"[top_p must be a number in [0, 1]] [{float(option['top_p']):g}]")
    if "seed" in option and option["seed"] < 0:
        found.add(f"[seed must be an integer in [0, 2**63)] [{int(option['seed'])}]")
    return found


@st.composite
def requests(draw):
    \"\"\"A request of good values only, or with one check's input made bad, or of good and bad
    values mixed.\"\"\"
    mode = draw(st.sampled_from(["good", "one fault", "one fault", "mixed"]))
    mixed = mode == "mixed"
    batch, width = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    token = st.sampled_from([0, 1, 7, n_vocab - 1] * 8 + (BAD_IDS if mixed else []))
    ids = draw(st.lists(token, min_size=batch * width, max_size=batch * width))
    real = draw(st.lists(st.integers(0 if mixed else 1, width), min_size=batch, max_size=batch))
    mask = np.array([[0] * (width - r) + [1] * r for r in real], np.int32)
    if mixed and draw(st.integers(0, 4)) == 0:
        mask = np.array(draw(st.lists(st.sampled_from([0, 1, 2, -1]), min_size=batch * width,
                                      max_size=batch * width)), np.int32).reshape(batch, width)
    req = dict(input_ids=np.array(ids, np.int64).astype(np.int32).reshape(batch, width), attention_mask=mask)
    for name in OPTIONS:
        req[name] = np.asarray(draw(st.sampled_from(GOOD[name] * 3 + BAD[name] if mixed else GOOD[name])),
                               DTYPES[name])
    if mode == "one fault":
        fault = draw(st.sampled_from(["input_ids", "attention_mask", "dtype", "rank", "per row"] + sorted(BAD)))
        if fault == "input_ids":
            rows, columns = np.nonzero(req["attention_mask"])
            at = draw(st.integers(0, len(rows) - 1))
            req["input_ids"][rows[at], columns[at]] = draw(st.sampled_from(BAD_IDS))
        elif fault == "attention_mask":
            row = draw(st.integers(0, batch - 1))
            req["attention_mask"][row] = draw(st.sampled_from([[0] * width, [1] + [0] * (width - 1),
                                                               [0] * (width - 1) + [2]]))
        elif fault in ("dtype", "rank"):
            field = draw(st.sampled_from(sorted(req)))
            x = req[field]
            req[field] = x.astype(np.float64) if fault == "dtype" else x[None, None] if x.ndim == 0 else x[None]
        elif fault == "per row":
            name = draw(st.sampled_from(OPTIONS))
            req[name] = np.arange(batch).astype(req[name].dtype)
        elif BAD[fault]:
            req[fault] = np.asarray(draw(st.sampled_from(BAD[fault])), DTYPES[fault])
    if mixed and draw(st.integers(0, 9)) == 0:  # a wrong dtype or rank for one field
        changed = draw(st.sampled_from(sorted(req)))
        req[changed] = draw(st.sampled_from([req[changed].astype(np.float64), req[changed][None], np.array([])]))
    for name in OPTIONS:  # one value per row, maybe unequal
        if req[name].ndim == 0 and draw(st.integers(0, 4)) == 0:
            unequal = mixed and draw(st.booleans())
            req[name] = np.arange(batch).astype(req[name].dtype) if unequal else np.repeat(req[name], batch)
    return req


outcomes = collections.Counter()


@settings(max_examples=examples, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(requests())
def check(req):
    expected = refusals(req)
    try:
        out = generate(**{k: tf.constant(v) for k, v in req.items()})
    except (tf.errors.InvalidArgumentError, TypeError, ValueError) as e:
        message = str(e)
        assert expected, f"refused a good request {req}: {message[:800]}"
        hits = [m for m in expected if m in message]
        assert hits, f"request {req}: expected one of {sorted(expected)}, got {message[:800]}"
        outcomes[hits[0].split("]")[0][:40]] += 1
        return
    assert not expected, f"request {req} was not refused; expected one of {sorted(expected)}"
    ids, lengths = out["output_ids"].numpy(), out["lengths"].numpy()
    new = int(np.reshape(req["max_new_tokens"], [-1])[0])
    assert ids.shape == (req["input_ids"].shape[0], req["input_ids"].shape[1] + new)
    np.testing.assert_array_equal(ids[:, :-new], req["input_ids"])
    assert ((0 <= ids[:, -new:]) & (ids[:, -new:] < n_vocab)).all() and ((0 <= lengths) & (lengths <= new)).all()
    outcomes["ok"] += 1


check()
print(dict(outcomes))
print(outcomes.pop("ok", 0), sum(outcomes.values()), len(outcomes))
"""


def test_fuzzed_requests_succeed_or_fail_with_the_checks_message(exported, tmp_path):
    """Random requests (dtypes, ranks, extreme and NaN values, masks) to the SavedModel in a
    TensorFlow-only process: each good one gives valid output, each bad one is refused with the
    message (and the values it shows) of a check it fails, worked out here from the request
    (`refusals`); none hangs."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", FUZZ, exported, "50257", "64", "60"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ok, refused, kinds = map(int, result.stdout.split()[-3:])
    assert ok >= 5 and refused >= 5 and kinds >= 4, result.stdout


# ---- one SavedModel for every kind of device ------------------------------------------------

NO_GPU = dict(CUDA_VISIBLE_DEVICES="")  # a child process that sees no GPU


def branches(exported):
    """For each `by_device` in the SavedModel's graph: (the op types the CPU branch runs, those
    the other branch runs), each with every function it calls."""
    graph = saved_model_graph(exported)
    functions = {f.signature.name: f for f in graph.library.function}

    def ops(name, seen):
        if name in seen or name not in functions:
            return set()
        seen.add(name)
        found = set()
        for node in functions[name].node_def:
            found.add(node.op)
            called = [node.op] + [v.func.name for v in node.attr.values() if v.HasField("func")]
            called += [f.name for v in node.attr.values() if v.HasField("list") for f in v.list.func]
            for callee in called:
                found |= ops(callee, seen)
        return found
    found = []
    for function in functions.values():
        index = {node.name for node in function.node_def if node.op == "DeviceIndex"
                 and list(node.attr["device_names"].list.s) == [b"CPU"]}
        for node in function.node_def:
            if node.op in ("Case", "StatelessCase") and node.input[0].split(":")[0] in index:
                cpu, other = (f.name for f in node.attr["branches"].list.func)
                found.append((ops(cpu, set()), ops(other, set())))
    return found


def saved_model_graph(exported):
    with open(os.path.join(exported, "saved_model.pb"), "rb") as f:
        return saved_model_pb2.SavedModel.FromString(f.read()).meta_graphs[0].graph_def


def test_every_product_is_full_float32(exported):
    """Every float32 product of the signatures (logits, and each generation loop) is XLA's dot
    at precision HIGHEST (`tfgpt2.products`): float32 on a GPU whatever the server's settings."""
    assert list(products(saved_model_graph(exported))) == ["HIGHEST"]


def test_generate_holds_a_loop_for_the_cpu_and_one_for_other_devices(exported):
    """`generate` and `generate_with_controls` each pick their loop when they run: on a CPU
    the one that can use the transposed weights (read through an optimization barrier), on
    any other device the layers' own products."""
    found = branches(exported)
    assert len(found) == 2, found
    for cpu, other in found:
        assert {"XlaDotV2", "XlaOptimizationBarrier", "While"} <= cpu
        assert {"XlaDotV2", "While"} <= other and "XlaOptimizationBarrier" not in other


class Picked(tf.Module):
    """A signature that answers which branch of `by_device` ran, each branch XLA-compiled as
    `generate`'s loops are."""

    def __init__(self):
        super().__init__()
        self.v = tf.Variable(1.0)
        self.compiled = tf.function(lambda x, n: x * self.v + n, jit_compile=True)

    @tf.function(input_signature=[tf.TensorSpec([], tf.float32)])
    def picked(self, x):
        return {"device": by_device(lambda: self.compiled(x, 1.0), lambda: self.compiled(x, 2.0))}


@pytest.fixture(scope="module")
def picked(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("picked") / "1")
    module = Picked()
    tf.saved_model.save(module, path, signatures={"picked": module.picked})
    return {"picked": (path, "picked", dict(x=np.float32(0)))}


def test_a_saved_model_picks_the_cpu_branch_on_a_cpu(picked, tmp_path):
    assert serve(picked, tmp_path, **NO_GPU)["picked"]["device"] == 1


@pytest.mark.gpu
def test_a_saved_model_picks_the_other_branch_on_a_gpu(picked, tmp_path):
    assert serve(picked, tmp_path)["picked"]["device"] == 2


@pytest.mark.gpu
def test_exported_on_either_device_kind_served_on_the_other(tiny_dir, tiny, exported, tmp_path):
    """One exported where no GPU is visible (a child process), served on the GPU, and the one
    exported here, with the GPU visible, served where none is: the library's greedy tokens,
    with the CPU layouts (20 new tokens) and without."""
    cpu_export = tmp_path / "cpu"
    subprocess.run([sys.executable, "-m", "tfgpt2.cli.main", "export", "--model_dir", tiny_dir, "--quiet",
                    str(cpu_export)], env={**os.environ, **NO_GPU}, check=True, capture_output=True, timeout=600)
    names = ["greedy", "greedy 20", "variable"]
    answers = {"on the GPU": serve({n: (str(cpu_export / "1"), *REQUESTS[n]) for n in names}, tmp_path),
               "on a CPU": serve({n: (exported, *REQUESTS[n]) for n in names}, tmp_path, **NO_GPU)}
    prompts = {"greedy": (EQUAL, 10), "greedy 20": (EQUAL, 20), "variable": (VARIABLE, 10)}
    for where, answer in answers.items():
        for name, (rows, new) in prompts.items():
            for ours, theirs in zip(new_rows(answer[name], REQUESTS[name][1]), generate(tiny, rows, new, top_k=1)):
                np.testing.assert_array_equal(ours, theirs, err_msg=f"{name} {where}")
