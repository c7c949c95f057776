"""One engine behind every door: the same requests through the library (`tfgpt2.generate`), the
commands (`tfgpt2 generate`, `tfgpt2 interactive`, `tfgpt2 generate --litert`), `tfgpt2
generate-batch` on both engines (local, Beam), `tfgpt2 serve` (its HTTP app over the scheduler),
the SavedModel (`generate_text`, and the signatures deployed clients call: `generate`,
`generate_with_controls`) and LiteRT give the same text (and the same log-probabilities, where a
door reports them), each row equal to its prompt generated alone by the library: greedy (with
log-probabilities where a door reports them), seeded sampling, stop strings inside a token and
across two, penalties with a logit bias. So `--stop X`, a JSONL line's "stop": ["X"] and the
server's "stop": ["X"] end the same text at the same character.

Affordable: the tiny model, loaded once and handed to every door that can take it (the commands
and bulk generation load it through `load_model`, patched for the module), one app, one
SavedModel and one LiteRT file for all the cases; each door runs every case in one test."""
import dataclasses
import io
import json
import re

import numpy as np
import pytest

from tfgpt2.encoder import get_encoder

# compiles every door's programs for the tiny model, in a process of its own (tests/own_process.py)
pytestmark = [pytest.mark.slow, pytest.mark.own_process]
LENGTH = 12
PROMPTS = ["The cat sat on", "Every effort moves you"]


@dataclasses.dataclass
class Case:
    """A request: its prompts and controls (the library's keywords)."""
    prompts: list
    controls: dict


def cases(free):
    """The requests; the stop strings are taken from `free`, the greedy texts without controls:
    one inside a token of the first prompt's text, one across two tokens of the second's."""
    (inside_token, across), texts = free
    return {
        "greedy": Case(PROMPTS, dict(temperature=0.0, logprobs=3)),
        "sampled": Case(PROMPTS[:1], dict(temperature=1.0, top_k=40, top_p=0.9, seed=7)),
        "stops": Case(PROMPTS, dict(temperature=0.0, stop=[inside_token, across])),
        "controls": Case(PROMPTS, dict(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5,
                                       frequency_penalty=0.5, logit_bias={262: 5.0, int(texts[0][1]): -100.0})),
    }


def without_logprobs(controls):
    """The controls for a door that reports no log-probabilities (the text is the same)."""
    return {k: v for k, v in controls.items() if k != "logprobs"}


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from tfgpt2 import load_model
    return load_model(tiny_dir)


@pytest.fixture(scope="module")
def enc(tiny_dir):
    import os
    return get_encoder(os.path.basename(tiny_dir), os.path.dirname(tiny_dir))


@pytest.fixture(scope="module")
def free(tiny, enc):
    """(a stop string inside a token of the first prompt's greedy text and one across two tokens
    of the second's, each first found there; the greedy new tokens of each prompt)."""
    from tfgpt2 import generate
    rows = [generate(tiny, [enc.encode(p)], LENGTH, temperature=0, stop_at_eot=True, encoder=enc)[0] for p in PROMPTS]
    tokens = [row.new_tokens.tolist() for row in rows]
    words = [[enc.decode([t]) for t in row] for row in tokens]
    j = next(j for j, w in enumerate(words[0]) if len(w.strip()) >= 3 and j > 0)
    inside = words[0][j].strip()[1:3]  # the middle of a token
    k = next(k for k in range(2, len(words[1]) - 1) if words[1][k].strip() and words[1][k + 1].strip()
             and words[1][k + 1][0] != " ")
    across = words[1][k][-1] + words[1][k + 1][0]
    assert inside in rows[0].text and across in rows[1].text
    return (inside, across), tokens


@pytest.fixture(scope="module")
def expected(tiny, enc, free):
    """Each case's rows by the library, each prompt alone: {case: [Completion]}."""
    from tfgpt2 import generate
    return {name: [generate(tiny, [enc.encode(p)], LENGTH, stop_at_eot=True, encoder=enc, **case.controls)[0]
                   for p in case.prompts] for name, case in cases(free).items()}


