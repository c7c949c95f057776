"""tools/report.py, tools/collect.py, and the tools' reports: each tool runs on a tiny
model and writes a JSON report and a Markdown section that shows the same figures. Nothing here
depends on how fast this machine is."""
import argparse
import json
import os
import re
import subprocess

import pytest

from tools import collect, report
from tests.helpers import REPORT_KEYS, ROOT, SHARED, assert_report, rows, run_tool

pytestmark = pytest.mark.own_process  # its programs compiled in a process of its own (tests/own_process.py)


def run_main(tool, *flags):
    """The tool's main() on FLAGS in this process (a tool that runs in one process): its status."""
    import importlib
    return importlib.import_module(f"tools.{tool}").main(list(flags))


# ---- report.py ----------------------------------------------------------------------------

def test_spread_and_cells():
    s = report.spread([3, 1, 2, 10])
    assert s == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}
    assert report.cell(s, ".1f") == "2.5 (1.0-10.0)"
    assert report.cell(report.spread([2.0]), ".2f") == "2.00"  # one measurement: no range
    assert report.cell(None, ".1f") == "n/a" and report.cell(True) == "yes" and report.cell("a|b") == "a\\|b"
    assert report.cell(1234567.0, ",.0f") == "1,234,567"
    with pytest.raises(ValueError):
        report.spread([])


def test_written_report_renders_its_json(tmp_path):
    columns = [report.column("what", "what"), report.column("rate", "tokens/s", ".1f")]
    data = report.build("fake", "Fake speed", [report.table(columns, [{"what": "x", "rate": report.spread([1, 2, 4])},
                                                                     {"what": "y|z", "rate": None}])],
                        tool=os.path.join(ROOT, "tools", "fake.py"), argv=["--runs", "3", "--note", "a b"],
                        notes=["Random weights."], settings={"runs": 3})
    json_path, md_path = report.write(data, str(tmp_path / "out"), echo=False)
    assert json_path.endswith("fake.json") and md_path.endswith("fake.md")
    got = assert_report(str(tmp_path / "out"), "fake", "fake.py")
    assert got["command"] == "python tools/fake.py --runs 3 --note 'a b'"
    text = (tmp_path / "out" / "fake.md").read_text()
    assert "| x | 2.0 (1.0-4.0) |" in text and "| y\\|z | n/a |" in text and "Random weights." in text
    assert "|---|---:|" in text  # numbers right-aligned


def test_commit_is_unknown_outside_git(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "ROOT", str(tmp_path))
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert report.commit() == ("unknown", None)


def test_commit_here_is_head():
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode:
        pytest.skip("not a git checkout")
    assert report.commit()[0] == head.stdout.strip()


# ---- collect.py ---------------------------------------------------------------------------

def fake_report(folder, name, figure, headline=True):
    columns = [report.column("what", "what"), report.column("ms", "ms", ".1f")]
    data = report.build(name, f"Report {name}", [report.table(columns, [{"what": "a", "ms": figure}])],
                        tool=os.path.join(ROOT, "tools", f"{name}.py"), argv=[],
                        headlines=[{"what": f"{name} a", "figure": f"{figure:.1f} ms"}] if headline else [])
    report.write(data, str(folder), echo=False)


def test_collect_pastes_the_sections_in_order(tmp_path):
    reports, docs = tmp_path / "reports", tmp_path / "docs"
    docs.mkdir()
    for name, figure in (("zeta", 1.0), ("tokenizer", 2.0), ("generation", 3.0), ("train-bf16", 4.0)):
        fake_report(reports, name, figure, headline=name != "zeta")
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{collect.START}\nold\n{collect.END}\n\nafter\n")
    assert collect.main(["--reports", str(reports), "--output", str(docs / "benchmarks.md"),
                         "--readme", str(readme)]) == 0
    page = (docs / "benchmarks.md").read_text()
    assert page.startswith(collect.HEADER)
    assert "python tools/collect.py" in collect.HEADER
    titles = re.findall(r"^## Report (\S+)$", page, re.M)
    assert titles == ["generation", "train-bf16", "tokenizer", "zeta"]
    for name in titles:
        assert (reports / f"{name}.md").read_text().rstrip("\n") in page
        assert f"](../reports/{name}.json)" in page
    text = readme.read_text()
    assert "old" not in text and text.endswith(f"{collect.END}\n\nafter\n")
    assert "| generation a | 3.0 ms | [generation](reports/generation.json) |" in text
    assert "zeta" not in text


