"""The package as a user gets it: the README's set-up installs it, the README's Python example
runs on what pip installs, and a wheel installs the `tfgpt2` command, whose every subcommand
works from a folder outside the repository, with none of TensorFlow's start-up lines."""
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY
from tests.test_download_model import Storage, assert_complete, fake_model, serving
from tfgpt2.cli.main import COMMANDS
from tfgpt2.hparams import default_hparams, published_hparams
from tfgpt2.testing.checkpoints import make_checkpoint

# What TensorFlow writes to descriptor 2 as it starts, and its C++ log lines in general
TF_STARTUP = re.compile(r"absl::InitializeLog|cudart_stub|cpu_feature_guard|cuInit|oneDNN|"
                        r"^[IWEF]\d{4} \d\d:\d\d:\d\d", re.M)
SUBPACKAGES = ["tfgpt2", "tfgpt2.cli", "tfgpt2.decoding", "tfgpt2.formats", "tfgpt2.testing", "tfgpt2.train"]

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
    copy_source(source)
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


def copy_source(source):
    """What the package is built from (pyproject.toml's packages and module), without caches."""
    shutil.copytree(ROOT / "tfgpt2", source / "tfgpt2", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "tfgpt2_cli.py"):
        shutil.copy(ROOT / name, source)


def test_every_subpackage_is_packaged():
    """pyproject.toml lists each folder of tfgpt2 with an __init__.py (a new one must be added)."""
    folders = sorted(".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "tfgpt2").rglob("__init__.py"))
    text = (ROOT / "pyproject.toml").read_text()
    listed = json.loads(re.search(r"^packages = (\[.*\])$", text, re.M).group(1))
    assert sorted(listed) == folders == SUBPACKAGES
    assert re.search(r'^py-modules = \["tfgpt2_cli"\]$', text, re.M)
    assert re.search(r'^\[project\.scripts\]\ntfgpt2 = "tfgpt2_cli:main"$', text, re.M)


@pytest.mark.slow
def test_the_wheel_installs_a_tfgpt2_command_that_works_outside_the_repository(tmp_path):
    """`pip wheel`, installed into a fresh venv (TensorFlow and the other dependencies seen
    through a .pth file naming this venv's site-packages, as nothing can be downloaded), then
    from a folder of its own: every command's --help, make-checkpoint, download from a local
    server, generate, train, export and params, each checked for its result and for a stderr
    free of TensorFlow's start-up lines."""
    source, wheels, venv, work = (tmp_path / name for name in ("source", "wheels", "venv", "work"))
    copy_source(source)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "--no-index", "-w", str(wheels), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    [wheel] = wheels.glob("tfgpt2-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert {"tfgpt2_cli.py", "tfgpt2/assets/encoder.json", "tfgpt2/assets/vocab.bpe", "tfgpt2/cli/main.py"} <= names
    assert {f"{package.replace('.', '/')}/__init__.py" for package in SUBPACKAGES} <= names
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/"))]
    assert re.search(r"^tfgpt2 = tfgpt2_cli:main$", entry_points, re.M), entry_points

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                                "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(site) / "zz_dependencies.pth").write_text("".join(f"{path}\n" for path in ours))
    work.mkdir()
    where = subprocess.run([str(python), "-c", "import importlib.util as u; "
                            "print(u.find_spec('tfgpt2').origin); print(u.find_spec('tfgpt2_cli').origin)"],
                           cwd=work, capture_output=True, text=True, check=True).stdout.split()
    assert all(path.startswith(site) for path in where), where  # the wheel's copy, not the checkout

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv))
    script = venv / "bin" / "tfgpt2"
    assert script.is_file()

    def tfgpt2(*args):
        """`tfgpt2 ARGS` in the work folder: its stdout and stderr, once it has succeeded with
        none of TensorFlow's start-up lines on stderr."""
        result = subprocess.run([str(script), *args], cwd=work, env=env, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, f"tfgpt2 {' '.join(args)}: {result.stderr[-3000:]}"
        assert not TF_STARTUP.search(result.stderr), f"tfgpt2 {' '.join(args)}: {result.stderr[-3000:]}"
        assert "Traceback" not in result.stderr
        return result.stdout, result.stderr

    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the --help runs beside the main sequence
        helps = {name: pool.submit(tfgpt2, *([name, "--help"] if name else ["--help"])) for name in ["", *COMMANDS]}

        tiny = json.dumps({k: v for k, v in TINY.items() if k != "n_vocab"})
        out, _ = tfgpt2("make-checkpoint", "tiny", "--models_dir", "models", "--hparams", tiny)
        assert out.startswith("wrote models/tiny (") and (work / "models" / "tiny" / "model.ckpt.index").is_file()

        store = Storage({f"/models/124M/{name}": data for name, data in fake_model().items()})
        with serving(store):
            out, err = tfgpt2("download", "124M", "--models_dir", "downloads", "--base_url", store.url)
        assert out == "downloads/124M: 124M complete\n" and "Fetching model.ckpt.data-00000-of-00001" in err
        assert_complete(work / "downloads" / "124M",
                        {path.rsplit("/", 1)[1]: data for path, data in store.files.items()})

        out, _ = tfgpt2("generate", "--models_dir", "models", "--model_name", "tiny", "--prompt", "Hello world",
                        "--nsamples", "2", "--batch_size", "2", "--length", "8", "--seed", "1")
        assert re.findall(r"^=+ SAMPLE (\d+) =+$", out, re.M) == ["1", "2"]

        (work / "corpus.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 100)
        _, err = tfgpt2("train", "--dataset", "corpus.txt", "--models_dir", "models", "--model_name", "tiny",
                        "--steps", "2", "--sample_every", "0", "--sample_length", "16", "--run_name", "run1",
                        "--no_xla")
        assert "[2] loss=" in err and (work / "checkpoint" / "run1" / "model-2.index").is_file(), err

        out, err = tfgpt2("export", "--model_dir", "checkpoint/run1", "exports/run1")
        assert out.startswith("wrote exports/run1/1 in ") and (work / "exports/run1/1/saved_model.pb").is_file()
        assert "loading checkpoint/run1" in err

        out, _ = tfgpt2("params", "models/tiny")
        assert re.search(r"^total, tied +[0-9,]+$", out, re.M), out

        for name, future in helps.items():
            out, err = future.result()
            if not name:
                assert all(re.search(rf"^  {command} +\S", out, re.M) for command in COMMANDS), out
                continue
            assert out.startswith(f"usage: tfgpt2 {name} ") and "--quiet" in out, out[:300]
            assert re.search(rf"^ +(\S.* \| )?tfgpt2 {re.escape(name)} \S", out, re.M), out
