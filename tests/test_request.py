"""The request rules (`tfgpt2.decoding.request`): one range per value, one `fits`, asked alike by
the library, the commands' flags, a JSONL line and the SavedModel's graph."""
import dataclasses
import json
import math
import re

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import TINY, samples
from tfgpt2.cli import common, compare, generate as generate_command, generate_batch
from tfgpt2.decoding import request
from tfgpt2.decoding.request import RANGES, check_request, check_value, fits
from tfgpt2.seeds import draw, seed_of
from tfgpt2.formats import checkpoint
from tfgpt2.sample import generate
from tfgpt2.testing import reference

N_VOCAB, N_CTX = TINY["n_vocab"], TINY["n_ctx"]
LARGEST_SEED = 2**63 - 1
TEXT = "the cat sat on the mat"  # 6 tokens; both tests generate as many new ones as fit: one compile


# ---- the rules alone ----------------------------------------------------------------------

VALUES = {  # field: (values in range, values out of range)
    "length": ([1, 2**31 - 1], [0, -1, 2**31]),
    "temperature": ([0.0, 1e30], [-1e-30, math.inf, math.nan]),
    "top_k": ([0, 2**31 - 1], [-1, 2**31]),
    "top_p": ([0.0, 1.0], [-0.1, 1.5, math.nan]),
    "min_p": ([0.0, 1.0], [1.01, math.nan]),
    "seed": ([0, LARGEST_SEED], [-1, 2**63]),
    "repetition_penalty": ([1e-9, 1.0], [0.0, -1.0, math.inf]),
    "presence_penalty": ([0.0, 2.0], [-0.5, math.inf]),
    "frequency_penalty": ([0.0, 2.0], [-0.5, math.nan]),
    "logit_bias": ([-math.inf, -100.0, 5.0], [math.inf, math.nan]),
}


@pytest.mark.parametrize("field", sorted(VALUES))
def test_python_and_the_graph_hold_the_same_range(field):
    """Each value in or out of its range is so for `check_value` (the library, the flags, a
    JSONL line) and for the same `Range` over a tensor (the SavedModel's graph)."""
    value_range, (good, bad) = RANGES[field], VALUES[field]
    dtype = tf.int64 if value_range.kind is int else tf.float32
    for value in good:
        assert check_value(field, value) == value
        assert bool(value_range.holds(tf.constant(value, dtype))), (field, value)
    for value in bad:
        with pytest.raises(ValueError, match=f"^{re.escape(field)} must be {re.escape(str(value_range))}, got "):
            check_value(field, value)
        if value_range.kind is float or -2**63 <= value < 2**63:  # what the tensor's dtype can hold
            assert not bool(value_range.holds(tf.constant(value, dtype))), (field, value)


def test_a_field_is_named_as_its_user_knows_it():
    names = {"top_k": "--top_k", "length": "max_tokens", "prompts": "prompt", "stop_token_ids": "field 'stop'",
             "stop": "--stop", "min_tokens": "--min_tokens"}
    for kwargs, message in [
        (dict(top_k=-1), "--top_k must be an integer in [0, 2**31), got -1"),
        (dict(length=0), "max_tokens must be an integer in [1, 2**31), got 0"),
        (dict(prompts=[[5, N_VOCAB]]), f"prompt 0: token ids must be in [0, n_vocab={N_VOCAB}), got [{N_VOCAB}]"),
        (dict(length=N_CTX), f"prompt of 2 tokens + max_tokens {N_CTX} - 1 exceeds the context window n_ctx={N_CTX}"),
        (dict(stop_token_ids=[[1], []]), "field 'stop' sequence 1 must be a token id or a non-empty list of token ids, "
                                         "got []"),
        (dict(seed=True), "seed must be an integer in [0, 2**63), got True"),
        (dict(logit_bias={t: -100 for t in range(N_VOCAB)}), "logit_bias bans every token"),
        (dict(stop=["ok", ""]), "--stop 1 must be 1 to 64 bytes of UTF-8, got 0: ''"),
        (dict(stop=["é" * 33]), f"--stop 0 must be 1 to 64 bytes of UTF-8, got 66: {'é' * 33!r}"),
        (dict(stop=["x"] * 65), "--stop: at most 64 stop strings, got 65"),
        (dict(stop=[5]), "--stop must be a text or a list of texts, got [5]"),
        (dict(min_tokens=4), "--min_tokens must be at most max_tokens (3), got 4"),
        (dict(logprobs=6), "logprobs must be an integer in [0, 6), got 6"),
        (dict(stop_at_eot=1), "stop_at_eot must be true or false, got 1"),
    ]:
        arguments = dict(dict(prompts=[[5, 6]], length=3), **kwargs)
        prompts = arguments.pop("prompts")
        with pytest.raises(ValueError) as error:
            made = check_request(n_vocab=N_VOCAB, n_ctx=N_CTX, names=names, **arguments)
            request.check_window(max(map(len, request.check_prompts(prompts, N_VOCAB))), made.length, N_CTX,
                                 names=names)
        assert str(error.value) == message