def test_collect_without_reports_says_so(tmp_path, capsys):
    assert collect.main(["--reports", str(tmp_path), "--output", str(tmp_path / "b.md")]) == 1
    assert "no reports" in capsys.readouterr().err


def test_docs_page_is_the_committed_reports():
    """docs/benchmarks.md is exactly what collect.py makes of tools/reports/, and each
    report's Markdown is its JSON's rendering."""
    folder = os.path.join(ROOT, "tools", "reports")
    docs = os.path.join(ROOT, "docs", "benchmarks.md")
    if not os.path.isdir(folder):
        pytest.skip("no committed reports")
    for name, data, text in collect.reports(folder):
        assert text == report.markdown(data), name
        assert set(data) == REPORT_KEYS, name
    with open(docs) as f:
        assert f.read() == collect.page(folder, docs), "run python tools/collect.py"


# ---- the tools on a tiny model ------------------------------------------------------------

@pytest.mark.slow
def test_generation_report_against_the_reference(tiny_dir, tmp_path):
    from tests.helpers import require_reference
    require_reference()
    done = run_tool("benchmark.py", "--model_dir", tiny_dir, "--batch", "1", "2", "--candidates", "tfgpt2-xla",
                    "reference", "--runs", "2", "--short", "4", "--long", "12", "--prompt_len", "8",
                    "--report", str(tmp_path), "--note", "Tiny weights.")
    assert done.returncode == 0, done.stderr[-3000:]
    data = assert_report(str(tmp_path), "generation", "benchmark.py")
    by = {(r["implementation"], r["batch"]): r for r in rows(data)}
    assert set(by) == {("tfgpt2-xla", 1), ("reference", 1), ("tfgpt2-xla", 2), ("reference", 2)}
    assert "fails at batch > 1" in by["reference", 2]["error"]
    ours, theirs = by["tfgpt2-xla", 1], by["reference", 1]
    assert ours["vs_reference"] == pytest.approx(ours["step_ms"]["median"] / theirs["step_ms"]["median"])
    assert theirs["loaded_rss_mb"] is None
    for row in by["tfgpt2-xla", 1], by["tfgpt2-xla", 2]:
        assert "error" not in row
        assert row["step_ms"]["n"] == row["tokens_per_s"]["n"] == row["prefill_tokens_per_s"]["n"] == 2
        assert row["peak_rss_mb"] >= row["loaded_rss_mb"] > 0
    assert "Tiny weights." in data["notes"] and data["settings"]["runs"] == 2
    assert data["headlines"][0]["what"] == "generation, batch 1, tfgpt2-xla"
    assert data["headlines"][0]["figure"].endswith("x the reference's time")


def test_generation_headlines_are_ratios_within_the_run():
    """tfgpt2-xla against the reference, every control on against tfgpt2-xla, per batch size."""
    from tools.benchmark import headlines

    def row(name, batch, ms):
        return {"implementation": name, "batch": batch, "step_ms": report.spread([ms])}
    rows_ = [row("tfgpt2-xla", 1, 50.0), row("tfgpt2-xla-controls", 1, 55.0), row("reference", 1, 100.0),
             row("tfgpt2", 1, 80.0), {"implementation": "reference", "batch": 8, "error": "fails"}]
    rows_[0]["vs_reference"] = 0.5
    assert headlines(rows_) == [
        {"what": "generation, batch 1, tfgpt2-xla", "figure": "50.0 ms/token, 0.50x the reference's time"},
        {"what": "generation, batch 1, tfgpt2-xla, every generation control on",
         "figure": "55.0 ms/token, 1.10x tfgpt2-xla's time"},
        {"what": "generation, batch 1, reference", "figure": "100.0 ms/token"}]


def test_generation_rows_and_headlines_against_llama_cpp():
    """Each row's decode and prefill tokens/s as ratios of llama.cpp's at its batch size, and
    tfgpt2-xla's beside llama.cpp's as a headline; llama.cpp at batch 8 is an error row."""
    from tools.benchmark import headlines, rows_of

    def figures(tokens_per_s, prefill):
        return dict(step_ms=[1e3 / tokens_per_s], tokens_per_s=[tokens_per_s], prefill_tokens_per_s=[prefill],
                    compile_s=None, peak_rss_mb=1.0, decode_peak_rss_mb=None, long_peak_rss_mb=None,
                    loaded_rss_mb=None)
    rows_ = rows_of({("tfgpt2-xla", 1): figures(60.0, 900.0), ("llama.cpp", 1): figures(100.0, 600.0),
                     ("tfgpt2-xla", 8): figures(300.0, 1000.0), ("llama.cpp", 8): {"error": "batch 1 only here"}})
    ours, peer = rows_[0], rows_[1]
    assert (ours["vs_llama_cpp"], ours["prefill_vs_llama_cpp"]) == (pytest.approx(0.6), pytest.approx(1.5))
    assert peer["vs_llama_cpp"] == 1 and "vs_llama_cpp" not in rows_[2]
    assert headlines(rows_, "int8", "q8_0") == [
        {"what": "generation, batch 8, tfgpt2-xla", "figure": "3.3 ms/token"},  # no peer at batch 8
        {"what": "decode and prefill, batch 1, tfgpt2-xla int8 against llama.cpp Q8_0",
         "figure": "60.0 against 100.0 tokens/s (0.60x); prefill 900 against 600 (1.50x)"}]


