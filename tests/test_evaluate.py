"""`tfgpt2 evaluate`: strided windows that score each token once, against the mean
loss of OpenAI's graph over the same windows."""
import math

import numpy as np
import pytest

import tfgpt2
from tfgpt2.cli import evaluate as evaluate_cli
from tfgpt2.train import perplexity

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age "
        "of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season "
        "of Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair.")


@pytest.mark.parametrize("n_tokens, n_ctx, stride", [(10, 4, 4), (10, 4, 1), (11, 4, 3), (3, 64, 64), (200, 64, 16)])
def test_windows_score_each_token_once_with_context(n_tokens, n_ctx, stride):
    scored = []
    for begin, end, first in perplexity.windows(n_tokens, n_ctx, stride):
        assert end - begin <= n_ctx and first >= 0
        for target in range(begin + 1 + first, end + 1):
            scored.append(target)
            assert target - 1 - begin >= min(n_ctx - stride, target - 1)  # tokens of context before it
    assert scored == list(range(1, n_tokens))


def _reference_losses(ref, tokens, n_ctx, stride):
    losses = []
    for begin, end, first in perplexity.windows(len(tokens), n_ctx, stride):
        logits = ref.model(np.asarray(tokens[begin:end])[None])["logits"][0].astype(np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        targets = tokens[begin + 1:end + 1]
        losses += [-logp[i, targets[i]] for i in range(first, end - begin)]
    return losses


@pytest.mark.slow
def test_evaluate_equals_the_reference_mean_loss(tiny_dir, reference_tiny, tmp_path, capsys):
    enc = tfgpt2.get_encoder("tiny", tiny_dir.rsplit("/", 1)[0])
    tokens = [enc.eot_token] + enc.encode(TEXT)
    assert len(tokens) > 64  # more than one window
    expected = _reference_losses(reference_tiny, tokens, 64, 24)
    result = perplexity.evaluate(tfgpt2.load_model(tiny_dir), tokens, stride=24, n_bytes=len(TEXT.encode()),
                               batch_size=2)
    assert result["tokens"] == len(tokens) - 1 == len(expected)
    assert abs(result["loss"] - np.mean(expected)) <= 1e-5 * np.mean(expected)
    assert result["bits_per_byte"] == pytest.approx(np.sum(expected) / math.log(2) / len(TEXT.encode()), rel=1e-5)

    (tmp_path / "text.txt").write_text(TEXT)
    evaluate_cli.main(["--model_dir", tiny_dir, "--dataset", str(tmp_path / "text.txt"), "--stride", "24"])
    out = capsys.readouterr().out
    assert f"loss {result['loss']:.4f}" in out and f"tokens {len(expected)}" in out


def test_bad_input_is_a_clear_error(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match=r"--stride must be in \[1, n_ctx=64\], got 65"):
        perplexity.windows(100, 64, 65)
    with pytest.raises(SystemExit, match="missing.txt: cannot read: No such file"):
        evaluate_cli.main(["--model_dir", tiny_dir, "--dataset", str(tmp_path / "missing.txt")])
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(SystemExit, match="empty.txt: no text to evaluate"):
        evaluate_cli.main(["--model_dir", tiny_dir, "--dataset", str(tmp_path / "empty.txt")])


@pytest.mark.slow
def test_an_npz_of_encode_is_scored_as_its_text(tiny_dir, tmp_path, capsys):
    """`tfgpt2 evaluate --dataset corpus.npz` (of `tfgpt2 encode`) prints the line the text
    itself gives; a truncated .npz is one line naming it."""
    from tfgpt2.cli import encode
    (tmp_path / "text.txt").write_text(TEXT)
    encode.main([str(tmp_path / "text.txt"), str(tmp_path / "text.npz"), "--quiet"])
    lines = []
    for dataset in ("text.txt", "text.npz"):
        capsys.readouterr()
        evaluate_cli.main(["--model_dir", tiny_dir, "--dataset", str(tmp_path / dataset), "--quiet"])
        lines.append(capsys.readouterr().out)
    assert lines[0].startswith("tokens ") and lines[1] == lines[0]
    whole = (tmp_path / "text.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(SystemExit, match=r"^error: \S+cut.npz: not a readable .npz file \(BadZipFile"):
        evaluate_cli.main(["--model_dir", tiny_dir, "--dataset", str(tmp_path / "cut.npz")])


@pytest.mark.slow
def test_a_loss_that_is_not_finite_is_an_error(tmp_path, capsys):
    """Weights so large that the logits overflow: the loss is NaN, and the command says so and
    fails rather than print it."""
    from tests.helpers import TINY
    from tfgpt2.hparams import default_hparams
    from tfgpt2.testing.checkpoints import make_checkpoint
    folder = make_checkpoint(str(tmp_path / "huge"), default_hparams().override_from_dict(dict(TINY, n_layer=1)),
                             std=1e30)
    (tmp_path / "text.txt").write_text(TEXT[:100])
    with pytest.raises(SystemExit, match=r"^error: the loss of \S+huge over \S+text.txt is nan"):
        evaluate_cli.main(["--model_dir", folder, "--dataset", str(tmp_path / "text.txt"), "--quiet"])
    assert capsys.readouterr().out == ""
