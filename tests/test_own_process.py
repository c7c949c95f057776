"""tests/own_process.py: a marked file's tests run in a process of their own, and read as usual."""
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

CONFTEST = "from tests.own_process import pytest_configure, pytest_runtest_protocol  # noqa: F401\n"
MARKED = '''import os, pytest
pytestmark = pytest.mark.own_process

@pytest.mark.slow  # a marked file runs apart where its slow tests run
def test_passes():
    open("marked.pid", "w").write(str(os.getpid()))

@pytest.mark.parametrize("n", [1, 2])
def test_fails_once(n):
    assert n == 1, "two is not one"

def test_skips():
    open("skips.pid", "w").write(str(os.getpid()))
    pytest.skip("said why")
'''
PLAIN = '''import os

def test_here():
    open("plain.pid", "w").write(str(os.getpid()))
'''


def pytest_in(folder, *args):
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:randomly", "-p", "no:cacheprovider",
                           "-o", "addopts=", *args], cwd=folder, capture_output=True, text=True, timeout=120,
                          env=dict({k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}, PYTHONPATH=str(ROOT)))


@pytest.mark.slow
def test_a_marked_file_runs_in_a_child_and_reports_each_test(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_marked.py").write_text(MARKED)
    (tmp_path / "test_plain.py").write_text(PLAIN)
    run = pytest_in(tmp_path)
    assert run.returncode == 1, run.stdout
    assert "1 failed, 3 passed, 1 skipped" in run.stdout, run.stdout
    assert "FAILED test_marked.py::test_fails_once[2] - AssertionError: two is not one" in run.stdout, run.stdout
    assert "said why" in run.stdout, run.stdout
    pid = {name: (tmp_path / f"{name}.pid").read_text() for name in ("marked", "skips", "plain")}
    assert pid["marked"] == pid["skips"] != pid["plain"]
    selected = pytest_in(tmp_path, "-k", "passes or fails_once and 1")  # selection reaches the child
    assert selected.returncode == 0 and "2 passed, 3 deselected" in selected.stdout, selected.stdout
    quick = pytest_in(tmp_path, "-m", "not slow", "-k", "not fails_once")  # no slow test: no process of its own
    assert quick.returncode == 0 and "1 passed, 1 skipped, 3 deselected" in quick.stdout, quick.stdout
    assert (tmp_path / "skips.pid").read_text() == (tmp_path / "plain.pid").read_text()


def test_a_test_its_process_never_reported_fails_saying_so(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_marked.py").write_text(MARKED.replace("assert n == 1,", "os._exit(3) if n == 2 else None\n    assert n == 1,"))
    run = pytest_in(tmp_path)
    assert "its process (exit status 3) ended before it ran" in run.stdout, run.stdout
    assert "2 failed, 2 passed" in run.stdout, run.stdout