def test_the_cases_show_what_they_are_for(expected, free, tiny, enc):
    """Each case changes the text where it should: the stop strings end the texts, one inside a
    token and one across two; the penalties with the bias, and sampling, change the greedy text;
    the greedy case reports 3 most likely tokens per step."""
    from tfgpt2 import generate
    (inside, across), _ = free
    greedy = [c.text for c in expected["greedy"]]
    stopped = [c.text for c in expected["stops"]]
    assert stopped[0] == greedy[0][:greedy[0].find(inside)] and stopped[1] == greedy[1][:greedy[1].find(across)]
    assert all(c.finish_reason == "stop" for c in expected["stops"])
    assert [c.text for c in expected["controls"]] != greedy and expected["sampled"][0].text != greedy[0]
    assert len(expected["greedy"][0].logprobs[0][1]) == 3
    assert generate(tiny, [enc.encode(PROMPTS[0])], LENGTH, temperature=0, stop_at_eot=True,
                    encoder=enc)[0].text == greedy[0]  # log-probabilities change nothing


# ---- the doors: each runs every case it can express -> {case: [(text, log-probabilities or None)]} ----

def library(fixture, all_cases):
    """`tfgpt2.generate`, every prompt of a case in one batch."""
    from tfgpt2 import generate
    tiny, enc = fixture("tiny"), fixture("enc")
    return {name: [(r.text, r.logprobs) for r in generate(tiny, [enc.encode(p) for p in case.prompts], LENGTH,
                                                          stop_at_eot=True, encoder=enc, **case.controls)]
            for name, case in all_cases.items()}


def flags(controls):
    """The controls as the commands' flags."""
    out = []
    for name, value in controls.items():
        if name == "stop":
            out += [x for text in value for x in ("--stop", text)]
        elif name == "logit_bias":
            out += [x for token, v in value.items() for x in ("--logit_bias", f"{token}={v}")]
        else:
            out += [f"--{name}", str(value)]
    return out


def interactive(fixture, all_cases):
    """`tfgpt2 interactive`, the prompts on stdin: each sample's text."""
    from tfgpt2.cli import interactive as command
    fixture("loaded")
    capsys, monkeypatch = fixture("capsys"), fixture("monkeypatch")
    found = {}
    for name, case in all_cases.items():
        monkeypatch.setattr("sys.stdin", io.StringIO("".join(p + "\n" for p in case.prompts)))
        command.main(["--model_dir", fixture("tiny_dir"), "--length", str(LENGTH), "--stop_at_eot", "--quiet",
                      *flags(without_logprobs(case.controls))])
        printed = re.split(r"^=+ SAMPLE 1 =+\n", capsys.readouterr().out, flags=re.M)[1:]
        found[name] = [(p.split("\n" + "=" * 80 + "\n")[0], None) for p in printed]
    return found


def generate_command(fixture, all_cases, litert=False):
    """`tfgpt2 generate --prompt P` (with --litert FILE, the LiteRT file's), one prompt a call:
    the sample's text."""
    from tfgpt2.cli import generate as command
    fixture("loaded")
    capsys = fixture("capsys")
    found = {}
    for name, case in all_cases.items():
        found[name] = []
        for prompt in case.prompts:
            command.main(["--model_dir", fixture("tiny_dir"), "--prompt", prompt, "--length", str(LENGTH),
                          "--stop_at_eot", "--quiet", *(["--litert", fixture("litert_file")] if litert else []),
                          *flags(without_logprobs(case.controls))])
            out = capsys.readouterr().out
            head = "=" * 40 + " SAMPLE 1 " + "=" * 40 + "\n"
            assert out.startswith(head) and out.endswith("\n"), out
            found[name].append((out[len(head):-1], None))
    return found


def bulk_lines(all_cases):
    lines = []
    for name, case in all_cases.items():
        fields = dict(without_logprobs(case.controls), stop_at_eot=True)
        fields["logit_bias"] = {str(k): v for k, v in fields.get("logit_bias", {}).items()}
        lines += [dict(prompt=p, case=name, **fields) for p in case.prompts]
    return lines


def generate_batch(fixture, all_cases, engine):
    """`tfgpt2 generate-batch`, every case's lines in one file, each line with its fields (the
    rows of a case share a batch)."""
    from tfgpt2.cli import generate_batch as command
    if engine == "beam":
        pytest.importorskip("apache_beam", reason="the beam extra (apache-beam) is not installed")
    fixture("loaded")
    tmp_path = fixture("tmp_path")
    lines = bulk_lines(all_cases)
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert command.main(["--model_dir", fixture("tiny_dir"), "--input", str(src), "--output", str(out),
                         "--length", str(LENGTH), "--batch_size", "2", "--quiet", "--engine", engine]) == 0
    files = [out] if engine == "local" else sorted(tmp_path.glob("out-*-of-*"))
    found = {}
    for row in sorted((json.loads(line) for f in files for line in open(f)), key=lambda r: r["line"]):
        found.setdefault(lines[row["line"]]["case"], []).append((row["text"], None))
    return found


