"""The sample scripts on the tiny model (n_ctx 64): their commands' main() (`tfgpt2 generate`,
`tfgpt2 interactive`) in this process, and under the original's names (`python -m
tfgpt2.generate_unconditional_samples`, `python -m tfgpt2.interactive_conditional_samples`) in a
child process where the process itself is tested: a closed pipe, Ctrl-C, output as it comes."""
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from tests.helpers import ROOT, TINY, samples
from tfgpt2.cli import generate as generate_unconditional_samples
from tfgpt2.cli import interactive as interactive_conditional_samples
from tfgpt2.formats.checkpoint import load_model
from tfgpt2.encoder import default_encoder, get_encoder
from tfgpt2.sample import sample_sequence

pytestmark = pytest.mark.slow  # the sample scripts in fresh processes

UNCONDITIONAL = "tfgpt2.generate_unconditional_samples"
INTERACTIVE = "tfgpt2.interactive_conditional_samples"
ENV = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
RULE = "=" * 80 + "\n"


def command(module, model_dir, *args):
    models_dir, model_name = os.path.split(model_dir)
    return [sys.executable, "-m", module, "--models_dir", models_dir, f"--model_name={model_name}", *args]


def in_process(script, model_dir, *args, capsys, monkeypatch, input=""):
    """The command's main() in this process on `input` as stdin: its stdout and stderr."""
    monkeypatch.setattr("sys.stdin", io.StringIO(input))
    assert script.main(flags(model_dir, *args)) in (None, 0)
    return capsys.readouterr()


def test_unconditional_numbers_samples_1_to_n_and_repeats_with_a_seed(tiny_dir, capsys, monkeypatch, signals):
    args = ["--nsamples", "3", "--length", "8"]
    out, again, one_at_a_time = (
        in_process(generate_unconditional_samples, tiny_dir, *args, "--batch_size", batch_size, "--seed", "1",
                   capsys=capsys, monkeypatch=monkeypatch).out for batch_size in ("2", "2", "1"))
    got = samples(out)
    assert [n for n, _ in got] == [1, 2, 3]
    assert all(text for _, text in got)
    assert len({text for _, text in got}) == 3  # sample k has its own seed, seed + k
    assert again == out
    assert one_at_a_time == out  # as --seed's help says: whatever --batch_size


def test_unconditional_greedy_is_the_library_greedy(tiny_dir, capsys, monkeypatch, signals):
    out = in_process(generate_unconditional_samples, tiny_dir, "--nsamples", "2", "--batch_size", "2", "--length",
                     "12", "--top_k", "1", capsys=capsys, monkeypatch=monkeypatch).out
    enc = get_encoder(os.path.basename(tiny_dir), os.path.dirname(tiny_dir))
    tokens = sample_sequence(model=load_model(tiny_dir), length=12, start_token=enc.eot_token,
                             batch_size=2, top_k=1)
    assert samples(out) == [(1, enc.decode(tokens[0, 1:])), (2, enc.decode(tokens[1, 1:]))]


