#!/usr/bin/env python3
"""`tfgpt2 serve` under load: many clients at once against the same requests one after another,
and against the SavedModel's `generate` signature called from as many threads, in one run.

    tfgpt2 make-checkpoint 124M          # a model folder (random weights run at the same speed)
    python tools/benchmark_serve.py --model_dir models/124M

One set of `--requests` completions (prompts of `--prompt` tokens, `--new` new tokens, drawn at
random within those ranges; temperature 1, each its own seed, <|endoftext|> banned so that every
request makes exactly its tokens) is sent, in each pass with prompts of the same lengths drawn
anew (no server reads a prompt from its cache of an earlier pass's):

- concurrent: by `--clients` clients at once (streamed, each taking the next request when its
  last is done) to `tfgpt2 serve --max_batch`;
- sequential: one after another to `tfgpt2 serve --max_batch 1` (a batch of one, so its steps
  are no wider than one request needs);
- saved_model: by `--clients` threads at once, each request to the `generate` signature of a
  SavedModel exported here (batch 1; TF runs the calls concurrently);
- one_client: one after another to the concurrent server (its `--max_batch` slots): what a
  client alone gets from a server sized for many;
- generate: one after another to `tfgpt2.generate` (what `tfgpt2 generate` runs), in a process
  of its own: what one client's server should match;
- llama_server and llama_one_client: the same, by `--clients` clients and by one, to llama.cpp's
  `llama-server` with `--max_batch` parallel sequences (`-np`), on the GGUF file of the same
  weights in the type of `--dtype` (tools/llama_peer.py), where `--llama_cpp DIR` names
  llama.cpp's programs;
- prefix_cache: two servers, the prefix cache on and off, each sent by one client prompts that
  share a prefix of `--shared` tokens (each with `--tail` tokens of its own), then prompts of the
  same length that share nothing: how much sooner the first token of a cached prefix comes, and
  what the cache costs prompts that share nothing.

Each server and the SavedModel run in a child process of their own. The concurrent server,
fresh (its start-up warm-up done, nothing sent yet), is first sent `--fresh_requests` requests
by `--clients` clients, and its programs compiled on a request's step are read from /metrics
before and after them. Then every candidate runs a warm-up (requests of every size: the
concurrent server's at every step width too, until it has compiled them all in the
background), then `--runs` timed passes; the two servers run at once and their passes
alternate, so that a change in the machine's load falls on both. Per pass: tokens/s (new tokens
of all requests over the pass's wall time), and for the servers the time to first token (the
first streamed chunk) at the median and 99th percentile over the requests. The concurrent
server, warm, is then sent the fresh requests' lengths again (new prompts) three times: their
time to first token at p99 against the fresh server's shows whether any waited on a compile.
Then the concurrent server answers `--rss_requests` tiny requests and its resident set is read
before and after (growth would show a leak). The report
(tools/report.py) goes to `--report DIR` as `--name`.json and .md (default serve).

On a GPU (add `--tf32` to let float32 products use TF32 there):

    python tools/benchmark_serve.py --model_dir models/124M --clients 64 --max_batch 64 \
        --requests 256 --decode_steps 8 --candidates concurrent sequential --rss_requests 0 --name serve-gpu
"""
import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

try:
    from . import llama_peer, report
except ImportError:  # run as `python tools/benchmark_serve.py`: this folder is on sys.path
    import llama_peer
    import report

EOT = 50256
CANDIDATES = ["concurrent", "sequential", "saved_model", "one_client", "generate", "llama_server",
              "llama_one_client", "prefix_cache"]
WORKERS = ("saved_model", "generate")  # the candidates that run in a child process of this script
SERVER = {"concurrent": "concurrent", "one_client": "concurrent", "sequential": "sequential",
          "llama_server": "llama_server", "llama_one_client": "llama_server"}  # whose server
MANY = ("concurrent", "saved_model", "llama_server")  # the candidates of --clients clients (the others: one)
PEERS = {"concurrent": "llama_server", "one_client": "llama_one_client"}  # tfgpt2's candidate: llama.cpp's


