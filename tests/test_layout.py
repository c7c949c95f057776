"""The package's shape, read from its source: the import graph has no circle and no import runs
up the floors (`FLOORS` below, bottom to top: hparams and encoder; model; decoding; sample;
formats; train; serve and bulk; testing; cli; then the entry points), `model.py` (the mirror of
OpenAI's `src/model.py`) imports nothing of the machinery added around it, the package never
imports the developer tools in `tools/`, no module configures the process (environment
variables, logging) when it is imported, and no test file imports another (or conftest): what
they share is in conftest's fixtures and `tests/helpers.py`.

The checks are static (`ast` over every `tfgpt2/**/*.py`), so they take milliseconds and see
imports inside functions too, which run only when called; one slow test imports every module in
a fresh process and compares the environment and logging before and after."""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import PACKAGE, ROOT, modules, resolve

# What the mirror may import of tfgpt2; anything else it imports must be third-party.
MODEL_MAY_IMPORT = {"tfgpt2.hparams", "tfgpt2.products", "tfgpt2.gradients", "tfgpt2.inputs", "tfgpt2.adapters",
                    *(f"tfgpt2.adapters.{name}" for name in ("fit", "int8", "layer", "lora", "remat", "tf32", "unwritten"))}
# What importing the mirror may load of tfgpt2, all told.
MODEL_MAY_LOAD = MODEL_MAY_IMPORT | {"tfgpt2.model"}
MACHINERY = ("tfgpt2.decoding", "tfgpt2.train", "tfgpt2.formats", "tfgpt2.cli", "tfgpt2.testing", "tfgpt2.sample")
# The floors, bottom to top: a module imports modules of its own floor and those below only.
# A module beside model.py not named here is model's (its helpers).
FLOORS = (("tfgpt2.hparams", "tfgpt2.encoder"), ("tfgpt2.model",), ("tfgpt2.decoding",), ("tfgpt2.sample",),
          ("tfgpt2.formats",), ("tfgpt2.train",), ("tfgpt2.serve", "tfgpt2.bulk"), ("tfgpt2.testing",),
          ("tfgpt2.cli",))
# Above every floor: the package's face and the `python -m` entry points (each `__main__` too:
# `python -m tfgpt2 <command>`, `python -m tfgpt2.train`), which run a command of cli/.
ENTRY_POINTS = {"tfgpt2", "tfgpt2.generate_unconditional_samples", "tfgpt2.interactive_conditional_samples"}
# What a user runs with `python -m` (the README names each); the package's own children
# (`python -m tfgpt2.cli.main`, the reference's child process) aside.
PYTHON_M = {"tfgpt2", "tfgpt2.generate_unconditional_samples", "tfgpt2.interactive_conditional_samples",
            "tfgpt2.train"}
PYTHON_M_INTERNAL = {"tfgpt2.cli.main", "tfgpt2.testing.reference"}


def import_graph(package=PACKAGE):
    """{module: {(imported module, line)}} over every import statement anywhere in each module
    (at module level, in functions, under `if __name__ == "__main__"`): for tfgpt2 modules,
    the edges between them; other imports kept by their full name."""
    found = modules(package)
    graph = {}
    for name, path in found.items():
        tree = ast.parse(path.read_text(), str(path))
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update((target, node.lineno) for target in resolve(name, path.name == "__init__.py", node, found))
        graph[name] = edges
    return graph


