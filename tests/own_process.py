"""Test files marked `own_process` run in a pytest process of their own, which ends with them,
where their slow tests run too (their quick tests alone compile a few programs: a quick run
keeps them in the worker, and its time).

TensorFlow keeps every program XLA compiled for the life of the process (10-30 MB each, even
for tiny models; no API lets them go), so a worker that runs files which compile hundreds of
programs grows by gigabytes. A marked file's tests, where a worker reaches the first of them,
run in a child `python -m pytest` on their node ids, in the worker's order; the child's reports
(pytest's own serialisation, as pytest-xdist sends them) are then given as the worker's, test by
test, so that selection, the shuffled order, skips, failures and durations read as usual. A test
the child did not see through (it crashed) fails with the child's exit status and output.

conftest imports the hooks below; the child knows itself by TFGPT2_TEST_REPORTS (where it
writes its reports), and runs its tests as any process does.
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from _pytest.reports import TestReport

REPORTS = "TFGPT2_TEST_REPORTS"
_results = {}  # a marked file -> {node id: [its reports]} from its process


class ReportWriter:
    """In the child: each report as a JSON line of `path`."""

    def __init__(self, config, path):
        self.config, self.path = config, path

    def pytest_runtest_logreport(self, report):
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        with open(self.path, "a") as f:
            f.write(json.dumps(data) + "\n")


def pytest_configure(config):
    config.addinivalue_line("markers", "own_process: the file's tests run in a pytest process of their own "
                                       "(tests/own_process.py)")
    if os.environ.get(REPORTS):
        config.pluginmanager.register(ReportWriter(config, os.environ[REPORTS]))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if os.environ.get(REPORTS) or not item.get_closest_marker("own_process"):
        return None
    if item.path not in _results:
        items = [i for i in item.session.items if i.path == item.path]
        _results[item.path] = run_file(item.config, items) if any(i.get_closest_marker("slow") for i in items) else None
    if _results[item.path] is None:  # its quick tests alone: a few programs, and no process to start
        return None
    reports, failure = _results[item.path]
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    mine = reports.get(item.nodeid, [])
    if not any(report.when == "teardown" for report in mine):  # its process ended before it or in it
        mine = [report for report in mine if report.when == "setup"] + [crashed(item, failure)]
    for report in mine:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def run_file(config, items):
    """({node id: [reports]}, what to say of a test without one) of `items` run in a child."""
    handle, name = tempfile.mkstemp(prefix="tfgpt2-test-reports-", suffix=".jsonl")
    os.close(handle)
    path = Path(name)
    try:
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}  # the options are the ones below
        child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                                *order(config), *(i.nodeid for i in items)], cwd=config.rootpath,
                               env=dict(env, **{REPORTS: str(path)}), capture_output=True, text=True)
        lines = path.read_text().splitlines()
    finally:
        path.unlink(missing_ok=True)
    reports = {}
    for line in lines:
        data = json.loads(line)
        if isinstance(data.get("longrepr"), list):  # a skip's (path, line, reason), a list in JSON
            data["longrepr"] = tuple(data["longrepr"])
        report = config.hook.pytest_report_from_serializable(config=config, data=data)
        reports.setdefault(report.nodeid, []).append(report)
    return reports, f"its process (exit status {child.returncode}) ended before it ran:\n{child.stdout[-3000:]}" \
                    f"\n{child.stderr[-3000:]}"


def order(config):
    """The child's pytest-randomly options: the worker's order kept, and its seed (each test's
    random state), or the plugin off where the worker runs without it."""
    seed = getattr(config.option, "randomly_seed", None)
    if not config.pluginmanager.hasplugin("randomly") or seed is None:
        return ["-p", "no:randomly"]
    return [f"--randomly-seed={seed}", "--randomly-dont-reorganize"]


def crashed(item, failure):
    return TestReport(item.nodeid, item.location, {}, "failed", failure, "call")
