"""Every `tfgpt2` command the README shows runs as written, in the order it shows them, in a
folder of its own: the download from a local stand-in for OpenAI's storage (serving a small
random checkpoint; only `--base_url` is added), the rest on what the earlier commands wrote."""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY, require_reference
from tests.test_download_model import Storage, serving
from tfgpt2.formats.download import FILENAMES
from tfgpt2.hparams import default_hparams
from tfgpt2.testing.checkpoints import make_checkpoint

README = (ROOT / "README.md").read_text()
TFGPT2 = Path(sys.executable).parent / "tfgpt2"  # the script `pip install -e .` installs beside python


def commands():
    """The README's commands, in order, each once: the main job of the set-up line, every
    ```bash line and every `code` span that starts with `tfgpt2 `, the rows of the command table."""
    found = []
    setup = re.search(r"```bash\n(.*?)```", README, re.S).group(1).splitlines()[1]
    found += [c.strip().replace(".venv/bin/", "") for c in setup.split("&&") if "tfgpt2 " in c]
    for block in re.findall(r"```bash\n(.*?)```", README, re.S)[1:]:
        found += [line.strip() for line in block.splitlines() if line.startswith("tfgpt2 ")]
    for span in re.findall(r"`([^`\n]+)`", README):
        span = span.replace("\\|", "|")
        if span.startswith("tfgpt2 ") or re.match(r"echo .*\| tfgpt2 ", span):
            found.append(span)
    return list(dict.fromkeys(found))


def test_the_readme_shows_each_command_of_the_tool():
    shown = {re.search(r"tfgpt2 ([a-z-]+)", c).group(1) for c in commands()}
    from tfgpt2.cli.main import COMMANDS
    assert shown == set(COMMANDS)


@pytest.fixture
def storage(tmp_path):
    """A random checkpoint of the tiny shape, served as OpenAI's storage serves 124M."""
    folder = make_checkpoint(str(tmp_path / "served"), default_hparams().override_from_dict(TINY), std=0.1, seed=3)
    files = {name: b"a graph OpenAI's code does not need" if name == "model.ckpt.meta"
             else (Path(folder) / name).read_bytes() for name in FILENAMES}
    with serving(Storage({f"/models/124M/{name}": data for name, data in files.items()})) as store:
        yield store


@pytest.mark.slow
def test_every_command_runs_as_written(storage, tmp_path):
    reference = str(require_reference())
    work = tmp_path / "work"
    work.mkdir()
    (work / "corpus.txt").write_text("It was the best of times, it was the worst of times. " * 40)
    (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Hello", "Once upon a"]))
    env = dict(os.environ, PATH=f"{TFGPT2.parent}{os.pathsep}{os.environ['PATH']}")
    side = tmp_path / "offline"  # where make-checkpoint's 124M-shaped folder does not replace the download
    side.mkdir()
    for command in commands():
        if " download " in f" {command} ":
            command += f" --base_url {storage.url}"
        command = command.replace("--reference_src gpt-2/src", f"--reference_src {shlex.quote(reference)}")
        cwd = side if command.startswith("tfgpt2 make-checkpoint ") else work
        result = subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
        assert "absl" not in result.stderr and "cudart" not in result.stderr, result.stderr
    assert (work / "models" / "124M" / "model.ckpt.index").is_file()
    assert json.loads((side / "models" / "124M" / "hparams.json").read_text())["n_layer"] == 12
    assert (work / "checkpoint" / "run1" / "model-200.index").is_file()
    assert (work / "exports" / "run1" / "1" / "saved_model.pb").is_file()
    assert (work / "exports" / "gpt2-hf" / "model.safetensors").is_file()
    assert len((work / "out.jsonl").read_text().splitlines()) == 2
