"""The request rules (`tfgpt2.decoding.request`): one range per value, one `fits`, asked alike by
the library, the commands' flags, a JSONL line and the SavedModel's graph."""
import json
import math
import re

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import TINY, samples
from tfgpt2.cli import common, compare, generate as generate_command, generate_batch
from tfgpt2.decoding import request
from tfgpt2.decoding.request import RANGES, batch_seed, check_request, check_sampling, check_value, fits
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
    names = {"top_k": "--top_k", "length": "max_tokens", "prompts": "prompt", "stop": "field 'stop'"}
    for kwargs, message in [
        (dict(top_k=-1), "--top_k must be an integer in [0, 2**31), got -1"),
        (dict(length=0), "max_tokens must be an integer in [1, 2**31), got 0"),
        (dict(prompts=[[5, N_VOCAB]]), f"prompt 0: token ids must be in [0, n_vocab={N_VOCAB}), got [{N_VOCAB}]"),
        (dict(length=N_CTX), f"prompt of 2 tokens + max_tokens {N_CTX} - 1 exceeds the context window n_ctx={N_CTX}"),
        (dict(stop=[[1], []]), "field 'stop' sequence 1 must be a non-empty list of token ids, got []"),
        (dict(seed=True), "seed must be an integer in [0, 2**63), got True"),
        (dict(logit_bias={t: -100 for t in range(N_VOCAB)}), "logit_bias bans every token"),
    ]:
        arguments = dict(dict(prompts=[[5, 6]], length=3), **kwargs)
        with pytest.raises(ValueError) as error:
            check_request(arguments.pop("prompts"), arguments.pop("length"), n_vocab=N_VOCAB, n_ctx=N_CTX,
                          names=names, **arguments)
        assert str(error.value) == message


def test_a_checked_request_is_what_generate_takes():
    checked = check_request([[5, 6], np.array([7])], 4, n_vocab=N_VOCAB, n_ctx=N_CTX, top_k=np.int32(40),
                            logit_bias={np.int64(3): -1}, stop=[[9, 10]], seed=None)
    assert [p.tolist() for p in checked.prompts] == [[5, 6], [7]] and checked.length == 4
    assert checked.context_keep is None
    assert checked.sampling == dict(temperature=1.0, top_k=40, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                                    presence_penalty=0.0, frequency_penalty=0.0, seed=checked.sampling["seed"],
                                    logit_bias={3: -1.0}, stop=[[9, 10]], stop_at_eot=False, eot=50256)
    assert type(checked.sampling["top_k"]) is int and 0 <= checked.sampling["seed"] < 2**31  # drawn
    assert check_sampling(N_VOCAB, seed=LARGEST_SEED)["seed"] == LARGEST_SEED


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


def test_batch_seeds_stay_in_the_seed_range():
    assert batch_seed(7, 3) == 10
    assert batch_seed(LARGEST_SEED, 0) == LARGEST_SEED and batch_seed(LARGEST_SEED, 1) == 0


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
    status, _ = jsonl(tmp_path, tiny_dir, [{"prompt": text, "seed": LARGEST_SEED + 1}], *flags)
    assert status.endswith("(line 0 counted from 0): field 'seed' must be an integer in [0, 2**63), "
                           "got 9223372036854775808 (--skip_bad skips such lines)"), status
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
    check_request([context], length, n_vocab=N_VOCAB, n_ctx=N_CTX)  # generate_litert's, a server's
    with pytest.raises(ValueError, match=re.escape(f"prompt of {len(context)} tokens + length {length + 1} - 1 "
                                                   f"exceeds the context window n_ctx={N_CTX}")):
        check_request([context], length + 1, n_vocab=N_VOCAB, n_ctx=N_CTX)
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
    status, _ = jsonl(tmp_path, tiny_dir, rows, "--length", str(length + 1))
    assert status.endswith(f"(line 0 counted from 0): prompt of {len(context)} tokens + --length {length + 1} - 1 "
                           f"exceeds the context window n_ctx={N_CTX} (--skip_bad skips such lines)"), status
