#!/usr/bin/env python3
"""`tfgpt2 serve` under guidellm, the vLLM project's load tool, measured as the field measures
servers (guidellm is an optional benchmark dependency, not a test one: it brings PyTorch; a
virtual environment of its own is fine):

    python -m venv guidellm-venv && guidellm-venv/bin/pip install guidellm
    tfgpt2 make-checkpoint 124M          # random weights run at the same speed
    python tools/benchmark_guidellm.py --model_dir models/124M --guidellm guidellm-venv/bin/python

`tfgpt2 serve` starts in a child process (`benchmark_serve.start_server`: `--max_batch` slots)
and is warmed up (every prefill chunk, decode width and attention window of the workload
compiled: `benchmark_serve.warm_up`); the model's tokenizer is written for guidellm
(`tfgpt2 convert --to hf`). Then guidellm runs against it, as a user runs it against vLLM:
the `openai_http` backend on /v1/completions, streamed (guidellm sends vLLM's `ignore_eos` and
`stream_options.continuous_usage_stats`), synthetic prompts of `--prompt_tokens` tokens and
`--output_tokens` new tokens each, `--requests` requests per benchmark, its concurrent profile
at each of `--streams` and, with `--sweep N`, its sweep profile (synchronous, throughput, then
N - 2 constant rates between them). The report holds guidellm's own figures per benchmark:
requests answered, refused (errored) and cut off (incomplete), requests/s and output tokens/s
(the means over the benchmark that guidellm's console shows), and time to first token (TTFT),
inter-token latency (ITL) and time per output token (TPOT) of the answered requests, median and
p99, in milliseconds (`--raw DIR` keeps guidellm's own JSON).
"""
import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile

try:
    from . import benchmark_serve, report
except ImportError:  # run as `python tools/benchmark_guidellm.py`: this folder is on sys.path
    import benchmark_serve
    import report

LATENCIES = [("time_to_first_token_ms", "TTFT"), ("inter_token_latency_ms", "ITL"),
             ("time_per_output_token_ms", "TPOT")]
COLUMNS = ([report.column("benchmark", "benchmark"), report.column("successful", "answered"),
            report.column("errored", "refused"), report.column("incomplete", "cut off"),
            report.column("requests_per_s", "requests/s", ".2f"),
            report.column("output_tokens_per_s", "output tokens/s", ".1f")]
           + [report.column(f"{key}_{q}", f"{name} {q} ms", ".1f") for key, name in LATENCIES for q in ("p50", "p99")])


def run_guidellm(args, url, tokenizer, profile, out):
    """guidellm's `run` of `profile` (its --profile and --override words) against `url`: its
    JSON report, parsed."""
    command = [args.guidellm, "-m", "guidellm", "run",
               "--backend", f"kind=openai_http,target={url},model=bench,request_format=/v1/completions",
               *profile, "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
                                   f"output_tokens={args.output_tokens}",
               "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
               "--constraint", f"kind=max_requests,count={args.requests}",
               "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    subprocess.run(command, check=True, stdout=sys.stderr)
    with open(out) as f:
        return json.load(f)


def rows_of(found, profile):
    """A row per benchmark of a guidellm report: its strategy, request counts and figures."""
    rows = []
    for benchmark in found["benchmarks"]:
        metrics, strategy = benchmark["metrics"], benchmark["config"]["strategy"]
        totals = metrics["request_totals"]
        row = {"benchmark": f"{profile} {describe(strategy)}", **{k: totals[k] for k in
                                                                   ("successful", "errored", "incomplete")},
               "requests_per_s": metrics["requests_per_second"]["total"]["mean"],
               "output_tokens_per_s": metrics["output_tokens_per_second"]["total"]["mean"]}
        for key, _ in LATENCIES:
            summary = metrics[key]["successful"]
            row[f"{key}_p50"], row[f"{key}_p99"] = summary["median"], summary["percentiles"]["p99"]
        rows.append(row)
    return rows


def describe(strategy):
    """A guidellm strategy in words: "4 streams", "rate 2.5/s", "synchronous", "throughput"."""
    kind = strategy.get("type_") or strategy.get("type")
    if kind == "concurrent":
        return f"{strategy['streams']} streams"
    if strategy.get("rate") is not None:
        return f"{kind} {strategy['rate']:.2f}/s"
    return kind


def headline(rows, args):
    by = {row["benchmark"]: row for row in rows}
    streams = max(args.streams)
    row = by.get(f"concurrent {streams} streams")
    if row is None:
        return []
    refused = sum(r["errored"] + r["incomplete"] for r in rows)
    answered = sum(r["successful"] for r in rows)
    return [{"what": f"tfgpt2 serve under guidellm, {streams} concurrent streams, {args.max_batch} slots",
             "figure": f"{row['output_tokens_per_s']:,.0f} output tokens/s, TTFT p50 "
                       f"{row['time_to_first_token_ms_p50']:.0f} ms, ITL p50 {row['inter_token_latency_ms_p50']:.0f} "
                       f"ms, TPOT p50 {row['time_per_output_token_ms_p50']:.0f} ms; {answered} requests answered, "
                       f"{refused} refused or cut off"}]


def arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", default="models/124M", help="a model folder (tfgpt2 make-checkpoint 124M)")
    parser.add_argument("--guidellm", default=sys.executable, help="a Python that has guidellm installed")
    parser.add_argument("--max_batch", type=int, default=16, help="the server's slots")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16], help="the concurrent profile's streams")
    parser.add_argument("--sweep", type=int, default=0, help="the sweep profile's benchmarks (0: no sweep)")
    parser.add_argument("--requests", type=int, default=32, help="requests per benchmark")
    parser.add_argument("--prompt_tokens", type=int, default=32, help="tokens per synthetic prompt")
    parser.add_argument("--output_tokens", type=int, default=16, help="new tokens per request")
    parser.add_argument("--prefill_chunk", type=int, default=64, help="the server's --prefill_chunk")
    parser.add_argument("--decode_steps", type=int, default=1, help="the server's --decode_steps")
    parser.add_argument("--dtype", default="float32", help="the model's Keras dtype policy")
    parser.add_argument("--tf32", action="store_true", help="float32 products in TF32 where the GPU has it")
    parser.add_argument("--raw", metavar="DIR", help="keep guidellm's own JSON reports in DIR")
    report.add_arguments(parser, "serve-guidellm")
    return parser.parse_args(argv)


