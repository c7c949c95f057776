"""The package as a user gets it: the README's set-up installs it, the README's Python example
runs on what pip installs, and a wheel installs the `tfgpt2` command, with which every command
the README shows runs as written from a folder outside the repository, with none of
TensorFlow's start-up lines."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT, TINY, Storage, free_port, require_reference, serving
from tfgpt2.cli.main import COMMANDS
from tfgpt2.formats.openai_download import FILENAMES
from tfgpt2.hparams import default_hparams, published_hparams
from tfgpt2.testing.checkpoints import make_checkpoint

# What TensorFlow writes to descriptor 2 as it starts, and its C++ log lines in general
TF_STARTUP = re.compile(r"absl::InitializeLog|cudart_stub|cpu_feature_guard|cuInit|oneDNN|"
                        r"^[IWEF]\d{4} \d\d:\d\d:\d\d", re.M)
SUBPACKAGES = ["tfgpt2", "tfgpt2.adapters", "tfgpt2.bulk", "tfgpt2.cli", "tfgpt2.decoding", "tfgpt2.formats",
               "tfgpt2.kernels", "tfgpt2.serve", "tfgpt2.testing", "tfgpt2.train"]

README = (ROOT / "README.md").read_text()


def example():
    """The Python block under "## Using it"."""
    section = README.split("\n## Using it\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def readme_commands():
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
    assert {re.search(r"tfgpt2 ([a-z-]+)", c).group(1) for c in readme_commands()} == set(COMMANDS)


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
    # CI adds --no-build-isolation (the setuptools just installed builds the package): the same packages
    assert installs[-2:] == [".venv/bin/pip install -q -r requirements.txt",
                             ".venv/bin/pip install -q --no-build-isolation -e ."], ci


def copy_source(source):
    """What the package is built from (pyproject.toml's packages and module), without caches."""
    shutil.copytree(ROOT / "tfgpt2", source / "tfgpt2", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "tfgpt2_cli.py"):
        shutil.copy(ROOT / name, source)


def test_every_subpackage_is_packaged():
    """pyproject.toml lists each folder of tfgpt2 with an __init__.py (a new one must be added),
    and the assets folder, which holds the shipped vocabulary as its data; the kernels' source
    ships as data too (built at first use)."""
    folders = sorted(".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "tfgpt2").rglob("__init__.py"))
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)
    setup = project["tool"]["setuptools"]
    assert sorted(setup["packages"]) == sorted([*folders, "tfgpt2.assets"]) and folders == SUBPACKAGES
    assert setup["package-data"] == {"tfgpt2.assets": ["encoder.json", "vocab.bpe"], "tfgpt2.kernels": ["rows.cc"]}
    assert setup["py-modules"] == ["tfgpt2_cli"] and project["project"]["scripts"] == {"tfgpt2": "tfgpt2_cli:main"}


@pytest.fixture
def storage(tmp_path):
    """A random checkpoint of the tiny shape, served as OpenAI's storage serves 124M."""
    folder = make_checkpoint(str(tmp_path / "served"), default_hparams().override_from_dict(TINY), std=0.1, seed=3)
    files = {name: b"a graph OpenAI's code does not need" if name == "model.ckpt.meta"
             else (Path(folder) / name).read_bytes() for name in FILENAMES}
    with serving(Storage({f"/models/124M/{name}": data for name, data in files.items()})) as store:
        yield store


def build_wheel(tmp_path):
    """The wheel `pip wheel` builds from the package's files, checked for what it must hold."""
    source, wheels = tmp_path / "source", tmp_path / "wheels"
    copy_source(source)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "--no-index", "-w", str(wheels), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    [wheel] = wheels.glob("tfgpt2-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert {"tfgpt2_cli.py", "tfgpt2/assets/encoder.json", "tfgpt2/assets/vocab.bpe", "tfgpt2/cli/main.py",
            "tfgpt2/kernels/rows.cc"} <= names
    assert {f"{package.replace('.', '/')}/__init__.py" for package in SUBPACKAGES} <= names
    assert not [n for n in names if n.startswith(("tests/", "tools/"))]
    assert re.search(r"^tfgpt2 = tfgpt2_cli:main$", entry_points, re.M), entry_points
    return wheel


def install(wheel, venv):
    """A fresh venv with the wheel installed; TensorFlow and the other dependencies are seen
    through a .pth file naming this interpreter's site-packages folders, as nothing can be
    downloaded."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                                "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                          *(path for path in sys.path if path.endswith("-packages"))])
    (Path(site) / "zz_dependencies.pth").write_text("".join(f"{path}\n" for path in ours))
    return python, site


# The README's commands with what each must print (stdout, else stderr), by the command's start
EXPECTED = {"tfgpt2 download ": r"^models/124M: 124M complete$",
            "tfgpt2 make-checkpoint ": r"^wrote models/124M \(",
            "tfgpt2 generate ": r"^=+ SAMPLE 1 =+$",
            "tfgpt2 train ": r"^\[\d+\] loss=|^checkpoint/run1 has made its --steps 200 updates already",
            "tfgpt2 export ": r"^wrote exports/\S+/1 in ",
            "tfgpt2 params ": r"^total, tied +[0-9,]+$",
            "tfgpt2 serve ": r'^\{"object":"list","data":\[\{"id":"124M"'}


# Runs a plan in one process of the wheel's venv: each step either Python code (run as a script
# is) or a `tfgpt2` command line as the console script runs it (`tfgpt2_cli.main` on its argv, the
# text an `echo ... |` before it gives as stdin), each in its folder, with descriptors 1 and 2
# caught in files: one TensorFlow start-up for them all.
IN_ONE_PROCESS = """
import json, os, re, shlex, signal, sys, tempfile, threading, time, urllib.request, tfgpt2_cli

def list_models_then_drain(port):  # `tfgpt2 serve`: once it answers, ended as SIGTERM ends it
    for _ in range(1200):
        try:
            print(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models").read().decode(), flush=True)
            break
        except OSError:
            time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGTERM)

results = []
for kind, step, cwd in json.load(open(sys.argv[1])):
    os.chdir(cwd)
    port = re.search("^tfgpt2 serve .*--port ([0-9]+)", step)  # the server itself, not its --help
    if port:
        threading.Thread(target=list_models_then_drain, args=(port.group(1),), daemon=True).start()
    text = None
    if step.startswith("echo "):
        echoed, step = step.split(" | ", 1)
        text = " ".join(shlex.split(echoed)[1:]) + "\\n"
    stdin, saved_stdin = tempfile.TemporaryFile("w+"), sys.stdin
    stdin.write(text or "")
    stdin.seek(0)
    sys.stdin = stdin
    files, saved = [tempfile.TemporaryFile("w+") for _ in range(2)], [os.dup(1), os.dup(2)]
    sys.stdout.flush(), sys.stderr.flush()
    for fd, f in zip((1, 2), files):
        os.dup2(f.fileno(), fd)
    try:
        if kind == "python":
            exec(compile(step, "<example>", "exec"), {"__name__": "__main__"})
            code = 0
        else:
            sys.argv = shlex.split(step)
            code = tfgpt2_cli.main()
    except SystemExit as e:
        code = e.code
    except BaseException:
        import traceback
        traceback.print_exc()
        code = "Traceback"
    sys.stdout.flush(), sys.stderr.flush()
    for fd, copy in zip((1, 2), saved):
        os.dup2(copy, fd)
        os.close(copy)
    sys.stdin = saved_stdin
    out, err = [(f.seek(0), f.read())[1] for f in files]
    results.append(dict(step=step, code=code or 0, stdout=out, stderr=err))
print(json.dumps(results))
"""


@pytest.mark.slow
def test_the_wheel_runs_the_readme_outside_the_repository(storage, tmp_path):
    """`pip wheel`, installed into a fresh venv; then, in a folder of its own, every `tfgpt2`
    command the README shows, as written and in its order, each on what the earlier ones wrote:
    the first (the download, from a local stand-in for OpenAI's storage, only `--base_url`
    added) with the wheel's `tfgpt2` from a shell; then in one process (IN_ONE_PROCESS: the
    commands share no state) every command's --help, the README's Python example (verbatim, on
    the downloaded tiny "124M", its results checked against its comments) and the other
    commands, through the console script's function. Each command must succeed with none of
    TensorFlow's start-up or log lines on stderr."""
    python, site = install(build_wheel(tmp_path), tmp_path / "venv")
    work, side = tmp_path / "work", tmp_path / "offline"  # make-checkpoint's 124M does not replace the download
    work.mkdir()
    side.mkdir()
    where = subprocess.run([str(python), "-c", "import importlib.util as u; "
                            "print(u.find_spec('tfgpt2').origin); print(u.find_spec('tfgpt2_cli').origin)"],
                           cwd=work, capture_output=True, text=True, check=True).stdout.split()
    assert all(path.startswith(site) for path in where), where  # the wheel's copy, not the checkout
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL")}
    env.update(PATH=f"{python.parent}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(python.parent.parent))
    assert (python.parent / "tfgpt2").is_file()

    def succeeded(step, code, stdout, stderr):
        assert code == 0, f"{step}: {stderr[-3000:]}"
        assert not TF_STARTUP.search(stderr), f"{step}: {stderr[-3000:]}"
        assert "Traceback" not in stderr, f"{step}: {stderr[-3000:]}"
        if not step.endswith(" --help"):
            for start, pattern in EXPECTED.items():
                if step.startswith(start):
                    assert re.search(pattern, stdout + stderr, re.M), f"{step}: {stdout[-2000:]}"
        return stdout

    reference = str(require_reference())
    (work / "corpus.txt").write_text("It was the best of times, it was the worst of times. " * 40)
    (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Hello", "Once upon a"]))
    first, *rest = readme_commands()
    assert first.startswith("tfgpt2 download ")
    first += f" --base_url {storage.url}"
    result = subprocess.run(first, shell=True, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    succeeded(first, result.returncode, result.stdout, result.stderr)

    helps = ["tfgpt2 --help", *(f"tfgpt2 {name} --help" for name in COMMANDS)]
    code = example()
    check = ('\nimport json\nprint(json.dumps({"file": tfgpt2.__file__, "tokens": tokens, '
             '"logits": list(out["logits"].shape), "present": list(out["present"].shape), '
             '"rows": [len(row) for row in rows]}))\n')
    plan = [("command", command, str(work)) for command in helps] + [("python", code + check, str(work))]
    port = free_port()
    plan += [("command", command.replace("--reference_src gpt-2/src", f"--reference_src {shlex.quote(reference)}")
              .replace("--port 8000", f"--port {port}"),
              str(side if command.startswith("tfgpt2 make-checkpoint ") else work)) for command in rest]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    result = subprocess.run([str(python), "-c", IN_ONE_PROCESS, str(tmp_path / "plan.json")], cwd=work, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    ran = json.loads(result.stdout.splitlines()[-1])
    assert [r["step"] for r in ran] == [step.split(" | ", 1)[-1] for _, step, _ in plan]
    pages, (example_run,), commands = ran[:len(helps)], ran[len(helps):len(helps) + 1], ran[len(helps) + 1:]

    pages = [succeeded(**r) for r in pages]
    assert all(re.search(rf"^  {command} +\S", pages[0], re.M) for command in COMMANDS), pages[0]
    for name, out in zip(COMMANDS, pages[1:]):
        assert out.startswith(f"usage: tfgpt2 {name} ") and "--quiet" in out, out[:300]
        assert re.search(rf"^ +(\S.* \| )?tfgpt2 {re.escape(name)} \S", out, re.M), out

    assert example_run["code"] == 0, example_run["stderr"][-3000:]
    got = json.loads(example_run["stdout"].splitlines()[-1])
    assert got["file"].startswith(site), got["file"]  # the installed copy, not the checkout
    assert got["tokens"] == comment(code, "enc.encode(")
    assert got["rows"] == [len(got["tokens"]) + 40]

    def shapes(hp):  # [logits, present] for the example's 4-token prompt
        return [[1, 4, hp.n_vocab], [1, hp.n_layer, 2, hp.n_head, 4, hp.n_embd // hp.n_head]]
    assert [got["logits"], got["present"]] == shapes(default_hparams().override_from_dict(TINY))
    assert [comment(code, 'out["logits"].shape'), comment(code, 'out["present"].shape')] == \
        shapes(published_hparams("124M"))

    for r in commands:
        succeeded(**r)
    assert json.loads((work / "models" / "124M" / "hparams.json").read_text())["n_layer"] == TINY["n_layer"]
    assert json.loads((side / "models" / "124M" / "hparams.json").read_text())["n_layer"] == 12
    assert (work / "checkpoint" / "run1" / "model-200.index").is_file()
    assert (work / "exports" / "run1" / "1" / "saved_model.pb").is_file()
    assert (work / "exports" / "gpt2-hf" / "model.safetensors").is_file()
    assert len((work / "out.jsonl").read_text().splitlines()) == 2