def test_unconditional_runs_until_its_output_is_closed(tiny_dir):
    """With the defaults (--nsamples 0, --length n_ctx) it goes on past the first batches;
    `| head` ends it quietly."""
    with subprocess.Popen(command(UNCONDITIONAL, tiny_dir, "--batch_size", "2", "--stop_at_eot"), cwd=ROOT,
                          env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        banners = []
        for line in child.stdout:
            banners += re.findall(r"^=+ SAMPLE (\d+) =+$", line)
            if len(banners) == 5:
                break
        child.stdout.close()
        assert child.wait(timeout=60) == -signal.SIGPIPE
        assert banners == ["1", "2", "3", "4", "5"]
        assert "Traceback" not in child.stderr.read()


def test_length_over_the_window_is_refused_as_the_original_does(tiny_dir, capsys, signals):
    for script in (generate_unconditional_samples, interactive_conditional_samples):
        with pytest.raises(SystemExit) as exit:
            script.main(flags(tiny_dir, "--length", "65"))
        assert exit.value.code == "Can't get samples longer than window size: 64"


def test_interactive_batch_size_must_divide_nsamples(tiny_dir, capsys, signals):
    with pytest.raises(SystemExit) as exit:
        interactive_conditional_samples.main(flags(tiny_dir, "--nsamples", "3", "--batch_size", "2"))
    assert exit.value.code == 2
    assert capsys.readouterr().err.endswith("error: --batch_size 2 must divide --nsamples 3 (see --help)\n")


def test_interactive_reads_one_prompt_per_line_until_end_of_input(tiny_dir, capsys, monkeypatch, signals):
    """Empty lines are refused, a prompt too long for the default length (n_ctx // 2 = 32)
    gets an error, the rest nsamples each; without a terminal there is no prompt text."""
    lines = "\n".join(["Hello world", "", "Hello world", "word " * 40, "The end"]) + "\n"
    args = ["--nsamples", "2", "--batch_size", "2", "--seed", "5"]
    (out, err), (again, _) = (in_process(interactive_conditional_samples, tiny_dir, *args, input=lines,
                                         capsys=capsys, monkeypatch=monkeypatch) for _ in range(2))
    assert "Model prompt >>>" not in out and "Prompt should not be empty!" in err
    assert "error: line 4: the prompt of 41 tokens + --length 32 - 1 exceeds the context window n_ctx=64\n" in err
    answers = out.split(RULE)  # the long prompt gets no block, not an empty one
    assert len(answers) == 4 and answers[-1] == ""
    hello, hello_again, end = (samples(answer) for answer in answers[:3])
    for got in (hello, hello_again, end):
        assert [n for n, _ in got] == [1, 2] and all(text for _, text in got)
    assert hello != hello_again  # each batch of the run has its own seed
    assert again == out


def test_interactive_ctrl_c_ends_it_without_a_traceback(tiny_dir):
    # SIGINT at its default, as a shell leaves it, even where the tests run with it ignored
    with subprocess.Popen(command(INTERACTIVE, tiny_dir, "--length", "4"), cwd=ROOT, env=ENV,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as child:
        child.stdin.write("Hello\n")
        child.stdin.flush()
        while (line := child.stdout.readline()) != RULE:  # answered: now it waits for the next prompt
            assert line, child.stderr.read()
        child.send_signal(signal.SIGINT)
        assert child.wait(timeout=30) == -signal.SIGINT
        assert "Traceback" not in child.stderr.read()


NONSENSE = [("--temperature", "nan"), ("--temperature", "inf"), ("--temperature", "-1"), ("--top_p", "nan"),
            ("--top_p", "1.5"), ("--top_k", "-3"), ("--top_k", "2.5"), ("--nsamples", "-1"),
            ("--batch_size", "0"), ("--length", "0"), ("--length", "ten"), ("--seed", "-1"), ("--seed", "1e3"),
            ("--min_p", "1.5"), ("--min_p", "nan"), ("--repetition_penalty", "0"), ("--presence_penalty", "-1"),
            ("--frequency_penalty", "inf"), ("--logit_bias", "5"), ("--logit_bias", "5=nan"), ("--logit_bias", "x=1")]


def flags(model_dir, *args):
    return command("-", model_dir, *args)[3:]


@pytest.mark.parametrize("script, name", [(generate_unconditional_samples, "generate"),
                                          (interactive_conditional_samples, "interactive")],
                         ids=["unconditional", "interactive"])
@pytest.mark.parametrize("flag, value", NONSENSE, ids=[f"{f}={v}" for f, v in NONSENSE])
def test_nonsense_flags_are_refused_in_one_line(tiny_dir, capsys, signals, script, name, flag, value):
    """Before the model is loaded, naming the flag and the value (the last of a flag given twice
    counts: were it accepted, one short sample would end the run): text that is no number by
    argparse (a usage error), a number out of range by the request rules (`decoding.request`)."""
    with pytest.raises(SystemExit) as exit:
        script.main(flags(tiny_dir, "--nsamples", "1", "--length", "2", flag, value))
    err = capsys.readouterr().err
    if exit.value.code == 2:
        assert err.count("\n") == 1, err
        assert err.startswith(f"tfgpt2 {name}: error: argument {flag}: ")
        assert err.endswith(f"{value!r} (see --help)\n")
    else:
        number = value.split("=")[-1]
        assert exit.value.code.startswith(f"error: {flag} ") and "\n" not in exit.value.code, exit.value.code
        assert exit.value.code.endswith((f", got {number}", f", got {float(number)}")), exit.value.code


def test_interactive_needs_a_sample_per_prompt(tiny_dir, capsys, signals):
    with pytest.raises(SystemExit):
        interactive_conditional_samples.main(flags(tiny_dir, "--nsamples", "0"))
    assert "argument --nsamples: must be an integer >= 1, got '0'" in capsys.readouterr().err


def test_help_shows_the_printf_example_and_what_seeds_depend_on(capsys, signals):
    with pytest.raises(SystemExit):
        interactive_conditional_samples.main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: tfgpt2 interactive ")
    assert "    printf 'First prompt\\nSecond prompt\\n' | tfgpt2 interactive --length 20 --seed 1\n" in out
    assert "    printf 'First prompt\\nSecond prompt\\n' | python -m tfgpt2.interactive_conditional_samples\n" in out
    words = " ".join(out.split())
    assert "sample k uses seed + k, whatever --batch_size" in words
    assert "only affects" not in words


def test_a_bad_model_folder_is_named_in_one_line(tiny_dir, tmp_path, signals):
    """hparams.json without n_layer names the key (not the 124M default's missing h2..h11)."""
    folder = shutil.copytree(tiny_dir, tmp_path / "tiny")
    hparams = json.loads((folder / "hparams.json").read_text())
    del hparams["n_layer"]
    (folder / "hparams.json").write_text(json.dumps(hparams))
    for script in (generate_unconditional_samples, interactive_conditional_samples):
        with pytest.raises(SystemExit) as exit:
            script.main(flags(str(folder), "--nsamples", "1", "--length", "2"))
        assert exit.value.code == f"error: {folder / 'hparams.json'}: missing n_layer; a GPT-2 hparams.json sets " \
                                  "all of n_vocab, n_ctx, n_embd, n_head, n_layer"


def test_a_sample_is_printed_as_it_is_generated(tmp_path):
    """The unconditional script prints a sample as it comes: its banner and the first of its
    text are read from the child's stdout while it still generates the rest (a tiny model with
    a window of 128, so that one sample takes a while)."""
    from tfgpt2.hparams import default_hparams
    from tfgpt2.testing.checkpoints import make_checkpoint
    hparams = default_hparams().override_from_dict(dict(TINY, n_ctx=128))
    folder = str(make_checkpoint(str(tmp_path / "long"), hparams, std=0.3, seed=1))
    with subprocess.Popen(command(UNCONDITIONAL, folder, "--nsamples", "1", "--length", "120", "--top_k", "1",
                                  "--repetition_penalty", "1.2"), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as child:
        first = b""
        while first.count(b"\n") < 1 or first.endswith(b"=\n"):  # the banner, then some text
            chunk = os.read(child.stdout.fileno(), 1 << 16)
            assert chunk, child.stderr.read().decode()[-2000:]
            first += chunk
        running = child.poll() is None
        rest, err = child.communicate(timeout=300)
    assert child.returncode == 0, err.decode()[-2000:]
    ((number, text),) = samples((first + rest).decode())
    assert number == 1 and running
    assert len(first) < len((first + rest)) / 2, "the sample came at once"