def cycles(graph):
    """Each import circle among the graph's own modules, as a list of modules (the first
    repeated at the end), one per strongly connected component (Tarjan)."""
    inside = {m: sorted({t for t, _ in edges if t in graph and t != m} | ({m} & {t for t, _ in edges}))
              for m, edges in graph.items()}
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in inside[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in inside[v]:
                components.append(set(component))
    for v in sorted(inside):
        if v not in index:
            visit(v)

    def circle(component):  # one path around the component, for the message
        start = min(component)
        path, seen = [start], {start}
        while True:
            nxt = next(w for w in inside[path[-1]] if w in component and (w == start or w not in seen))
            if nxt == start:
                return path + [start]
            if not any(w == start for w in inside[nxt]) and all(w in seen for w in inside[nxt] if w in component):
                return sorted(component)  # no simple path found greedily: name the members
            path.append(nxt)
            seen.add(nxt)
    return [circle(c) for c in components]


def reachable(graph, start):
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m in seen or m not in graph:
            continue
        seen.add(m)
        todo.extend(t for t, _ in graph[m])
    return seen


def within(name, prefixes):
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_graph_sees_the_packages_imports(graph):
    """The reader finds what it must: relative imports at both levels, `from . import x`, and
    imports inside functions."""
    assert "tfgpt2.hparams" in {t for t, _ in graph["tfgpt2.model"]}  # from .hparams import ...
    assert "tfgpt2.decoding.layouts" in {t for t, _ in graph["tfgpt2.decoding.generator"]}  # from . import layouts
    assert "tfgpt2.model" in {t for t, _ in graph["tfgpt2.decoding.cache"]}  # from ..model import ...
    assert "tfgpt2.decoding.batch" in {t for t, _ in graph["tfgpt2.cli.common"]}  # inside a function
    assert "tfgpt2.cli.main" in {t for t, _ in graph["tfgpt2.__main__"]}  # under __main__, absolute
    assert {"tfgpt2", "tfgpt2.model", "tfgpt2.sample", "tfgpt2.decoding.generator", "tfgpt2.cli.main"} <= set(graph)


def test_every_import_of_the_package_names_one_of_its_modules(graph):
    """An import of a tfgpt2 module that does not exist (left behind by a move) fails only when
    its function runs; here it fails at once."""
    missing = [(m, t, line) for m, edges in graph.items() for t, line in edges
               if within(t, ["tfgpt2"]) and t not in graph]
    assert not missing, "imports of modules that do not exist: " + ", ".join(
        f"{m} (line {line}) imports {t}" for m, t, line in sorted(missing))


def module_strings(path):
    """(line, text) of each string in a module's code (not its docstrings) that reads as a
    dotted tfgpt2 module name, as `python -m` or importlib take one."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            and re.fullmatch(r"tfgpt2(\.\w+)+", node.value)]


def test_module_names_in_strings_name_modules_that_exist():
    """`python -m tfgpt2.X` run by the package (the reference's child process, the workers of
    generate_batch) and names handed to importlib: each a module of the package."""
    found = modules()
    missing = [(name, line, text) for name, path in found.items() for line, text in module_strings(path)
               if text not in found]
    assert not missing, missing


def runnable(path):
    """Whether `python -m` runs the module: a `__main__.py`, or an `if __name__ == "__main__":`."""
    if path.name == "__main__.py":
        return True
    return any(isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
               and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
               for node in ast.parse(path.read_text()).body)


def test_the_python_m_names_are_the_readmes():
    """`python -m tfgpt2 <command>`, OpenAI's two sample scripts and the forks' train: no other
    stand-in at the package's root, and the README names each."""
    found = {name.removesuffix(".__main__") for name, path in modules().items() if runnable(path)}
    assert found - PYTHON_M_INTERNAL == PYTHON_M
    readme = (ROOT / "README.md").read_text()
    assert not [name for name in PYTHON_M if f"python -m {name}" not in readme]


# ---- short functions ---------------------------------------------------------------------------

LONGEST = 60  # lines of a function, its def and docstring included


def long_functions(folders):
    """(path:line, name, lines) of each function or method longer than LONGEST under `folders`."""
    found = []
    for path in sorted(p for folder in folders for p in folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST:
                    found.append((f"{os.path.relpath(path, ROOT)}:{node.lineno}", node.name, lines))
    return found


def test_no_function_is_over_60_lines():
    """In the package and the tools: a longer one is split into named steps."""
    found = long_functions([PACKAGE, ROOT / "tools"])
    assert not found, "functions over 60 lines: " + ", ".join(f"{where} {name} ({n})" for where, name, n in found)


def test_the_length_check_counts_a_functions_lines(tmp_path):
    """On a file with a known answer: a 61-line function (a nested one of 61 too), one of 60."""
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    inner = "\n".join(f"        y{i} = {i}" for i in range(60))
    (tmp_path / "m.py").write_text(f"def long():\n{body}\n    return 0\n\n\ndef short():\n{body}\n\n\n"
                                   f"class C:\n    def method(self):\n{inner}\n")
    found = long_functions([tmp_path])
    assert [(name, n) for _, name, n in found] == [("long", 61), ("method", 61)]


# ---- the README's account of the house -------------------------------------------------------

README = (ROOT / "README.md").read_text()


def test_the_readme_is_a_guide_of_at_most_12_kb():
    assert len(README.encode()) <= 12 * 1024, f"README.md is {len(README.encode())} bytes: move detail to docs/"


def test_the_readmes_layout_names_every_part_of_the_house():
    """Each top-level entry that git tracks (README.md and .gitignore aside) and each folder of
    the package, in the README's Layout block."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0 or not listed.stdout:
        pytest.skip("not a git checkout: no list of tracked files")
    top = {path.split("/")[0] for path in listed.stdout.splitlines()} - {"README.md", ".gitignore"}
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")} - {"assets"}
    block = re.search(r"## Layout\n\n```\n(.*?)```", README, re.S).group(1)
    words = set(re.findall(r"[\w.]+", block))
    assert not sorted(name for name in top | folders if name not in words), block


def test_one_tensorflow_version_is_supported_tested_and_stated():
    """requirements.txt (what CI installs) pins the TensorFlow that pyproject.toml asks for, in
    the one minor version that pyproject allows and the README names."""
    from packaging.requirements import Requirement
    import tomllib
    pinned = re.search(r"^tensorflow==([\d.]+)", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    with open(ROOT / "pyproject.toml", "rb") as f:
        dependencies = [Requirement(d) for d in tomllib.load(f)["project"]["dependencies"]]
    [tensorflow] = [d for d in dependencies if d.name == "tensorflow"]
    minor = ".".join(pinned.split(".")[:2])
    assert str(tensorflow.specifier) == f"~={minor}.0" and tensorflow.specifier.contains(pinned)
    assert f"Supported: TensorFlow {minor}" in README and f"`tensorflow=={pinned}`" in README


def test_every_command_has_its_module():
    from tfgpt2.cli.main import COMMANDS, module_name
    assert not [name for name in COMMANDS if module_name(name) not in modules()]


def test_no_import_circle(graph):
    found = cycles(graph)
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_cycle_finder_finds_circles():
    """The finder on graphs with a known answer: a two-module circle through a lazy import (as
    model.py <-> sample.py once was), a longer one, a self-import, and none."""
    def g(**edges):
        return {m.replace("_", "."): {(t, 1) for t in ts} for m, ts in edges.items()}
    assert cycles(g(a_model=["a.hparams", "a.sample"], a_sample=["a.model"], a_hparams=[])) == [
        ["a.model", "a.sample", "a.model"]]
    assert cycles(g(a=["b"], b=["c"], c=["a", "d"], d=[])) == [["a", "b", "c", "a"]]
    assert cycles(g(a=["a"], b=[])) == [["a", "a"]]
    assert cycles(g(a=["b", "numpy"], b=["c"], c=[])) == []


def test_the_graph_would_show_a_circle_added_to_the_package(tmp_path):
    """A copy of the package where decoding/cache.py imports tfgpt2.sample inside a function
    (sample -> decoding.generator -> decoding.cache -> sample): the test above would fail on it."""
    import shutil
    copy = tmp_path / "tfgpt2"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("assets", "__pycache__"))
    cache = copy / "decoding" / "cache.py"
    cache.write_text(cache.read_text() + "\n\ndef _later():\n    from ..sample import generate\n    return generate\n")
    found = cycles(import_graph(copy))
    assert any({"tfgpt2.sample", "tfgpt2.decoding.cache"} <= set(c) for c in found), found


def floor(module):
    """The floor of a tfgpt2 module (an index into FLOORS; entry points above them all)."""
    if module in ENTRY_POINTS or module.endswith(".__main__"):
        return len(FLOORS)
    return next((i for i, names in enumerate(FLOORS) if within(module, names)), 1)


def imports_up(graph):
    """(module, line, imported module) for each import of a module on a floor above the importer's."""
    return sorted((m, line, t) for m, edges in graph.items() for t, line in edges
                  if within(t, ["tfgpt2"]) and floor(t) > floor(m))


def test_no_import_runs_up_the_floors(graph):
    """hparams/encoder, model, decoding, sample, formats, train, serve/bulk, testing, cli: a
    folder never imports one above it (not even inside a function)."""
    found = imports_up(graph)
    assert not found, "imports up the floors:\n" + "\n".join(
        f"{m} (line {line}) imports {t}: {FLOORS[floor(t)][0]} stands above {FLOORS[floor(m)][0]}"
        for m, line, t in found)


def test_the_floor_check_finds_imports_up():
    """On a graph with a known answer: the two imports up that the package once had
    (hparams -> formats.files, train.flags -> cli.args), a helper beside model.py importing
    decoding; not an import down, across one floor, or from an entry point."""
    edges = {"tfgpt2.hparams": ["tfgpt2.formats.files", "tfgpt2.encoder"], "tfgpt2.train.flags": ["tfgpt2.cli.args"],
             "tfgpt2.gradients": ["tfgpt2.model", "tfgpt2.decoding.cache"], "tfgpt2.cli.train": ["tfgpt2.train.config"],
             "tfgpt2.train.__main__": ["tfgpt2.cli.main"],
             "tfgpt2.generate_unconditional_samples": ["tfgpt2.cli.main"],
             "tfgpt2.serve.app": ["tfgpt2.bulk.plan", "tfgpt2.decoding.plan", "numpy"]}
    graph = {m: {(t, i + 1) for i, t in enumerate(ts)} for m, ts in edges.items()}
    assert imports_up(graph) == [("tfgpt2.gradients", 2, "tfgpt2.decoding.cache"),
                                 ("tfgpt2.hparams", 1, "tfgpt2.formats.files"),
                                 ("tfgpt2.train.flags", 1, "tfgpt2.cli.args")]


def test_the_sampler_is_reached_down_the_floors_once(graph):
    """The engine never reaches up to the library's door: nothing in decoding/ imports
    `tfgpt2.sample` (which once handed `choose` down to the loops that it called back), and from
    bulk generation down to the sampler every import path passes through `tfgpt2.sample` at
    most once (the graph has no circle, so each path is simple)."""
    up = [(m, t) for m, edges in graph.items() for t, _ in edges if within(m, ["tfgpt2.decoding"])
          and t == "tfgpt2.sample"]
    assert not up, up
    paths, todo = [], [["tfgpt2.bulk.pool"]]
    while todo:
        path = todo.pop()
        if path[-1] == "tfgpt2.decoding.sampler":
            paths.append(path)
            continue
        todo += [path + [t] for t, _ in graph.get(path[-1], ()) if within(t, ["tfgpt2"]) and t not in path]
    assert paths and all(path.count("tfgpt2.sample") <= 1 for path in paths), paths


def test_model_imports_only_hparams_and_its_helpers(graph):
    """The mirror imports nothing of generation's machinery, training, the formats, the
    commands or the test harness: `tfgpt2.hparams`, its helpers beside it (the precise
    products, the written-out gradients, the LoRA and int8 adapters, the input checks) and
    third-party packages only."""
    ours = {(t, line) for t, line in graph["tfgpt2.model"] if within(t, ["tfgpt2"])}
    assert {t for t, _ in ours} <= MODEL_MAY_IMPORT, sorted(ours)
    relative = [t for t, _ in graph["tfgpt2.model"] if not within(t, ["tfgpt2"]) and t.split(".")[0] in
                {p.stem for p in PACKAGE.iterdir()}]
    assert not relative, relative  # e.g. `import sample` resolved as a top-level module


def test_importing_model_loads_none_of_the_machinery(graph):
    loaded = {m for m in reachable(graph, "tfgpt2.model") if within(m, ["tfgpt2"])}
    assert loaded <= MODEL_MAY_LOAD, sorted(loaded - MODEL_MAY_LOAD)
    assert not [m for m in loaded if within(m, MACHINERY) and m not in MODEL_MAY_LOAD]


def test_atomic_write_helper_is_a_leaf(graph):
    assert not [t for t, _ in graph["tfgpt2.formats.files"] if within(t, ["tfgpt2"])]


def test_the_package_never_imports_the_tools(graph):
    found = [(m, t, line) for m, edges in graph.items() for t, line in edges if within(t, ["tools"])]
    assert not found, found


# ---- the tests' own layout ----------------------------------------------------------------

TESTS = ROOT / "tests"


def imports_of_tests(path):
    """[(line, what)] of the imports in the file at `path` that name a test file, conftest, or
    the helpers module by another name than `tests.helpers` (one module object, not two)."""
    found = []
    for node in ast.walk(ast.parse(Path(path).read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [f".{node.module or ''}"]  # a relative import: tests is no package
        else:
            continue
        found += [(node.lineno, name) for name in names if name.startswith(".") or name == "helpers" or re.fullmatch(
            r"(tests\.)?(test_\w+|conftest)", name)]
    return found


def test_no_test_file_imports_another_or_conftest():
    """What test files share lives in conftest's fixtures and `tests/helpers.py`: a test file
    imported by another runs its tests' module twice, and its fixtures leak into the other."""
    found = {path.name: imports_of_tests(path) for path in sorted(TESTS.glob("*.py"))}
    assert not {name: imports for name, imports in found.items() if imports}


@pytest.mark.parametrize("line", ["from test_train import run", "from tests.test_sample import prompts_for",
                                  "import tests.test_model", "from tests import test_lora", "from conftest import TINY",
                                  "from tests.conftest import ROOT", "from helpers import TINY", "from . import x",
                                  "def f():\n    from tests.test_train import run"])
def test_the_test_import_check_finds_each_style(tmp_path, line):
    """Each way to import a test file, conftest or the helpers under another name, at module
    level or inside a function (its line: the import's)."""
    (tmp_path / "test_x.py").write_text(f"import os\n{line}\nfrom tests.helpers import TINY\n")
    assert [n for n, _ in imports_of_tests(tmp_path / "test_x.py")] == [line.count("\n") + 2]


# ---- nothing configured at import time ---------------------------------------------------

ENVIRON_METHODS = {"setdefault", "update", "pop", "popitem", "clear", "__setitem__", "__delitem__"}
CONFIGURING_CALLS = {"addFilter", "addHandler", "basicConfig", "setLevel", "set_verbosity", "putenv",
                     "unsetenv", "filterwarnings", "simplefilter", "disable", "captureWarnings"}


def is_environ(node):
    """`os.environ` (or a bare `environ`)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def runs_at_import(tree):
    """The statements of a module that run when it is imported: its top level, class bodies and
    the branches of if/try/with/for, but not function bodies, lambdas or
    `if __name__ == "__main__":` blocks."""
    def main_guard(node):
        test = node.test
        return isinstance(node, ast.If) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) \
            and test.left.id == "__name__"

    def nodes(body):
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk_expr(stmt.decorator_list)  # decorators and defaults run at import
                yield from walk_expr(stmt.args.defaults + [d for d in stmt.args.kw_defaults if d])
                continue
            if isinstance(stmt, ast.If) and main_guard(stmt):
                yield from nodes(stmt.orelse)
                continue
            inner = [f for f in ("body", "orelse", "finalbody", "handlers") if isinstance(getattr(stmt, f, None), list)]
            for field, value in ast.iter_fields(stmt):
                if field not in inner:
                    yield from walk_expr(value)
            for field in inner:
                yield from nodes(getattr(stmt, field))
            if isinstance(stmt, ast.ExceptHandler):
                continue
            yield stmt

    def walk_expr(value):  # ast.walk, but not into lambdas
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, ast.AST) and not isinstance(v, ast.Lambda):
                yield v
                for _, child in ast.iter_fields(v):
                    yield from walk_expr(child)
    yield from nodes(tree.body)


def configuring(tree):
    """(line, what) for each change to the process's environment or logging that runs when the
    module is imported."""
    found = []
    for node in runs_at_import(tree):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            if isinstance(t, ast.Subscript) and is_environ(t.value):
                found.append((node.lineno, "os.environ[...] assigned or deleted"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if is_environ(node.func.value) and node.func.attr in ENVIRON_METHODS:
                found.append((node.lineno, f"os.environ.{node.func.attr}"))
            elif node.func.attr in CONFIGURING_CALLS:
                found.append((node.lineno, node.func.attr))
    return sorted(set(found))


def test_no_module_configures_the_process_when_imported():
    """No environment variable, logging filter, handler or level, or warnings filter is set by
    importing any tfgpt2 module; the commands set theirs in functions (`cli.main.quiet`)."""
    found = {name: hits for name, path in modules().items() if (hits := configuring(ast.parse(path.read_text())))}
    assert not found, found


@pytest.mark.parametrize("source, expected", [
    ("import os\nos.environ['TF_CPP_MIN_LOG_LEVEL'] = '2'\n", [(2, "os.environ[...] assigned or deleted")]),
    ("import os\nos.environ.setdefault('A', '1')\n", [(2, "os.environ.setdefault")]),
    ("import logging\nclass F(logging.Filter):\n    pass\nlogging.getLogger('tensorflow').addFilter(F())\n",
     [(4, "addFilter")]),
    ("import os\ntry:\n    import x\nexcept ImportError:\n    os.environ['X'] = '1'\n",
     [(5, "os.environ[...] assigned or deleted")]),
    ("import os\nif True:\n    del os.environ['X']\n", [(3, "os.environ[...] assigned or deleted")]),
    ("import os\ndef f():\n    os.environ['X'] = '1'\n    logging.getLogger().addFilter(None)\n", []),
    ("import os\nif __name__ == '__main__':\n    os.environ['X'] = '1'\n", []),
    ("import os\nflags = os.environ.get('XLA_FLAGS', '')\ng = lambda: os.environ.setdefault('A', '1')\n", []),
])
def test_the_import_time_check_finds_configuration(source, expected):
    assert configuring(ast.parse(source)) == expected


@pytest.mark.slow
def test_importing_every_module_leaves_environment_and_logging_alone():
    """Every tfgpt2 module imported in a fresh process: os.environ, the root and tensorflow
    loggers' filters, handlers and levels, and the warnings filters as they were before (the
    check above, run: it also sees what a module-level call of a function would change)."""
    names = sorted(m for m in modules() if not m.endswith("__main__"))
    code = f"""
import importlib, logging, os, sys, warnings
import tensorflow, keras, numpy
try:
    import apache_beam  # the beam engine's, which sets up logging as it loads (third-party, as above)
except ImportError:
    pass
def state():
    loggers = [logging.getLogger(), logging.getLogger("tensorflow")]
    return (dict(os.environ), [(l.level, list(l.filters), list(l.handlers)) for l in loggers],
            list(warnings.filters))
before = state()
for name in {names!r}:
    importlib.import_module(name)
    if state() != before:
        sys.exit(f"importing {{name}} changed the process's environment, logging or warnings")
print("ok", len({names!r}))
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(ROOT),
                            timeout=300)
    assert result.returncode == 0 and result.stdout.split()[0] == "ok", result.stdout + result.stderr[-3000:]