def serve(fixture, all_cases):
    """`tfgpt2 serve`'s /v1/completions, every prompt of a case in one request: the choices'
    texts, and OpenAI's log-probabilities (the tokens' texts) read back into the library's
    shape (ids)."""
    server, enc = fixture("server"), fixture("enc")
    ids = {}
    found = {}
    for name, case in all_cases.items():
        body = dict(model="tiny", prompt=case.prompts, max_tokens=LENGTH, **case.controls)
        body["logit_bias"] = {str(k): v for k, v in body.get("logit_bias", {}).items()}
        answer = server.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        found[name] = [(c["text"], _served_logprobs(c["logprobs"], enc, ids)) for c in answer.json()["choices"]]
    return found


def _served_logprobs(got, enc, ids):
    """OpenAI's logprobs object as the library's [(log-probability, [(id, log-probability)])]
    (None where the request asked for none), each token's text read back as its id."""
    if got is None:
        return None
    from tfgpt2.decoding.text import token_text
    if not ids:
        ids.update({token_text(enc.encoding.decode_single_token_bytes(t)): t for t in range(enc.n_vocab)})
    return [(lp, [(ids[t], v) for t, v in top.items()]) for lp, top in zip(got["token_logprobs"], got["top_logprobs"])]


def _saved_inputs(enc, case):
    """The SavedModel's inputs of `generate` for a case: its prompts left-padded, the sampling."""
    import tensorflow as tf
    c = dict(dict(temperature=1.0, top_k=0, top_p=1.0, seed=0), **case.controls)
    prompts = [enc.encode(p) for p in case.prompts]
    width = max(map(len, prompts))
    ids, mask = np.zeros([len(prompts), width], np.int32), np.zeros([len(prompts), width], np.int32)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = p, 1
    return dict(input_ids=tf.constant(ids), attention_mask=tf.constant(mask), max_new_tokens=tf.constant(LENGTH),
                temperature=tf.constant(c["temperature"], tf.float32), top_k=tf.constant(c["top_k"]),
                top_p=tf.constant(c["top_p"], tf.float32), seed=tf.constant(c["seed"], tf.int64))


def _saved_controls(case):
    """The inputs `generate_with_controls` adds to `generate`'s, for a case."""
    import tensorflow as tf
    c = dict(dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0), **case.controls)
    bias = np.zeros(50257, np.float32)
    for token, value in case.controls.get("logit_bias", {}).items():
        bias[token] = value
    return dict(logit_bias=tf.constant(bias), min_p=tf.constant(0.0), stop=tf.constant(np.full([0, 1], -1, np.int32)),
                **{k: tf.constant(c[k], tf.float32) for k in ("repetition_penalty", "presence_penalty",
                                                               "frequency_penalty")})


def saved_model(fixture, all_cases):
    """The SavedModel's `generate_text`, loaded by `tf.saved_model.load`: its `text`."""
    import tensorflow as tf
    loaded, enc = fixture("saved_model"), fixture("enc")
    found = {}
    for name, case in all_cases.items():
        stops = case.controls.get("stop", [])
        out = loaded.signatures["generate_text"](
            **_saved_inputs(enc, case), **_saved_controls(case), stop_strings=tf.constant(stops, tf.string,
                                                                                          shape=[len(stops)]),
            min_tokens=tf.constant(0), stop_at_eot=tf.constant(True), include_stop_str_in_output=tf.constant(False))
        found[name] = [(t.decode(), None) for t in out["text"].numpy()]
    return found


def saved_model_tokens(fixture, all_cases):
    """The signatures a client deployed before stop strings calls: `generate` (sampling alone)
    and `generate_with_controls` (the penalties and bias), loaded by `tf.saved_model.load`: the
    new tokens (through the export's, which runs on after <|endoftext|>), decoded up to the first
    <|endoftext|>. Not the stop strings, which they do not take."""
    loaded, enc = fixture("saved_model"), fixture("enc")
    found = {}
    for name, case in all_cases.items():
        if "stop" in case.controls:
            continue
        controls = set(case.controls) - {"temperature", "top_k", "top_p", "seed", "logprobs"}
        signature = "generate_with_controls" if controls else "generate"
        out = loaded.signatures[signature](**_saved_inputs(enc, case), **(_saved_controls(case) if controls else {}))
        width = out["output_ids"].shape[1] - LENGTH
        rows = [row[width:width + n].tolist() for row, n in zip(out["output_ids"].numpy(), out["lengths"].numpy())]
        found[name] = [(enc.decode(row[:row.index(enc.eot_token)] if enc.eot_token in row else row), None)
                       for row in rows]
    return found