def workload(n, prompt, new, seed=0, draw=0):
    """n requests: (prompt token ids, new tokens, seed). The lengths depend on `seed` alone, the
    ids on `draw` too: passes of other draws have the same shapes (no pass meets one its warm-up
    did not) and prompts of their own (none can be read from a server's prompt cache)."""
    lengths, ids = np.random.default_rng(seed), np.random.default_rng([seed, draw])
    return [(ids.integers(0, EOT, lengths.integers(prompt[0], prompt[1] + 1)).tolist(),
             int(lengths.integers(new[0], new[1] + 1)), i) for i in range(n)]


def warm_up(prompt, new):
    """Requests, to be sent one at a time, that compile every program the workload can need: a
    prompt of every length a multiple of 8 apart (every prefill chunk size is one), and the
    shortest and longest with the most new tokens (every attention window)."""
    lengths = sorted({prompt[0], prompt[1], *range(prompt[0] + 8 - prompt[0] % 8, prompt[1], 8)})
    return [(list(range(1000, 1000 + n)), new[1] if n in prompt else 2, 100 + i) for i, n in enumerate(lengths)]


def warm_up_widths(prompt, new, max_batch):
    """Groups of requests, each to be sent at once, that compile the decode step at every width
    above one (`tfgpt2.serve.scheduler.width`: 2, 4, ... max_batch) and every attention window:
    that many of the shortest prompt, each with the most new tokens; then a pair whose first
    request has 2 new tokens (it ends first: the other moves down into its slot, which compiles
    the move). A group whose first request ended early would run on one narrower (a pair, alone)
    and leave its width's longer windows to compile during a timed pass."""
    from tfgpt2.serve.scheduler import width
    widths = sorted({width(n, max_batch) for n in range(2, max_batch + 1)})
    shortest = list(range(1000, 1000 + prompt[0]))
    groups = [[(shortest, new[1], 200 + i) for i in range(w)] for w in widths]
    return groups + [[(shortest, 2, 300), (shortest, new[1], 301)]] if widths else []


def body(request, stream=True):
    """The completion request: temperature 1 over the whole vocabulary (top_k, top_p and min_p
    off, as both servers take them), <|endoftext|> banned."""
    ids, new, seed = request
    return {"model": "bench", "prompt": ids, "max_tokens": new, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
            "min_p": 0.0, "seed": seed, "stream": stream, "logit_bias": {str(EOT): -100}}


# ---- the servers ----------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, max_batch, *flags):
    """`tfgpt2 serve` in a child process (with `flags` besides the run's), once it answers:
    (process, base URL)."""
    import httpx
    port = free_port()
    command = [sys.executable, "-m", "tfgpt2.cli.main", "serve", "--model_dir", args.model_dir, "--port", str(port),
               "--served_model_name", "bench", "--max_batch", str(max_batch), "--max_queue", str(args.requests + 64),
               "--prefill_chunk", str(args.prefill_chunk), "--decode_steps", str(args.decode_steps), "--dtype",
               args.dtype, "--quiet", *flags] + ["--tf32"] * args.tf32
    child = subprocess.Popen(command, cwd=report.ROOT, env=dict(os.environ, PYTHONPATH=report.ROOT))
    url = f"http://127.0.0.1:{port}"
    while child.poll() is None:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return child, url
        except httpx.TransportError:
            time.sleep(0.5)
    raise RuntimeError(f"tfgpt2 serve exited with {child.returncode}")


def stop_server(child):
    """SIGTERM (a drain): the exit status, 0 when it went as it should."""
    child.send_signal(signal.SIGTERM)
    return child.wait(timeout=600)


async def one(client, url, request, t0):
    """A streamed completion: (start, first chunk, end) in seconds since t0, and its new tokens."""
    start, first = time.perf_counter() - t0, None
    async with client.stream("POST", url + "/v1/completions", json=body(request)) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and first is None:
                first = time.perf_counter() - t0
    return start, first, time.perf_counter() - t0, request[1]


async def drive(url, requests, clients):
    """The requests by `clients` clients at once, each taking the next when its last is done:
    (wall seconds, [(start, first chunk, end, tokens)])."""
    import httpx
    queue, results = list(reversed(requests)), []
    # a connection per request: llama-server closes a kept-alive connection after a few requests
    # (cpp-httplib's limit), and a request sent on it as it closes fails
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        t0 = time.perf_counter()

        async def worker():
            while queue:
                results.append(await one(client, url, queue.pop(), t0))
        await asyncio.gather(*(worker() for _ in range(clients)))
    return time.perf_counter() - t0, results