def test_a_checked_request_holds_every_control():
    """The request object holds every control, checked and in one form (Python numbers, tuples),
    with vLLM's names where they exist (`ignore_eos`); a seed of None is drawn from the whole
    range, and one given is kept."""
    checked = check_request(n_vocab=N_VOCAB, n_ctx=N_CTX, length=4, top_k=np.int32(40), logit_bias={np.int64(3): -1},
                            stop="\n", stop_token_ids=[9, [9, 10]], min_tokens=2, logprobs=3, context_keep=8)
    assert checked == request.Request(length=4, top_k=40, logit_bias=((3, -1.0),), stop=("\n",),
                                      stop_token_ids=((9,), (9, 10)), min_tokens=2, logprobs=3, context_keep=8,
                                      seed=checked.seed)
    assert type(checked.top_k) is int and 0 <= checked.seed < 2**63 and checked.ignore_eos
    assert check_request(n_vocab=N_VOCAB, n_ctx=N_CTX, length=1, seed=LARGEST_SEED).seed == LARGEST_SEED
    with pytest.raises(dataclasses.FrozenInstanceError):
        checked.length = 5


def test_json_fields_are_read_by_one_reader():
    """The JSON shapes of "stop" and "logit_bias", as the server's protocol and a JSONL line read
    them (`json_stop`, `json_logit_bias`): a text or a list of texts; an object of token ids as
    strings of digits to numbers."""
    assert request.json_stop("x") == "x" and request.json_stop(["a", "b"]) == ["a", "b"]
    assert request.json_stop(None) is None
    assert request.json_logit_bias({"50256": -100, "7": 1.5}) == {50256: -100, 7: 1.5}
    for reader, value, message in [
        (request.json_stop, 5, "stop must be a string or a list of strings, got 5"),
        (request.json_stop, ["a", 1], 'stop must be a string or a list of strings, got ["a", 1]'),
        (request.json_logit_bias, [1], 'logit_bias must be an object of token ids to numbers: {"50256": -100}, '
                                       'got [1]'),
        (request.json_logit_bias, {"x": 1}, "logit_bias keys must be token ids in decimal digits, got 'x'"),
        (request.json_logit_bias, {"+7": 1}, "logit_bias keys must be token ids in decimal digits, got '+7'"),
    ]:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            reader(value)


def test_the_length_rule_is_the_originals_and_slides_with_context_keep():
    assert fits(N_CTX, 1, N_CTX) and fits(2, N_CTX - 1, N_CTX) and not fits(2, N_CTX, N_CTX)
    assert request.check_window(2, N_CTX - 1, N_CTX) == (N_CTX - 1, None)
    assert request.check_window(2, 1000, N_CTX, context_keep=N_CTX - 1) == (1000, N_CTX - 1)
    for longest, length, keep, message in [
        (N_CTX + 1, 1, None, f"prompt of {N_CTX + 1} tokens exceeds the context window n_ctx={N_CTX}"),
        (N_CTX + 1, 1, 8, f"prompt of {N_CTX + 1} tokens exceeds the context window n_ctx={N_CTX}"),
        (2, 5, N_CTX, f"context_keep must be an integer in [1, {N_CTX}), got {N_CTX}"),
    ]:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            request.check_window(longest, length, N_CTX, context_keep=keep)