def litert(fixture, all_cases):
    """`generate_litert` over the LiteRT file."""
    from tfgpt2.formats.litert import generate_litert
    enc = fixture("enc")
    return {name: [(r.text, r.logprobs) for r in generate_litert(fixture("litert_file"),
                                                                 [enc.encode(p) for p in case.prompts], LENGTH,
                                                                 stop_at_eot=True, encoder=enc, **case.controls)]
            for name, case in all_cases.items()}


DOORS = {
    "library": library,
    "tfgpt2 interactive": interactive,
    "tfgpt2 generate": generate_command,
    "tfgpt2 generate --litert": lambda fixture, all_cases: generate_command(fixture, all_cases, litert=True),
    "generate-batch local": lambda fixture, all_cases: generate_batch(fixture, all_cases, "local"),
    "generate-batch beam": lambda fixture, all_cases: generate_batch(fixture, all_cases, "beam"),
    "tfgpt2 serve": serve,
    "SavedModel generate_text": saved_model,
    "SavedModel generate, generate_with_controls": saved_model_tokens,
    "LiteRT": litert,
}


REPORT_LOGPROBS = {"library", "tfgpt2 serve", "LiteRT"}  # the doors that return log-probabilities
CANNOT_SAY = {"SavedModel generate, generate_with_controls": {"stops"}}  # cases a door has no inputs for


@pytest.mark.parametrize("door", DOORS)
def test_every_door_gives_each_prompts_text_alone(door, request, free, expected):
    """Every case the door can express: each row's text is the library's for its prompt alone,
    and so are the log-probabilities where the door reports them (ids, values within 1e-4)."""
    found = DOORS[door](request.getfixturevalue, cases(free))
    assert set(found) == set(expected) - CANNOT_SAY.get(door, set())
    for name, rows in found.items():
        assert [text for text, _ in rows] == [e.text for e in expected[name]], (door, name)
        if "logprobs" in cases(free)[name].controls and door in REPORT_LOGPROBS:
            assert_logprobs([lp for _, lp in rows], [e.logprobs for e in expected[name]])


def assert_logprobs(got, want, tolerance=1e-4):
    """Per row and token: the same top ids, log-probabilities within `tolerance`."""
    for g, w in zip(got, want):
        assert len(g) == len(w)
        for (lp, top), (wlp, wtop) in zip(g, w):
            assert abs(lp - wlp) <= tolerance and [t for t, _ in top] == [t for t, _ in wtop]
            np.testing.assert_allclose([v for _, v in top], [v for _, v in wtop], atol=tolerance)


# ---- what the doors share --------------------------------------------------------------------

@pytest.fixture(scope="module")
def loaded(tiny):
    """`load_model` hands the module's model to the commands and bulk generation."""
    from tfgpt2.formats import checkpoint
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoint, "load_model", lambda folder, **options: tiny)
        yield


@pytest.fixture(scope="module")
def server(tiny, enc):
    """`tfgpt2 serve`'s app over a scheduler of the module's model, in this process."""
    from fastapi.testclient import TestClient
    from tfgpt2.decoding.stops import Vocabulary
    from tfgpt2.serve.app import create_app
    from tfgpt2.serve.scheduler import Scheduler
    scheduler = Scheduler(tiny, max_batch=4, max_queue=8, chunk=16, eot=enc.eot_token, vocabulary=Vocabulary.of(enc))
    with TestClient(create_app(scheduler, model_name="tiny", encoder=enc, hparams=tiny.hparams)) as client:
        yield client


@pytest.fixture(scope="module")
def saved_model(tiny, enc, tmp_path_factory):
    """The module's model exported as a SavedModel and loaded by TensorFlow's own loader."""
    import tensorflow as tf
    from tfgpt2.formats.saved_model import export_saved_model
    return tf.saved_model.load(export_saved_model(tiny, str(tmp_path_factory.mktemp("saved")), encoder=enc))


@pytest.fixture(scope="module")
def litert_file(tiny, tmp_path_factory):
    pytest.importorskip("ai_edge_litert", reason="ai-edge-litert is not installed (requirements.txt)")
    from tfgpt2.formats.litert import export_litert
    return export_litert(tiny, str(tmp_path_factory.mktemp("litert") / "tiny.tflite"))