def figures(wall, records):
    """A pass's figures from its requests' (start, end, tokens): tokens/s over the pass, and
    while every client was busy (until the last request started; each request's tokens counted
    as spread evenly over its time), which leaves out the tail where fewer clients remain."""
    busy = max(start for start, _, _ in records)
    during = sum(n * max(0.0, min(end, busy) - start) / (end - start) for start, end, n in records)
    return {"tokens_per_s": sum(n for _, _, n in records) / wall, "busy_tokens_per_s": during / busy if busy else None}


def one_pass(url, requests, clients):
    """The requests by `clients` clients: `figures` and the time to first token (p50, p99)."""
    wall, results = asyncio.run(drive(url, requests, clients))
    firsts = [first - start for start, first, _, _ in results]
    return dict(figures(wall, [(start, end, n) for start, _, end, n in results]),
                ttft_p50_s=float(np.percentile(firsts, 50)), ttft_p99_s=float(np.percentile(firsts, 99)))


def metrics(url):
    """The server's /metrics figures, {name (with its labels): value}."""
    import httpx
    lines = httpx.get(url + "/metrics").text.splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and line[0] != "#"}


def settle(url):
    """Waits until `tfgpt2 serve` has compiled in the background every program its requests
    asked for (`tfgpt2_compiles_pending`; at most an hour)."""
    deadline = time.monotonic() + 3600
    while metrics(url).get("tfgpt2_compiles_pending", 0) and time.monotonic() < deadline:
        time.sleep(1)


REQUEST_PATH = 'tfgpt2_compiled_programs{path="request"}'


def fresh(args, url, started):
    """The fresh concurrent server: seconds from its start to /health's 200, its warm-up, and
    `--fresh_requests` requests by `--clients` clients (the time to first token at p50 and p99,
    the programs compiled on a request's step before and after them, the steps run by a
    stand-in)."""
    ready, before = time.monotonic() - started, metrics(url)
    first = one_pass(url, workload(args.fresh_requests, args.prompt, args.new, seed=1), args.clients)
    after = metrics(url)
    return dict(ready_s=ready, warmup_s=before["tfgpt2_warmup_seconds"],
                warmup_programs=before['tfgpt2_compiled_programs{path="warmup"}'],
                request_compiles=after[REQUEST_PATH] - before[REQUEST_PATH],
                stand_in_steps=after["tfgpt2_stand_in_steps_total"],
                background=after['tfgpt2_compiled_programs{path="background"}'],
                **{k: first[k] for k in ("ttft_p50_s", "ttft_p99_s", "tokens_per_s")})


def warm_like_fresh(args, url):
    """The warm concurrent server's time to first token at p99, the median over 3 passes of the
    fresh pass's shape (its `--fresh_requests` lengths, new prompts, `--clients` clients): a p99
    over 100 requests and one over a timed pass of fewer are not the same statistic (the first
    is nearer the slowest of 100, the second the slowest of 32)."""
    return float(np.median([one_pass(url, workload(args.fresh_requests, args.prompt, args.new, seed=1, draw=1 + i),
                                     args.clients)["ttft_p99_s"] for i in range(3)]))


def servers(args):
    """The server candidates' passes, {name: [per pass]}, the fresh concurrent server's first
    requests (`fresh`), and the concurrent server's resident set before and after the tiny
    requests, with the servers' exit statuses. Both servers run at once (each warmed up first),
    and their passes alternate, so that a change in the machine's load falls on both. Each pass
    of each candidate draws its prompts anew (`workload`): llama-server keeps a slot's prompt
    and would read a prompt sent before from it, which measures its cache (the prefix_cache
    candidate measures tfgpt2's), not its speed."""
    names = [name for name in args.candidates if name in SERVER]
    running, first = {}, None
    try:
        for server in dict.fromkeys(SERVER[name] for name in names):
            started = time.monotonic()
            running[server] = llama_peer.start_server(args, args.gguf, args.max_batch, free_port()) \
                if server == "llama_server" else start_server(args, args.max_batch if server == "concurrent" else 1)
            if server == "concurrent" and args.fresh_requests:
                first = fresh(args, running[server][1], started)
            asyncio.run(drive(running[server][1], warm_up(args.prompt, args.new), 1))
            for group in warm_up_widths(args.prompt, args.new, args.max_batch) if server == "concurrent" else []:
                asyncio.run(drive(running[server][1], group, len(group)))
            if server != "llama_server":
                settle(running[server][1])
        results = {name: [] for name in names}
        for run in range(args.runs):
            for j, name in enumerate(names):
                requests = workload(args.requests, args.prompt, args.new, draw=1 + run * len(names) + j)
                results[name].append(one_pass(running[SERVER[name]][1], requests, args.clients if name in MANY else 1))
        if first is not None:
            first["warm_ttft_p99_s"] = warm_like_fresh(args, running["concurrent"][1])
        memory = None
        if "concurrent" in running and args.rss_requests:
            memory = rss_growth(running["concurrent"][1], running["concurrent"][0].pid, args.rss_requests, args.clients)
    finally:
        statuses = [stop_server(child) for child, _ in running.values()]
    return results, first, memory, statuses


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) / 1024


