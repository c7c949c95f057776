"""The package as a user gets it: the README's set-up installs it, and the README's Python
example runs on what pip installs, in a fresh process outside the repository."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TINY
from tfgpt2.hparams import default_hparams, published_hparams
from tfgpt2.testing.checkpoints import make_checkpoint

README = (ROOT / "README.md").read_text()


def example():
    """The Python block under "## Using it"."""
    section = README.split("\n## Using it\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def comment(code, expression):
    """The value that a `# ...` comment in the example gives for `expression`."""
    return json.loads(re.search(rf"^.*{re.escape(expression)}.*?# (\[.*\])$", code, re.M).group(1))


def test_readme_setup_and_ci_install_the_package():
    """`pip install -e .` after requirements.txt, so that `import tfgpt2` works in any folder."""
    setup = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    venvs = [line for line in setup.splitlines() if line.startswith("python3 -m venv .venv")]
    assert len(venvs) == 2, setup
    for line in venvs:
        assert re.search(r"pip install (-q )?-r requirements\.txt && \.venv/bin/pip install (-q )?-e \. &&", line), line
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    installs = [line.split("#")[0].strip() for line in ci if line.startswith(".venv/bin/pip install")]
    assert installs[-2:] == [".venv/bin/pip install -q -r requirements.txt", ".venv/bin/pip install -q -e ."], ci


@pytest.mark.slow
def test_readme_example_runs_outside_the_repository(tmp_path):
    """pip installs a copy of the package (pyproject.toml and tfgpt2/ only), and the README's
    example runs verbatim in a folder of its own with a random "124M" of the tiny shape;
    its results are checked against the example's comments."""
    source, site, work = tmp_path / "source", tmp_path / "site", tmp_path / "work"
    shutil.copytree(ROOT / "tfgpt2", source / "tfgpt2", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", source)
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                              "--no-index", "--target", str(site), str(source)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    hparams = default_hparams().override_from_dict(TINY)
    make_checkpoint(str(work / "models" / "124M"), hparams, std=0.3, seed=1)
    code = example()
    check = ('\nimport json\nprint(json.dumps({"file": tfgpt2.__file__, "tokens": tokens, '
             '"logits": list(out["logits"].shape), "present": list(out["present"].shape), '
             '"rows": [len(row) for row in rows]}))\n')
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(site), TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-c", code + check], cwd=work, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.splitlines()[-1])
    assert got["file"].startswith(str(site)), got["file"]  # the installed copy, not the checkout
    assert got["tokens"] == comment(code, "enc.encode(")
    assert got["rows"] == [len(got["tokens"]) + 40]

    def shapes(hp):  # [logits, present] for the example's 4-token prompt
        return [[1, 4, hp.n_vocab], [1, hp.n_layer, 2, hp.n_head, 4, hp.n_embd // hp.n_head]]
    assert [got["logits"], got["present"]] == shapes(hparams)
    assert [comment(code, 'out["logits"].shape'), comment(code, 'out["present"].shape')] == \
        shapes(published_hparams("124M"))
