"""tools/benchmark_train.py: each candidate in its own process, one report row each."""
import subprocess
import sys

import pytest

from tools.benchmark_train import flops_per_token
from tests.helpers import ROOT, TINY, assert_report, rows, run_tool


def test_flops_per_token_of_124m():
    """6 per weight of the products (85M in the blocks, 38.6M in the output layer) and 12 per
    position and feature per layer for attention: 755 MFLOP per token at 128 positions."""
    hparams = dict(n_vocab=50257, n_ctx=1024, n_embd=768, n_head=12, n_layer=12)
    blocks, output = 12 * (768 * 2304 + 768 * 768 + 2 * 768 * 3072), 768 * 50257
    assert flops_per_token(hparams, 128) == 6 * (blocks + output) + 12 * 12 * 128 * 768 == 755_347_968


def test_accumulate_is_tfgpt2s_alone(tiny_dir):
    out = subprocess.run([sys.executable, "tools/benchmark_train.py", "--model_dir", tiny_dir, "--accumulate",
                          "2", "--candidates", "tfgpt2", "keras-hub"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 2 and "--accumulate is tfgpt2's alone" in out.stderr


@pytest.mark.slow  # four fresh TensorFlow processes
def test_float32_baseline_runs_beside_the_options_given(tiny_dir, tmp_path):
    """tfgpt2-float32 trains with XLA whatever --no_xla says, while tfgpt2 takes it: the
    workers' own account of what they ran, in the report's rows; each
    step counts every accumulated micro-batch, and model GFLOP/s is tokens/s times the work
    per token."""
    done = run_tool("benchmark_train.py", "--model_dir", tiny_dir, "--batch", "2", "--length", "15", "--steps", "2",
                    "--warmup", "1", "--candidates", "tfgpt2", "tfgpt2-float32",
                    "--no_xla", "--accumulate", "3", "--repeats", "1",
                    "--report", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    data = assert_report(str(tmp_path), "train", "benchmark_train.py")
    setups = {r["implementation"]: r["setup"] for r in rows(data)}
    assert setups == {"tfgpt2": "float32", "tfgpt2-float32": "float32, XLA"}
    assert "accumulating 3 micro-batches" in data["notes"][0]
    flops = flops_per_token(TINY, 15)
    assert data["settings"]["flops_per_token"] == flops
    for row in rows(data):
        assert row["processes"] == 1 and row["first_step_s"]["n"] == 1 and row["tokens_per_s"]["n"] == 2
        assert row["tokens_per_step"] == 3 * 2 * 15
        for key in ("median", "min", "max"):
            assert row["gflops"][key] == pytest.approx(row["tokens_per_s"][key] * flops / 1e9)


def test_a_row_spans_its_processes():
    """--repeats N: tokens/s over every step of the N processes, the rest over the processes."""
    from tools.benchmark_train import row_of
    runs = [dict(tokens_per_step=30, step_s=[1.0, 2.0], first_step_s=5.0, peak_rss_mb=100, precision="float32",
                 xla=True),
            dict(tokens_per_step=30, step_s=[3.0, 1.5], first_step_s=7.0, peak_rss_mb=120, precision="float32",
                 xla=True)]
    row = row_of("tfgpt2", runs, (2.0, 1.0))
    assert row["processes"] == 2 and row["setup"] == "float32, XLA"
    assert row["tokens_per_s"]["n"] == 4 and row["tokens_per_s"]["max"] == 30 and row["tokens_per_s"]["min"] == 10
    assert row["first_step_s"]["median"] == 6.0 and row["peak_rss_mb"]["max"] == 120
    assert row["gflops"]["max"] == 30 * 2.0 / 1e9
    assert row_of("tfgpt2", [runs[0], "exit 1"], (2.0, 1.0)) == {"implementation": "tfgpt2", "error": "exit 1"}


def test_lora_figures_count_the_models_own_variables():
    """The LoRA work per token drops the weight gradients (4 per weight, not 6); the GPU
    accounting's weights and adapters are those of the model's variables (the 1558M shape, and
    a tiny model with LoRA enabled at the default targets)."""
    import math
    import numpy as np
    from tools.benchmark_train import gpu_accounting, lora_parameters
    from tfgpt2.formats.variables import variable_shapes
    from tfgpt2.hparams import default_hparams, published_hparams
    from tfgpt2.model import GPT2
    hparams = published_hparams("1558M")
    hp = hparams.values()
    weights = sum(math.prod(s) for s in variable_shapes(hparams).values())
    attention = 3 * hp["n_layer"] * 2 * 2 * 1024 * hp["n_embd"]
    assert flops_per_token(hp, 1024, lora=True) - attention == 4 / 6 * (flops_per_token(hp, 1024) - attention)
    full, lora = gpu_accounting(hp, 1024, 8)
    assert full["weights"] * 2**30 == 4 * weights and full["optimizer_state"] == 2 * full["gradients"]
    assert lora["gradients"] * 2**30 == 4 * lora_parameters(hp, 8) == 4 * 48 * 8 * (1600 + 3 * 1600)
    assert lora["total"] < full["total"] / 3 and lora["activations"] == full["activations"]
    model = GPT2(default_hparams().override_from_dict({**TINY, "n_vocab": 500}))
    model.enable_lora(8)
    assert sum(int(np.prod(v.shape)) for v in model.trainable_variables) == lora_parameters(TINY, 8)


def test_headlines_set_lora_against_full_fine_tuning():
    """One README row for LoRA against every weight where both ran, named by the model folder;
    else a row per tfgpt2 candidate that ran."""
    import argparse
    from tools.benchmark_train import headlines_of
    from tools.report import spread

    def row(name, tokens, peak):
        return {"implementation": name, "setup": "float32, XLA", "tokens_per_s": spread([tokens]),
                "peak_rss_mb": spread([peak])}
    args = argparse.Namespace(model_dir="models/1558M/", batch=1, length=1024, lora_rank=8, optimizer="adafactor",
                              remat=True)
    both = [row("tfgpt2-lora", 3.2, 9100.4), row("tfgpt2", 2.0, 15200.0)]
    assert headlines_of(both, args) == [{
        "what": "fine-tuning 1558M, batch 1 x 1024, LoRA rank 8 against every weight (float32, XLA, adafactor, remat)",
        "figure": "peak RSS 9,100 against 15,200 MB, 3 against 2 tokens/s"}]
    failed = [both[0], {"implementation": "tfgpt2", "error": "failed: out of memory"}]
    assert headlines_of(failed, args) == [{"what": "fine-tuning 1558M, batch 1 x 1024, tfgpt2-lora (float32, XLA)",
                                           "figure": "3 tokens/s, peak RSS 9,100 MB"}]