def rss_growth(url, pid, count, clients):
    """The server's resident set (MB) before and after `count` tiny requests (after 200 first)."""
    tiny = [([1 + i % 5000], 2, i) for i in range(count)]  # one token: nothing to prefill
    asyncio.run(drive(url, tiny[:200], clients))
    before = rss_mb(pid)
    asyncio.run(drive(url, tiny, clients))
    return before, rss_mb(pid)


# ---- the prefix cache ---------------------------------------------------------------------

PREFIX_SLOTS = 4  # the slots of the prefix cache's servers (one client: one is used)


def prefix_workloads(args, run):
    """Pass `run`'s requests: `--prefix_requests` prompts of the one shared prefix of `--shared`
    tokens and a tail of `--tail` tokens each of their own, and as many of the same length that
    share nothing (new in each pass: never cached before), each with `--prefix_new` new tokens."""
    shared = np.random.default_rng(7).integers(0, EOT, args.shared).tolist()
    rng, n = np.random.default_rng(100 + run), args.prefix_requests
    sharing = [(shared + rng.integers(0, EOT, args.tail).tolist(), args.prefix_new, i) for i in range(n)]
    alone = [(rng.integers(0, EOT, args.shared + args.tail).tolist(), args.prefix_new, n + i) for i in range(n)]
    return sharing, alone


def prefix_cache(args):
    """Two servers at once, the prefix cache on (its default pool) and off: per pass, one
    client's requests one after another, the prompts that share a prefix (cached by the warm-up)
    then those that share nothing; their times to first token (p50) and the latter's tokens/s.
    With the servers' exit statuses."""
    running = {}
    try:
        for name, flags in (("prefix cache on", []), ("prefix cache off", ["--prefix_cache_blocks", "0"])):
            running[name] = start_server(args, PREFIX_SLOTS, *flags)
            sharing, alone = prefix_workloads(args, -1)
            asyncio.run(drive(running[name][1], sharing[:2] + alone[:1], 1))  # compiles; the prefix is cached
        results = {name: [] for name in running}
        for run in range(args.runs):
            sharing, alone = prefix_workloads(args, run)
            for name, (_, url) in running.items():
                shared_pass, alone_pass = one_pass(url, sharing, 1), one_pass(url, alone, 1)
                results[name].append({"shared_ttft_p50_s": shared_pass["ttft_p50_s"],
                                      "alone_ttft_p50_s": alone_pass["ttft_p50_s"],
                                      "alone_tokens_per_s": alone_pass["tokens_per_s"]})
    finally:
        statuses = [stop_server(child) for child, _ in running.values()]
    return results, statuses


PREFIX_COLUMNS = [report.column("server", "server"),
                  report.column("shared_ttft_p50_s", "first token p50 s, shared prefix", ".3f"),
                  report.column("alone_ttft_p50_s", "first token p50 s, nothing shared", ".3f"),
                  report.column("alone_tokens_per_s", "tokens/s, nothing shared", ".1f")]


def prefix_rows(results):
    """The prefix cache's rows (each figure's spread over the passes), and its headline: how
    much sooner the first token of a shared prefix comes with the cache, and what the cache
    costs prompts that share nothing (ratios of the medians, on to off)."""
    rows = [dict({k: report.spread([p[k] for p in passes_]) for k in passes_[0]}, server=name)
            for name, passes_ in results.items()]
    on, off = ({k: v["median"] for k, v in row.items() if k != "server"} for row in rows)
    figure = (f"first token {off['shared_ttft_p50_s'] / on['shared_ttft_p50_s']:.1f}x sooner for prompts sharing a "
              f"cached prefix; prompts sharing nothing: first token {on['alone_ttft_p50_s'] / off['alone_ttft_p50_s']:.2f}x "
              f"the time, {on['alone_tokens_per_s'] / off['alone_tokens_per_s']:.2f}x the tokens/s, of the cache off")
    return rows, {"what": "tfgpt2 serve, prefix cache", "figure": figure}