def test_generation_rounds_take_turns_and_pool_their_runs(monkeypatch):
    """With --rounds each candidate's process runs once a round, the candidates taking turns;
    a candidate's runs of every round are pooled, its peaks the largest, a failed round's error kept."""
    from tools import benchmark
    calls = []

    def measure(candidate, batch, args):
        calls.append(candidate)
        n = float(len(calls))
        if candidate == "tfgpt2" and n > 4:
            return {"error": "out of memory"}
        return dict(step_ms=[n], tokens_per_s=[1e3 / n], prefill_tokens_per_s=[10 * n], compile_s=n,
                    peak_rss_mb=100 - n, decode_peak_rss_mb=n, long_peak_rss_mb=n, loaded_rss_mb=n)
    monkeypatch.setattr(benchmark, "measure", measure)
    monkeypatch.setattr(benchmark, "available", lambda candidate, args: True)
    args = argparse.Namespace(rounds=3, batch=[1], candidates=["tfgpt2-xla", "llama.cpp", "tfgpt2"])
    results, skipped = benchmark.measure_all(args)
    assert calls == ["tfgpt2-xla", "llama.cpp", "tfgpt2"] * 3 and not skipped
    ours = results["tfgpt2-xla", 1]
    assert ours["step_ms"] == [1, 4, 7] and ours["tokens_per_s"] == [1e3, 250, 1e3 / 7]
    assert ours["prefill_tokens_per_s"] == [10, 40, 70] and ours["peak_rss_mb"] == 99
    assert ours["decode_peak_rss_mb"] == ours["long_peak_rss_mb"] == 7 and ours["compile_s"] == ours["loaded_rss_mb"] == 1
    assert results["llama.cpp", 1]["step_ms"] == [2, 5, 8]
    assert results["tfgpt2", 1] == {"error": "out of memory"}
    row = next(r for r in benchmark.rows_of(results) if r["implementation"] == "tfgpt2-xla")
    assert row["step_ms"]["n"] == 3 and row["step_ms"]["median"] == 4


@pytest.mark.slow
def test_generation_report_beside_llama_cpp(tiny_dir, tmp_path):
    """llama.cpp on the GGUF file of the same weights, by its own llama-bench where
    TFGPT2_LLAMA_CPP names its programs' folder, else by llama-cpp-python; skipped where neither."""
    import importlib.util
    programs = os.environ.get("TFGPT2_LLAMA_CPP")
    if not programs and importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama.cpp is not at hand (TFGPT2_LLAMA_CPP=<its programs' folder>, or pip install "
                    "llama-cpp-python)")
    done = run_tool("benchmark.py", "--model_dir", tiny_dir, "--batch", "1", "2", "--candidates", "tfgpt2-xla",
                    "llama.cpp", "--runs", "2", "--short", "4", "--long", "12", "--prompt_len", "8", "--dtype",
                    "bfloat16", "--report", str(tmp_path), *(["--llama_cpp", programs] if programs else []))
    assert done.returncode == 0, done.stderr[-3000:]
    data = assert_report(str(tmp_path), "generation", "benchmark.py")
    by = {(r["implementation"], r["batch"]): r for r in rows(data)}
    assert by["llama.cpp", 2]["error"] == "batch 1 only here"
    ours, peer = by["tfgpt2-xla", 1], by["llama.cpp", 1]
    assert peer["tokens_per_s"]["n"] == peer["prefill_tokens_per_s"]["n"] == 2
    assert ours["vs_llama_cpp"] == pytest.approx(ours["tokens_per_s"]["median"] / peer["tokens_per_s"]["median"])
    assert "f16 weights" in " ".join(data["notes"])  # bfloat16's peer weights
    assert [h["what"] for h in data["headlines"]] == [
        "generation, batch 2, tfgpt2-xla", "decode and prefill, batch 1, tfgpt2-xla bfloat16 against llama.cpp F16"]
    quality = data["tables"][1]
    assert quality["title"] == "bfloat16 against float32" and 0 <= quality["rows"][0]["agreement"] <= 1
    assert data["headlines"][1]["figure"].endswith(f"; greedy agreement with float32 "
                                                   f"{quality['rows'][0]['agreement']:.3f}, loss ratio "
                                                   f"{quality['rows'][0]['ratio']:.4f}")