def warm(url, args):
    """Compile what the workload runs: prompts around --prompt_tokens (guidellm's text is
    tokenized again by the server), every decode width."""
    prompt, new = (max(1, args.prompt_tokens - 8), args.prompt_tokens + 8), (args.output_tokens, args.output_tokens)
    asyncio.run(benchmark_serve.drive(url, benchmark_serve.warm_up(prompt, new), 1))
    for group in benchmark_serve.warm_up_widths(prompt, new, args.max_batch):
        asyncio.run(benchmark_serve.drive(url, group, len(group)))


def main(argv=None):
    args = arguments(argv)
    profiles = [("concurrent", ["--profile", f"kind=concurrent,streams={args.streams[0]}", "--override",
                                "profile.streams", ",".join(map(str, args.streams))])]
    if args.sweep:
        profiles.append(("sweep", ["--profile", f"kind=sweep,sweep_size={args.sweep}"]))
    rows, found = [], {}
    with tempfile.TemporaryDirectory(prefix="tfgpt2-guidellm-") as folder:
        tokenizer = os.path.join(folder, "hf")
        subprocess.run([sys.executable, "-m", "tfgpt2.cli.main", "convert", "--from", "openai", "--to", "hf",
                        "--quiet", args.model_dir, tokenizer], check=True, cwd=report.ROOT,
                       env=dict(os.environ, PYTHONPATH=report.ROOT))
        child, url = benchmark_serve.start_server(args, args.max_batch)
        try:
            warm(url, args)
            for name, profile in profiles:
                found[name] = run_guidellm(args, url, tokenizer, profile, os.path.join(folder, f"{name}.json"))
                rows += rows_of(found[name], name)
        finally:
            status = benchmark_serve.stop_server(child)
        if args.raw:  # guidellm's own reports
            os.makedirs(args.raw, exist_ok=True)
            for name in found:
                shutil.copy(os.path.join(folder, f"{name}.json"), os.path.join(args.raw, f"{args.name}-{name}.json"))
    settings = {k: getattr(args, k) for k in ("model_dir", "max_batch", "streams", "sweep", "requests",
                                              "prompt_tokens", "output_tokens", "prefill_chunk", "decode_steps",
                                              "dtype", "tf32")}
    settings["guidellm"] = guidellm_version(args.guidellm)
    notes = [f"guidellm {settings['guidellm']} (its openai_http backend, /v1/completions, streamed) against "
             f"`tfgpt2 serve --max_batch {args.max_batch} --prefill_chunk {args.prefill_chunk} --decode_steps "
             f"{args.decode_steps}` ({args.dtype}), warmed up first; synthetic prompts of {args.prompt_tokens} tokens, "
             f"{args.output_tokens} output tokens each (ignore_eos), {args.requests} requests per benchmark. Figures "
             f"as guidellm reports them: requests/s and output tokens/s its means over "
             f"the benchmark; TTFT, ITL and TPOT over the answered requests, median and p99; refused: requests "
             f"guidellm counts as errored; cut off: incomplete."]
    if status:
        notes.append(f"The server did not drain cleanly on SIGTERM: exit status {status}.")
    report.publish(args, "Serving under guidellm", [report.table(COLUMNS, rows)], tool=__file__, argv=argv,
                   settings=settings, notes=notes, headlines=headline(rows, args))
    return 1 if status or any(r["errored"] or r["incomplete"] for r in rows) else 0


def guidellm_version(python):
    done = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('guidellm'))"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