# ---- the SavedModel and tfgpt2.generate, each in a child process -----------------------------

def generate_worker(args):
    """--runs passes of the workload through `tfgpt2.generate`, one request after another."""
    from tfgpt2.formats.checkpoint import load_model
    from tfgpt2.sample import generate
    model = load_model(args.model_dir, dtype=None if args.dtype == "float32" else args.dtype, tf32=args.tf32)

    def call(request):
        ids, new, seed = request
        generate(model, [ids], new, temperature=1.0, seed=seed, logit_bias={EOT: -100})
    timed_passes(call, args, clients=1)


def saved_model_worker(args):
    """Export (once, into --export_dir), then --runs passes of the workload from --clients threads."""
    import tensorflow as tf
    from tfgpt2.formats.saved_model import export_saved_model
    path = os.path.join(args.export_dir, "1")
    if not os.path.isdir(path):
        export_saved_model(args.model_dir, args.export_dir, dtype=args.dtype, tf32=args.tf32)
    generate = tf.saved_model.load(path).signatures["generate"]

    def call(request):
        ids, new, seed = request
        ids = tf.constant([ids], tf.int32)
        generate(input_ids=ids, attention_mask=tf.ones_like(ids), max_new_tokens=tf.constant(new),
                 temperature=tf.constant(1.0), top_k=tf.constant(0), top_p=tf.constant(1.0),
                 seed=tf.constant(seed, tf.int64))["output_ids"].numpy()
    timed_passes(call, args, clients=args.clients)