def test_derived_seeds_stay_in_the_seed_range():
    """Sample k of a run seeded s uses s + k, wrapped into the range, for Python ints and int64
    tensors (the SavedModel's rows) alike, and a drawn seed is anywhere in the range."""
    assert seed_of(7, 3) == 10
    assert seed_of(LARGEST_SEED, 0) == LARGEST_SEED and seed_of(LARGEST_SEED, 1) == 0
    seeds_ = tf.constant([LARGEST_SEED, LARGEST_SEED - 2, 7, 0], tf.int64)
    rows = tf.constant([1, 3, 3, 5])
    assert seed_of(seeds_, rows).numpy().tolist() == [seed_of(int(s), int(r)) for s, r in zip(seeds_, rows)] == [
        0, 0, 10, 5]
    drawn = [draw() for _ in range(64)]
    assert all(RANGES["seed"].holds(s) for s in drawn) and max(drawn) >= 2**62  # the whole range, not 2**31


# ---- every entry point gives the rule's answer --------------------------------------------

@pytest.fixture
def loaded(tiny, monkeypatch):
    """The commands load the shared tiny model (one compile per shape for the whole test)
    after checking their flags as they do for any model."""
    monkeypatch.setattr(checkpoint, "load_model", lambda folder, **options: tiny)


def jsonl(tmp_path, tiny_dir, rows, *flags):
    """`tfgpt2 generate-batch` on `rows`: its status (0 or the error) and the rows it wrote."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out.unlink(missing_ok=True)
    status = generate_batch.main(["--model_dir", tiny_dir, "--input", str(src), "--output", str(out),
                                  "--batch_size", "1", "--quiet", *flags])
    return status, [json.loads(line) for line in open(out)] if out.exists() else []


@pytest.mark.slow
def test_the_seed_range_is_the_same_for_the_library_the_flags_and_a_jsonl_line(tiny, tiny_dir, loaded, tmp_path,
                                                                               capsys, signals):
    """The largest seed is accepted and gives the same tokens everywhere; the first one past it
    is refused with the rule's message; --seed + batch number wraps inside the range."""
    enc = common.encoder_of(tiny_dir)
    text, context = TEXT, enc.encode(TEXT)
    length = N_CTX + 1 - len(context)
    largest, first = (generate(tiny, [context], length, seed=seed)[0][len(context):].tolist()
                      for seed in (LARGEST_SEED, 0))
    with pytest.raises(ValueError, match=re.escape("seed must be an integer in [0, 2**63), got 9223372036854775808")):
        generate(tiny, [context], length, seed=LARGEST_SEED + 1)

    argv = ["--model_dir", tiny_dir, "--prompt", text, "--length", str(length), "--quiet"]
    generate_command.main(argv + ["--seed", str(LARGEST_SEED), "--nsamples", "2"])
    assert samples(capsys.readouterr().out) == [(1, enc.decode(largest)), (2, enc.decode(first))]
    with pytest.raises(SystemExit) as exit:
        generate_command.main(argv + ["--seed", str(LARGEST_SEED + 1)])
    assert exit.value.code == "error: --seed must be an integer in [0, 2**63), got 9223372036854775808"

    flags = ["--length", str(length), "--seed", "5"]
    assert jsonl(tmp_path, tiny_dir, [{"prompt": text, "seed": LARGEST_SEED}], *flags) == (
        0, [dict(line=0, prompt=text, text=enc.decode(largest), tokens=largest)])
    capsys.readouterr()
    status, _ = jsonl(tmp_path, tiny_dir, [{"prompt": text, "seed": LARGEST_SEED + 1}], *flags)
    assert status.endswith("1 bad line(s) of " + str(tmp_path / "in.jsonl") + ", each named above (--skip_bad skips "
                           "such lines)"), status
    assert capsys.readouterr().err.endswith("(line 0 counted from 0): field 'seed' must be an integer in [0, 2**63), "
                                            "got 9223372036854775808\n")
    status, written = jsonl(tmp_path, tiny_dir, [{"prompt": text}], "--length", str(length), "--seed",
                            str(LARGEST_SEED))
    assert status == 0 and written[0]["tokens"] == largest
    assert jsonl(tmp_path, tiny_dir, [{"prompt": text}], "--length", "4", "--seed", str(LARGEST_SEED + 1)) == (
        "error: --seed must be an integer in [0, 2**63), got 9223372036854775808", [])