def test_tokenizer_report(tmp_path):
    assert run_main("benchmark_tokenizer", "--mb", "0.02", "--runs", "2", "--report", str(tmp_path),
                    "--name", "tok") in (None, 0)
    data = assert_report(str(tmp_path), "tok", "benchmark_tokenizer.py")
    assert [r["operation"] for r in rows(data)] == ["encode (one text)", "encode_batch (lines)", "decode"]
    reference = (SHARED / "openai-gpt-2" / "src" / "encoder.py").is_file()
    assert data["settings"]["reference"] is reference
    for row in rows(data):
        assert row["tfgpt2"]["n"] == 2 and row["tokens"] > 0
        if reference:
            assert row["speedup"] == pytest.approx(row["tfgpt2"]["median"] / row["reference"]["median"])
    if reference:
        assert data["settings"]["identical_ids"] is True


@pytest.mark.slow
def test_gpu_check_without_a_gpu_says_so(tmp_path):
    done = run_tool("gpu_check.py", "--report", str(tmp_path), env={"CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "nothing checked" in done.stderr.lower()
    assert not os.listdir(tmp_path)


def test_gpu_check_script_without_nvidia_smi_says_so(tmp_path):
    """The shell script stops before Python where there is no nvidia-smi on PATH."""
    if any(os.path.exists(f"{d}/nvidia-smi") for d in ("/usr/bin", "/bin")):
        pytest.skip("nvidia-smi is in /usr/bin here")
    done = subprocess.run(["bash", "tools/gpu_check.sh", "--report", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PATH="/usr/bin:/bin", PYTHON="/nonexistent/python"))
    assert done.returncode == 0 and "no NVIDIA GPU visible" in done.stderr, done.stderr
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_gpu_check_dry_run_on_the_cpu(tiny_dir, tmp_path):
    """--cpu-only: every TensorFlow stage of the GPU check, in this process, with the CPU as the device."""
    # lengths 14 apart in one bucket (34 and 48 positions), the median of 15 runs (of ~10 ms each): a
    # per-token time of ~0.1 ms from their difference that a busy host's noise of a few milliseconds in a
    # run does not turn negative (with 3 runs, while another test worker ran, it did one time in eight)
    assert run_main("gpu_check", "--cpu-only", "--model_dir", tiny_dir, "--batch", "1", "--short", "33", "--long",
                    "47", "--runs", "15", "--greedy", "6", "--train_batch", "1", "--train_length", "8", "--steps", "1",
                    "--no_hf", "--report", str(tmp_path)) == 0
    data = assert_report(str(tmp_path), "cpu-dry-run", "gpu_check.py")
    checks, variants, decode, train = (rows(data, i) for i in range(4))
    assert all(c["ok"] is not False for c in checks) and data["settings"]["checks_passed"] is True
    assert checks[0]["value"] <= 5e-4 and checks[1]["value"] <= 5e-4 and checks[-1]["ok"] is True
    assert [v["variant"] for v in variants] == ["default"] and variants[0]["ms_per_token"]["median"] > 0
    assert [(r["dtype"], r["batch"]) for r in decode] == [("float32", 1), ("bfloat16", 1)]
    assert all(r["ms_per_token"]["median"] > 0 for r in decode)
    assert [r["precision"] for r in train] == ["float32", "mixed_bfloat16"]
    assert all(r["tokens_per_s"]["median"] > 0 for r in train)
    assert data["headlines"] == [] and "Dry run" in data["notes"][0]


@pytest.mark.slow
def test_export_report(tiny_dir, tmp_path):
    assert run_main("benchmark_export", "--model_dir", tiny_dir, "--batch", "1", "--runs", "2", "--short", "4",
                    "--long", "12", "--report", str(tmp_path)) in (None, 0)
    data = assert_report(str(tmp_path), "export", "benchmark_export.py")
    [sizes], paths = rows(data, 0), rows(data, 1)
    assert sizes["saved_model_mb"] >= sizes["variables_mb"] > 0 and sizes["export_s"] > 0
    assert [(r["batch"], r["path"]) for r in paths] == [(1, "in-process XLA"), (1, "SavedModel")]
    assert paths[0]["vs_in_process"] == 1
    assert paths[1]["vs_in_process"] == pytest.approx(paths[1]["ms_per_token"]["median"]
                                                      / paths[0]["ms_per_token"]["median"])


@pytest.mark.slow  # five TensorFlow processes
def test_memory_report(tiny_dir, tmp_path):
    """The figures the tests leave to a report: each measured in fresh processes, each ratio
    that of its own figures (with one run, exactly)."""
    from tests.helpers import TINY
    assert run_main("benchmark_memory", "--model_dir", tiny_dir, "--hparams", json.dumps(TINY), "--runs", "1",
                    "--report", str(tmp_path)) == 0
    data = assert_report(str(tmp_path), "memory", "benchmark_memory.py")
    table = rows(data)
    assert [(r["measure"], r["setting"]) for r in table] == [
        ("load_model", "float32"), ("load_model", "bfloat16"), ("Adam step without XLA", "1 micro-batch"),
        ("Adam step without XLA", "2 micro-batches"), ("XLA's bytes for an Adam step", "without remat"),
        ("XLA's bytes for an Adam step", "remat")]
    assert all(r["mb"]["n"] == 1 and r["mb"]["median"] > 0 for r in table)
    assert table[5]["relative"]["median"] == pytest.approx(table[5]["mb"]["median"] / table[4]["mb"]["median"])
    assert data["settings"]["remat_hparams"] == TINY and data["settings"]["model_dir"] == tiny_dir


def test_beam_report_rows_are_rates_and_ratios_of_the_runs():
    """benchmark_beam's table from given run times (its runs are whole commands, timed in
    tools/reports/beam.json): rows/s per run, and the medians' ratio to the local engine's."""
    from tools import benchmark_beam
    local, beam = benchmark_beam.ENGINES
    (table,) = benchmark_beam.tables({local: [10.0, 20.0, 40.0], beam: [40.0, 80.0, 20.0]}, prompts=80)
    by_engine = {row["engine"]: row for row in table["rows"]}
    assert by_engine[local]["rows_per_s"] == report.spread([8.0, 4.0, 2.0])
    assert by_engine[beam]["seconds"] == report.spread([40.0, 80.0, 20.0])
    assert by_engine[local]["vs_local"] == 1 and by_engine[beam]["vs_local"] == pytest.approx(2.0 / 4.0)


def test_serve_benchmark_workload_warm_up_and_ratios():
    """benchmark_serve: the requests keep to their ranges and repeat for a seed, and another
    draw's have the same lengths but prompts of their own; the warm-up has
    a prompt of every chunk size (multiples of 8) and the longest requests, groups of every
    step width whose requests all run to the end, and a pair whose first ends first; the headline is the ratio of the medians in the run."""
    from tools import benchmark_serve as bench
    requests = bench.workload(50, (8, 64), (16, 128))
    assert requests == bench.workload(50, (8, 64), (16, 128))
    assert all(8 <= len(ids) <= 64 and 16 <= new <= 128 and max(ids) < bench.EOT for ids, new, _ in requests)
    other = bench.workload(50, (8, 64), (16, 128), draw=1)  # another pass's: the same shapes, other prompts
    assert [(len(ids), new, i) for ids, new, i in other] == [(len(ids), new, i) for ids, new, i in requests]
    assert all(a[0][:2] != b[0][:2] for a, b in zip(requests, other))
    warm = bench.warm_up((8, 64), (16, 128))
    assert [len(ids) for ids, _, _ in warm] == [8, 16, 24, 32, 40, 48, 56, 64]
    assert [new for _, new, _ in warm if new != 2] == [128, 128]
    for max_batch, widths in [(16, [2, 4, 8, 16]), (6, [2, 4, 6]), (1, [])]:
        groups = bench.warm_up_widths((8, 64), (16, 128), max_batch)
        assert [len(g) for g in groups] == widths + [2] * bool(widths)
        assert all([(len(ids), new) for ids, new, _ in g] == [(8, 128)] * len(g) for g in groups[:-1])
        assert not widths or [(len(ids), new) for ids, new, _ in groups[-1]] == [(8, 2), (8, 128)]
    args = argparse.Namespace(clients=16, max_batch=16, dtype="float32")
    passes = {"concurrent": [{"tokens_per_s": 90.0, "busy_tokens_per_s": 120.0, "ttft_p50_s": 0.3, "ttft_p99_s": 2.0},
                             {"tokens_per_s": 110.0, "busy_tokens_per_s": 140.0, "ttft_p50_s": 0.5, "ttft_p99_s": 3.0}],
              "sequential": [{"tokens_per_s": 24.0, "busy_tokens_per_s": 25.0, "ttft_p50_s": 0.1, "ttft_p99_s": 0.3},
                             {"tokens_per_s": 26.0, "busy_tokens_per_s": 27.0, "ttft_p50_s": 0.1, "ttft_p99_s": 0.3}],
              "saved_model": [{"tokens_per_s": 40.0, "busy_tokens_per_s": 52.0},
                              {"tokens_per_s": 50.0, "busy_tokens_per_s": 52.0}],
              "one_client": [{"tokens_per_s": 24.5, "busy_tokens_per_s": 25.0, "ttft_p50_s": 0.1, "ttft_p99_s": 0.3}],
              "generate": [{"tokens_per_s": 28.0, "busy_tokens_per_s": None}]}
    rows = {r["candidate"]: r for r in bench.rows_of(passes, args)}
    assert rows["concurrent"]["vs_sequential"] == pytest.approx(100 / 25) and rows["sequential"]["slots"] == 1
    assert rows["concurrent"]["busy_vs_sequential"] == pytest.approx(130 / 26)
    assert (rows["one_client"]["clients"], rows["one_client"]["slots"]) == (1, 16)
    assert rows["one_client"]["vs_sequential"] == pytest.approx(24.5 / 25)
    assert bench.headlines(list(rows.values()), args) == [
        {"what": "tfgpt2 serve, 16 clients, 16 slots", "figure": (
            "130 tokens/s with all clients busy (5.0x one after another, 2.5x the SavedModel), 100 tokens/s over "
            "whole passes (4.0x one after another, 2.2x the SavedModel); first token p50 0.40 s, p99 2.50 s")},
        {"what": "tfgpt2 serve, 1 client, 16 slots",
         "figure": "24 tokens/s, 0.98x a 1-slot server, 0.88x tfgpt2.generate alone"}]
    assert (rows["generate"]["clients"], rows["generate"]["slots"]) == (1, None)


@pytest.mark.slow
def test_serve_benchmark_generate_worker(tiny_dir):
    """The generate candidate's child: each pass's requests one after another through
    tfgpt2.generate, every request's tokens counted."""
    done = run_tool("benchmark_serve.py", "--worker", "generate", "--model_dir", tiny_dir, "--requests", "3",
                    "--prompt", "4", "8", "--new", "2", "5", "--runs", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    passes = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(passes) == 2 and all(p["tokens_per_s"] > 0 for p in passes)


def test_serve_benchmark_timed_passes(capsys):
    """The SavedModel and generate candidates' passes (`timed_passes`): a warm-up pass and --runs
    passes, each request once per pass, from as many threads at once as there are clients, each
    pass's tokens counted."""
    import threading
    from tools import benchmark_serve as bench
    args = argparse.Namespace(requests=5, prompt=(2, 4), new=(1, 3), runs=2)
    together, calls, lock = threading.Barrier(2, timeout=60), [], threading.Lock()

    def call(request):
        with lock:
            calls.append(request)
            first_two = len(calls) <= 2
        if first_two:
            together.wait()  # both clients in a call at once, or a BrokenBarrierError
    bench.timed_passes(call, args, clients=2)
    passes = [bench.workload(5, (2, 4), (1, 3), draw=draw) for draw in range(3)]  # the warm-up's, then the runs'
    assert sorted(calls) == sorted(sum(passes, []))
    passes = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(passes) == 2 and all(p["tokens_per_s"] > 0 for p in passes)


def guidellm_benchmark(strategy, totals, rate, tokens_per_s, ttft, itl, tpot):
    """A benchmark of guidellm's JSON report, in the shape its 0.8 release writes (only the keys
    benchmark_guidellm reads): latencies as (median, p99) of the answered requests."""
    def latency(median, p99):
        return {"successful": {"median": median, "percentiles": {"p99": p99}}}
    return {"config": {"strategy": strategy}, "metrics": {
        "request_totals": dict(zip(("successful", "errored", "incomplete", "total"), totals)),
        "requests_per_second": {"total": {"mean": rate}}, "output_tokens_per_second": {"total": {"mean": tokens_per_s}},
        "time_to_first_token_ms": latency(*ttft), "inter_token_latency_ms": latency(*itl),
        "time_per_output_token_ms": latency(*tpot)}}


def test_guidellm_report_rows_and_headline():
    """benchmark_guidellm: a row per benchmark of guidellm's report (its strategy in words, the
    requests answered, refused and cut off, the rates guidellm's console shows, TTFT, ITL and
    TPOT at the median and p99), and a headline of the most streams that counts every refusal."""
    from tools import benchmark_guidellm as bench
    found = {"benchmarks": [
        guidellm_benchmark({"type_": "concurrent", "streams": 4}, (32, 0, 0, 32), 5.0, 80.0, (100, 200), (20, 30),
                           (25, 40)),
        guidellm_benchmark({"type_": "concurrent", "streams": 16}, (30, 1, 1, 32), 9.0, 150.0, (300, 900),
                           (40, 60), (55, 80))]}
    rows = bench.rows_of(found, "concurrent")
    assert [r["benchmark"] for r in rows] == ["concurrent 4 streams", "concurrent 16 streams"]
    assert rows[1] == {"benchmark": "concurrent 16 streams", "successful": 30, "errored": 1, "incomplete": 1,
                       "requests_per_s": 9.0, "output_tokens_per_s": 150.0, "time_to_first_token_ms_p50": 300,
                       "time_to_first_token_ms_p99": 900, "inter_token_latency_ms_p50": 40,
                       "inter_token_latency_ms_p99": 60, "time_per_output_token_ms_p50": 55,
                       "time_per_output_token_ms_p99": 80}
    assert bench.describe({"type_": "constant", "rate": 2.5}) == "constant 2.50/s"
    assert bench.describe({"type_": "synchronous"}) == "synchronous"
    args = argparse.Namespace(streams=[4, 16], max_batch=16)
    assert bench.headline(rows, args) == [{
        "what": "tfgpt2 serve under guidellm, 16 concurrent streams, 16 slots",
        "figure": "150 output tokens/s, TTFT p50 300 ms, ITL p50 40 ms, TPOT p50 55 ms; 62 requests answered, "
                  "2 refused or cut off"}]


def test_serve_benchmark_against_llama_server():
    """tfgpt2's concurrent and one-client candidates as ratios of llama-server's (the same load on
    its -np slots), and their headlines; the request asks both servers for the same sampling."""
    from tools import benchmark_serve as bench
    args = argparse.Namespace(clients=16, max_batch=16, dtype="bfloat16")
    passes = {name: [{"tokens_per_s": figure, "busy_tokens_per_s": figure, "ttft_p50_s": 0.1, "ttft_p99_s": 0.3}]
              for name, figure in (("concurrent", 200.0), ("one_client", 45.0), ("llama_server", 250.0),
                                   ("llama_one_client", 60.0))}
    rows = {r["candidate"]: r for r in bench.rows_of(passes, args)}
    assert rows["concurrent"]["vs_llama_server"] == pytest.approx(0.8)
    assert rows["one_client"]["vs_llama_server"] == pytest.approx(0.75)
    assert (rows["llama_server"]["clients"], rows["llama_server"]["slots"]) == (16, 16)
    assert (rows["llama_one_client"]["clients"], rows["llama_one_client"]["slots"]) == (1, 16)
    assert bench.headlines(list(rows.values()), args) == [
        {"what": "tfgpt2 serve (bfloat16), 16 clients, 16 slots",
         "figure": "200 tokens/s with all clients busy, 200 tokens/s over whole passes; first token p50 0.10 s, "
                   "p99 0.30 s; llama-server 250 tokens/s over whole passes (0.80x)"},
        {"what": "tfgpt2 serve (bfloat16), 1 client, 16 slots", "figure": "45 tokens/s, 0.75x llama-server's 60"}]
    request = bench.body(([1, 2], 5, 7))
    assert (request["top_k"], request["top_p"], request["min_p"], request["logit_bias"]) == (0, 1.0, 0.0, {"50256": -100})


@pytest.mark.slow
def test_serve_report_beside_llama_server(tiny_dir, tmp_path):
    """tfgpt2 serve and llama-server on the same tiny weights and load, where TFGPT2_LLAMA_CPP
    names llama.cpp's programs' folder (skipped elsewhere): every request of every pass answered
    by both, and the ratios in the report."""
    programs = os.environ.get("TFGPT2_LLAMA_CPP")
    if not programs:
        pytest.skip("llama.cpp's programs are not at hand (TFGPT2_LLAMA_CPP=<the folder of llama-server>)")
    done = run_tool("benchmark_serve.py", "--model_dir", tiny_dir, "--candidates", "concurrent", "llama_server",
                    "llama_one_client", "--clients", "4", "--max_batch", "4", "--requests", "8", "--prompt", "8",
                    "16", "--new", "4", "8", "--runs", "1", "--rss_requests", "0", "--fresh_requests", "8",
                    "--report", str(tmp_path), "--llama_cpp", programs)
    assert done.returncode == 0, done.stderr[-3000:]
    data = assert_report(str(tmp_path), "serve", "benchmark_serve.py")
    by = {r["candidate"]: r for r in rows(data)}
    assert set(by) == {"concurrent", "llama_server", "llama_one_client"}
    assert by["concurrent"]["vs_llama_server"] == pytest.approx(
        by["concurrent"]["tokens_per_s"]["median"] / by["llama_server"]["tokens_per_s"]["median"])
    assert "-np 4" in " ".join(data["notes"])


@pytest.mark.slow  # a server process
def test_serve_report_of_a_fresh_server(tiny_dir, tmp_path):
    """The concurrent server, fresh then warm: nothing compiled on a request's step, the fresh
    requests' p99 against the warm server's over the same lengths (the ratio of the two figures
    the report holds)."""
    done = run_tool("benchmark_serve.py", "--model_dir", tiny_dir, "--candidates", "concurrent", "--clients", "4",
                    "--max_batch", "4", "--requests", "8", "--prompt", "8", "16", "--new", "4", "8", "--runs", "1",
                    "--rss_requests", "0", "--fresh_requests", "8", "--report", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    data = assert_report(str(tmp_path), "serve", "benchmark_serve.py")
    fresh = data["settings"]["fresh"]
    assert fresh["request_compiles"] == 0 and fresh["warmup_programs"] > 0
    assert fresh["ttft_p99_s"] >= fresh["ttft_p50_s"] > 0 and fresh["warm_ttft_p99_s"] > 0
    [headline] = [h for h in data["headlines"] if "fresh" in h["what"]]
    assert f"{fresh['ttft_p99_s'] / fresh['warm_ttft_p99_s']:.2f}x warm" in headline["figure"]


def test_serve_benchmark_states_the_fresh_servers_first_requests():
    """The fresh server's first requests: their time to first token at p99 as a ratio of the warm
    server's over the same lengths (and of the timed passes'), the warm-up, and the compiles on a
    request's step, in the notes and a headline."""
    from tools import benchmark_serve as bench
    args = argparse.Namespace(fresh_requests=100, clients=16, max_batch=16, dtype="float32")
    rows = bench.rows_of({"concurrent": [{"tokens_per_s": 100.0, "busy_tokens_per_s": 120.0, "ttft_p50_s": 0.3,
                                          "ttft_p99_s": 2.0}]}, args)
    first = dict(ready_s=250.0, warmup_s=240.0, warmup_programs=10, request_compiles=0, stand_in_steps=900,
                 background=20, ttft_p50_s=0.5, ttft_p99_s=3.0, tokens_per_s=80.0, warm_ttft_p99_s=2.4)
    assert ("p99 3.00 s (1.25x the p99 of the same lengths sent to it warm, 2.40 s, median of 3 passes; 1.50x "
            "the timed passes' p99)") in bench.fresh_notes(first, rows)[0]
    assert bench.fresh_headline(first, args) == [
        {"what": "tfgpt2 serve, fresh, first 100 requests, 16 clients",
         "figure": "first token p99 3.00 s, 1.25x warm (2.40 s, the same lengths); warm-up 240 s, 0 compiles on "
                   "a request's step"}]
    assert bench.fresh_notes(None, rows) == []


def test_serve_benchmark_counts_the_tokens_while_every_client_is_busy():
    """Two clients: one request each from 0 s, the third starts at 2 s (the last start): the
    tokens until then, each request's spread evenly over its time."""
    from tools import benchmark_serve as bench
    got = bench.figures(4.0, [(0.0, 2.0, 10), (0.0, 4.0, 40), (2.0, 4.0, 10)])
    assert got == {"tokens_per_s": 60 / 4.0, "busy_tokens_per_s": (10 + 40 * 2 / 4) / 2.0}


@pytest.mark.slow
def test_generation_quality_of_int8_against_float32(tiny_dir):
    """benchmark.py --dtype int8's quality table: the greedy agreement and the loss ratio of the
    int8 model against float32 (close on the tiny model, not equal: the weights are rounded)."""
    from tools.benchmark import arguments, quality
    q = quality(arguments(["--model_dir", tiny_dir, "--dtype", "int8", "--quality_prompts", "2",
                           "--quality_steps", "8", "--text_tokens", "100"]))
    assert q["dtype"] == "int8" and q["tokens"] == 100
    assert 0.75 <= q["agreement"] <= 1 and q["ratio"] == pytest.approx(q["loss_q"] / q["loss_f"])
    assert q["loss_q"] != q["loss_f"] and abs(q["ratio"] - 1) < 0.05