def timed_passes(call, args, *, clients):
    """A warm-up pass of the workload (every shape compiles), then --runs passes, each request
    `call(request)` from one of `clients` threads; prints the passes' figures as JSON."""
    def run(requests):
        queue, done, lock = list(reversed(requests)), [], threading.Lock()

        def worker():
            while True:
                with lock:
                    if not queue:
                        return
                    request = queue.pop()
                start = time.perf_counter() - t0
                call(request)
                done.append((start, time.perf_counter() - t0, request[1]))
        threads = [threading.Thread(target=worker) for _ in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return figures(time.perf_counter() - t0, done)
    run(workload(args.requests, args.prompt, args.new))
    print(json.dumps([run(workload(args.requests, args.prompt, args.new, draw=1 + i)) for i in range(args.runs)]))


def in_worker(name, args):
    """The passes of candidate `name` (WORKERS), run by this script in a child process."""
    with tempfile.TemporaryDirectory(prefix="tfgpt2-serve-bench-") as tmp:
        command = [sys.executable, os.path.abspath(__file__), "--worker", name, "--export_dir",
                   os.path.join(tmp, "export"), *sys_args(args)]
        done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=report.ROOT))
    if done.returncode:
        raise RuntimeError(f"the {name} worker failed: " + done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def sys_args(args):
    return ["--model_dir", args.model_dir, "--requests", str(args.requests), "--clients", str(args.clients),
            "--runs", str(args.runs), "--dtype", args.dtype, "--prompt", *map(str, args.prompt),
            "--new", *map(str, args.new)] + ["--tf32"] * args.tf32


# ---- the driver ---------------------------------------------------------------------------

COLUMNS = [report.column("candidate", "candidate"), report.column("clients", "clients"),
           report.column("slots", "slots"), report.column("busy_tokens_per_s", "tokens/s, all clients busy", ".1f"),
           report.column("busy_vs_sequential", "vs sequential", ".2f"),
           report.column("tokens_per_s", "tokens/s, whole pass", ".1f"),
           report.column("vs_sequential", "vs sequential", ".2f"),
           report.column("vs_llama_server", "vs llama-server", ".2f"),
           report.column("ttft_p50_s", "first token p50 s", ".2f"),
           report.column("ttft_p99_s", "first token p99 s", ".2f")]


def rows_of(results, args):
    """The report's rows from {candidate: [pass figures]}, each figure's spread over the passes
    and its medians' ratios to the sequential server's."""
    rows = []
    for name, passes_ in results.items():
        row = {"candidate": name, "clients": args.clients if name in MANY else 1,
               "slots": {"concurrent": args.max_batch, "sequential": 1, "llama_server": args.max_batch}.get(
                   SERVER.get(name))}
        row.update({k: report.spread([p[k] for p in passes_]) for k in passes_[0] if passes_[0][k] is not None})
        rows.append(row)
    base = next((r for r in rows if r["candidate"] == "sequential"), {})
    by = {r["candidate"]: r for r in rows}
    for row in rows:
        for key in ("tokens_per_s", "busy_tokens_per_s"):
            if key in row and key in base:
                row[key.replace("tokens_per_s", "vs_sequential")] = row[key]["median"] / base[key]["median"]
        peer = by.get(PEERS.get(row["candidate"]), {})
        if "tokens_per_s" in peer:
            row["vs_llama_server"] = row["tokens_per_s"]["median"] / peer["tokens_per_s"]["median"]
    return rows


def headlines(rows, args):
    """The concurrent server's row (`busy_figure`) and the one client's (`one_client_figure`)."""
    by = {r["candidate"]: r for r in rows}
    if "concurrent" not in by:
        return []
    found = [{"what": f"{served(args)}, {args.clients} clients, {args.max_batch} slots", "figure": busy_figure(by)}]
    one = one_client_figure(by)
    return found + ([{"what": f"{served(args)}, 1 client, {args.max_batch} slots", "figure": one}] if one else [])


def served(args):
    """What served: tfgpt2 serve, and its dtype unless float32."""
    return "tfgpt2 serve" + ("" if args.dtype == "float32" else f" ({args.dtype})")


def busy_figure(by):
    """The concurrent server's tokens/s while its clients are all busy and over whole passes, as
    ratios to the sequential server's and the SavedModel's, its times to first token, and
    llama-server's tokens/s over whole passes on the same load."""
    c, saved = by["concurrent"], by.get("saved_model", {})
    parts = []
    for key, what in (("busy_tokens_per_s", "with all clients busy"), ("tokens_per_s", "over whole passes")):
        if key in c:
            vs = key.replace("tokens_per_s", "vs_sequential")
            ratios = [f"{c[vs]:.1f}x one after another"] if vs in c else []
            ratios += [f"{c[key]['median'] / saved[key]['median']:.1f}x the SavedModel"] if key in saved else []
            parts.append(f"{c[key]['median']:,.0f} tokens/s {what}" + (f" ({', '.join(ratios)})" if ratios else ""))
    first = c["ttft_p50_s"]["median"], c["ttft_p99_s"]["median"]
    figure = ", ".join(parts) + f"; first token p50 {first[0]:.2f} s, p99 {first[1]:.2f} s"
    if "vs_llama_server" in c:
        figure += (f"; llama-server {by['llama_server']['tokens_per_s']['median']:,.0f} tokens/s over whole passes "
                   f"({c['vs_llama_server']:.2f}x)")
    return figure


def one_client_figure(by):
    """One client's tokens/s on the concurrent server, as ratios to a 1-slot server's, to
    tfgpt2.generate's alone and to one client's on llama-server; None where there is no ratio."""
    one, alone = by.get("one_client", {}), by.get("generate", {})
    ratios = [f"{one['vs_sequential']:.2f}x a 1-slot server"] if "vs_sequential" in one else []
    if "tokens_per_s" in alone and "tokens_per_s" in one:
        ratios.append(f"{one['tokens_per_s']['median'] / alone['tokens_per_s']['median']:.2f}x tfgpt2.generate alone")
    if "vs_llama_server" in one:
        ratios.append(f"{one['vs_llama_server']:.2f}x llama-server's "
                      f"{by['llama_one_client']['tokens_per_s']['median']:,.0f}")
    return f"{one['tokens_per_s']['median']:,.0f} tokens/s, {', '.join(ratios)}" if ratios else None


def arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", default="models/124M", help="a model folder (tfgpt2 make-checkpoint 124M)")
    parser.add_argument("--candidates", nargs="+", default=CANDIDATES, choices=CANDIDATES)
    parser.add_argument("--clients", type=int, default=16, help="clients at once (and SavedModel threads)")
    parser.add_argument("--max_batch", type=int, default=16, help="the concurrent server's slots")
    parser.add_argument("--requests", type=int, default=64, help="requests per pass")
    parser.add_argument("--prompt", type=int, nargs=2, default=[8, 64], metavar=("MIN", "MAX"), help="prompt tokens")
    parser.add_argument("--new", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"), help="new tokens")
    parser.add_argument("--runs", type=int, default=2, help="timed passes per candidate")
    parser.add_argument("--prefill_chunk", type=int, default=64, help="the servers' --prefill_chunk")
    parser.add_argument("--decode_steps", type=int, default=1, help="the servers' --decode_steps (8 on a GPU)")
    parser.add_argument("--dtype", default="float32", help="the model's Keras dtype policy")
    parser.add_argument("--tf32", action="store_true", help="float32 products in TF32 where the GPU has it")
    parser.add_argument("--rss_requests", type=int, default=2000, help="tiny requests for the memory check (0: none)")
    parser.add_argument("--fresh_requests", type=int, default=100,
                        help="requests sent first to the fresh concurrent server (0: none)")
    parser.add_argument("--shared", type=int, default=512, help="prefix_cache: the tokens of the shared prefix")
    parser.add_argument("--tail", type=int, default=16, help="prefix_cache: each prompt's tokens after it")
    parser.add_argument("--prefix_requests", type=int, default=16, help="prefix_cache: requests of each kind per pass")
    parser.add_argument("--prefix_new", type=int, default=16, help="prefix_cache: new tokens per request")
    llama_peer.add_arguments(parser)
    report.add_arguments(parser, "serve")
    parser.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
    parser.add_argument("--export_dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.slot_context = args.prompt[1] + args.new[1] + 8  # llama-server's context per sequence
    return args


def notes_of(args, memory, statuses, absent, rows):
    notes = [] if not rows else [f"{args.requests} requests per pass: prompts of {args.prompt[0]}-{args.prompt[1]} tokens, "
             f"{args.new[0]}-{args.new[1]} new tokens (uniform), temperature 1, <|endoftext|> banned; the same lengths in "
             f"every pass, the prompts' tokens drawn anew for each candidate's pass (none read from a prompt cache). "
             f"Tokens/s with all "
             f"clients busy: until the last request of a pass starts (each request's tokens spread evenly over its "
             f"time), which leaves out the tail where fewer clients remain; whole pass: all new tokens over the pass's "
             f"wall time. First token: the first streamed chunk of each request. "
             f"Median (range) over {args.runs} passes after a warm-up; the candidates' passes alternate (one_client's on "
             f"the concurrent server). Servers: "
             f"--prefill_chunk {args.prefill_chunk} --decode_steps {args.decode_steps}, {args.dtype}"
             f"{' (TF32 products)' if args.tf32 else ''}; each server and "
             f"the SavedModel and tfgpt2.generate in a process of its own; clients over HTTP on the same machine."]
    if args.gguf:
        notes.append(f"llama_server: {llama_peer.describe(args)}, -np {args.max_batch} with {args.slot_context} "
                     f"positions each, on the GGUF file of --model_dir's weights (tfgpt2 convert --to gguf); "
                     f"llama_one_client: one client on the same server.")
    if absent:
        notes.append(f"Not at hand here: {', '.join(absent)} (--llama_cpp names llama.cpp's programs).")
    if "prefix_cache" in args.candidates:
        notes.append(prefix_note(args))
    if memory:
        notes.append(f"Memory: the concurrent server's resident set was {memory[0]:,.0f} MB after 200 tiny requests "
                     f"and {memory[1]:,.0f} MB after {args.rss_requests} more ({memory[1] - memory[0]:+,.0f} MB).")
    if any(statuses):
        notes.append(f"A server did not drain cleanly on SIGTERM: exit statuses {statuses}.")
    return notes


def main(argv=None):
    args = arguments(argv)
    if args.worker:
        return {"saved_model": saved_model_worker, "generate": generate_worker}[args.worker](args)
    absent = [c for c in args.candidates if c.startswith("llama") and not (args.llama_cpp and os.path.isfile(
        llama_peer.program(args, "llama-server")))]
    args.candidates = [c for c in args.candidates if c not in absent]
    with tempfile.TemporaryDirectory(prefix="tfgpt2-serve-bench-") as folder:
        args.gguf = any(c.startswith("llama") for c in args.candidates) and llama_peer.write_gguf(
            args.model_dir, llama_peer.gguf_type(args), folder)
        print("measuring the servers ...", file=sys.stderr, flush=True)
        results, first, memory, statuses = servers(args)
    for name in (c for c in WORKERS if c in args.candidates):
        print(f"measuring {name} ...", file=sys.stderr, flush=True)
        results[name] = in_worker(name, args)
    rows = rows_of(results, args)
    prefix_tables, found = [], []
    if "prefix_cache" in args.candidates:
        print("measuring the prefix cache ...", file=sys.stderr, flush=True)
        prefix_results, prefix_statuses = prefix_cache(args)
        statuses += prefix_statuses
        prefix, headline = prefix_rows(prefix_results)
        prefix_tables, found = [report.table(PREFIX_COLUMNS, prefix, title="The prefix cache")], [headline]
    settings = {k: getattr(args, k) for k in ("model_dir", "candidates", "clients", "max_batch", "requests", "prompt",
                                              "new", "runs", "prefill_chunk", "decode_steps", "dtype", "tf32",
                                              "rss_requests", "fresh_requests", "llama_cpp", "threads", "shared",
                                              "tail", "prefix_requests", "prefix_new")}
    settings["rss_mb"], settings["fresh"] = memory, first
    columns = [c for c in COLUMNS if c["key"] != "vs_llama_server" or any("vs_llama_server" in r for r in rows)]
    tables = ([report.table(columns, rows)] if rows else []) + prefix_tables
    report.publish(args, "Serving under load", tables, tool=__file__, argv=argv, settings=settings,
                   notes=notes_of(args, memory, statuses, absent, rows) + fresh_notes(first, rows),
                   headlines=headlines(rows, args) + found + fresh_headline(first, args))
    return 1 if any(statuses) else 0


def warm_p99(rows):
    return next((r["ttft_p99_s"]["median"] for r in rows if r["candidate"] == "concurrent"), None)


def fresh_notes(first, rows):
    """The fresh server's start-up and first requests, in words."""
    if not first:
        return []
    passes = warm_p99(rows)
    return [f"Fresh concurrent server: /health answered {first['ready_s']:.1f} s after its start (the model's load "
            f"and a warm-up of {first['warmup_programs']:.0f} programs in {first['warmup_s']:.1f} s); its first "
            f"requests: time to first token p50 {first['ttft_p50_s']:.2f} s, p99 {first['ttft_p99_s']:.2f} s "
            f"({first['ttft_p99_s'] / first['warm_ttft_p99_s']:.2f}x the p99 of the same lengths sent to it warm, "
            f"{first['warm_ttft_p99_s']:.2f} s, median of 3 passes"
            + (f"; {first['ttft_p99_s'] / passes:.2f}x the timed passes' p99" if passes else "")
            + f"), {first['tokens_per_s']:.1f} tokens/s over them; {first['request_compiles']:.0f} programs compiled "
              f"on a request's step, {first['stand_in_steps']:.0f} steps run by a stand-in, "
              f"{first['background']:.0f} programs compiled in the background by their end."]


def fresh_headline(first, args):
    if not first:
        return []
    warm = first["warm_ttft_p99_s"]
    return [{"what": f"{served(args)}, fresh, first {args.fresh_requests} requests, {args.clients} clients",
             "figure": f"first token p99 {first['ttft_p99_s']:.2f} s, {first['ttft_p99_s'] / warm:.2f}x warm "
                       f"({warm:.2f} s, the same lengths); warm-up {first['warmup_s']:.0f} s, "
                       f"{first['request_compiles']:.0f} compiles on a request's step"}]


def prefix_note(args):
    return (f"The prefix cache: two servers of {PREFIX_SLOTS} slots at once, its default pool and none "
            f"(--prefix_cache_blocks 0); per pass one client sends {args.prefix_requests} prompts of one shared "
            f"prefix of {args.shared} tokens (cached by the warm-up) and a tail of {args.tail} tokens of their own, "
            f"then {args.prefix_requests} prompts of {args.shared + args.tail} tokens that share nothing (new in "
            f"each pass), {args.prefix_new} new tokens each, one after another; medians over {args.runs} passes, "
            f"the two servers' passes alternating.")


if __name__ == "__main__":
    sys.exit(main())