@pytest.mark.slow
def test_prompt_and_length_fit_the_window_alike_in_the_library_the_flags_and_a_jsonl_line(
        tiny, tiny_dir, loaded, tmp_path, capsys, signals, monkeypatch):
    """prompt + length - 1 = n_ctx is accepted by the rule, `tfgpt2 generate`, `tfgpt2 compare`
    and a JSONL line (with the same tokens where they generate, sampled as the test above, so
    that nothing more is compiled); one more token is refused by each, with the rule's message."""
    enc = common.encoder_of(tiny_dir)
    text, context = TEXT, enc.encode(TEXT)
    length = N_CTX + 1 - len(context)
    request.check_window(len(context), length, N_CTX)  # generate_litert's, a server's
    with pytest.raises(ValueError, match=re.escape(f"prompt of {len(context)} tokens + length {length + 1} - 1 "
                                                   f"exceeds the context window n_ctx={N_CTX}")):
        request.check_window(len(context), length + 1, N_CTX)
    new = generate(tiny, [context], length, seed=1)[0][len(context):].tolist()
    assert len(new) == length

    argv = ["--model_dir", tiny_dir, "--prompt", text, "--seed", "1", "--quiet", "--length"]
    generate_command.main(argv + [str(length)])
    assert samples(capsys.readouterr().out) == [(1, enc.decode(new))]
    with pytest.raises(SystemExit) as exit:
        generate_command.main(argv + [str(length + 1)])
    assert exit.value.code == f"error: --prompt of {len(context)} tokens + --length {length + 1} - 1 exceeds the " \
                              f"context window n_ctx={N_CTX}"

    class NotStarted:  # the reference's child process, which the check comes before
        def __init__(self, *args):
            raise reference.ReferenceError("not started")
    monkeypatch.setattr(reference, "Reference", NotStarted)
    src = tmp_path / "src"
    src.mkdir()
    for name in ("model.py", "sample.py"):
        (src / name).touch()
    argv = ["--model_dir", tiny_dir, "--reference_src", str(src), "--prompt", text, "--quiet", "--length"]
    for n, message in [(length, "failed: not started"), (length + 1, f"exceeds the context window n_ctx={N_CTX}")]:
        with pytest.raises(SystemExit) as exit:
            compare.main(argv + [str(n)])
        assert exit.value.code.endswith(message), exit.value.code

    rows = [{"prompt": text, "seed": 1}]
    assert jsonl(tmp_path, tiny_dir, rows, "--length", str(length)) == (
        0, [dict(line=0, prompt=text, text=enc.decode(new), tokens=new)])
    capsys.readouterr()
    status, _ = jsonl(tmp_path, tiny_dir, rows, "--length", str(length + 1))
    assert status.endswith("each named above (--skip_bad skips such lines)"), status
    assert capsys.readouterr().err.endswith(f"(line 0 counted from 0): prompt of {len(context)} tokens + --length "
                                            f"{length + 1} - 1 exceeds the context window n_ctx={N_CTX}\n")
