"""Serve a model over HTTP with OpenAI's completions API, batching requests continuously
(docs/serving.md):

    tfgpt2 serve --model_name 124M
    tfgpt2 serve --model_dir checkpoint/run1 --host 0.0.0.0 --port 8000 --max_batch 32
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "124M", "prompt": "Every effort moves you", "max_tokens": 20, "temperature": 0}'

Endpoints: POST /v1/completions (stream: true for server-sent events), GET /v1/models[/ID],
POST /tokenize and /detokenize, GET /tokenizer_info and /version (as vLLM's), GET /health,
GET /metrics (Prometheus). The model's id is its folder's name. With an API key (--api_key, or
TFGPT2_API_KEY in the environment, which keeps it out of `ps`) every endpoint but /health needs
`Authorization: Bearer KEY`. SIGTERM or Ctrl-C drains: running requests finish (for up to
--drain_timeout seconds), new ones get 503, then the server exits (a second signal exits at
once). Needs the serve extra: pip install 'tfgpt2[serve]'.
"""
import argparse
import os
import sys

API_KEY = "TFGPT2_API_KEY"  # the environment variable that holds the key

from .args import Parser, ranged
from ..formats.folders import encoder_of
from .common import DTYPE_HELP, DTYPES, add_model_flags, add_quiet, add_tf32, model_dir, parse


def main(argv=None, prog="tfgpt2 serve"):
    parser = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(parser)
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1; "
                        "0.0.0.0 for every interface)")
    parser.add_argument("--port", type=ranged(int, 0, 65535), default=8000, help="the port (default 8000)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help=DTYPE_HELP)
    parser.add_argument("--max_batch", type=ranged(int, 1), default=16,
                        help="slots: completions generated at once, each step (default 16)")
    parser.add_argument("--max_queue", type=ranged(int, 0), default=256,
                        help="completions that may wait for a slot; past that a request gets 429 (default 256)")
    parser.add_argument("--prefill_chunk", type=ranged(int, 16), default=64, metavar="TOKENS",
                        help="prompts are read this many tokens at a time, a chunk of each of up to 4 "
                             "prompts between decode steps (a power of two; default 64)")
    parser.add_argument("--decode_steps", type=ranged(int, 1), default=1, metavar="STEPS",
                        help="tokens per decode call while no prompt waits: more cost the host less per "
                             "token (on a GPU, 8), fewer let new requests in sooner (default 1; a completion "
                             "running alone makes up to 16)")
    parser.add_argument("--prefix_cache_blocks", type=ranged(int, 0), default=64, metavar="BLOCKS",
                        help="blocks of 64 prompt positions whose keys and values are kept, so that a prompt "
                             "that starts as an earlier one did reads its start from them (2 x n_layer x 64 x "
                             "n_embd values each: 2.4 MB for 124M in float32); 0: none (default 64)")
    parser.add_argument("--no_warmup", action="store_true",
                        help="listen at once, compiling each program when a step first needs it (the first "
                             "requests wait on compiles); by default the programs that stand in for every "
                             "step are compiled first, and the others in the background while serving")
    parser.add_argument("--served_model_name", metavar="NAME",
                        help="the model's id in the API (default: the model folder's name)")
    add_guard_flags(parser)
    add_tf32(parser)
    add_quiet(parser)
    args, progress = parse(parser, argv)
    if args.prefill_chunk & (args.prefill_chunk - 1):
        parser.error(f"argument --prefill_chunk: must be a power of two, got {args.prefill_chunk}")
    try:
        from ..serve.app import serve
    except ImportError as e:
        sys.exit(f"error: {e.name} is missing: tfgpt2 serve needs pip install 'tfgpt2[serve]'")
    from ..formats.checkpoint import load_model
    try:
        folder = model_dir(args)
        progress.note(f"loading {folder} ({args.dtype})")
        model, encoder = load_model(folder, dtype=args.dtype, tf32=args.tf32), encoder_of(folder)
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    name = args.served_model_name or os.path.basename(os.path.normpath(folder))
    if not args.no_warmup:
        progress.note("warming up: compiling the programs that stand in for every step")
    serve(model, encoder, model_name=name, host=args.host, port=args.port, max_batch=args.max_batch,
          max_queue=args.max_queue, chunk=args.prefill_chunk, steps=args.decode_steps,
          prefix_blocks=args.prefix_cache_blocks,
          api_key=args.api_key or os.environ.get(API_KEY) or None, public_metrics=args.public_metrics,
          max_body=args.max_body_bytes, request_timeout=args.request_timeout, drain_timeout=args.drain_timeout,
          docs=args.docs, warm_up=not args.no_warmup,
          ready=lambda seconds: progress.note(f"serving {name} on http://{args.host}:{args.port}/v1 "
                                              f"({args.max_batch} slots" + (
                                                  "" if seconds is None else f"; warm-up {seconds:.1f} s") + ")"))
    return 0


def add_guard_flags(parser):
    """The flags that protect the server: its key, body bound, timeouts, open routes."""
    parser.add_argument("--api_key", "--api-key", metavar="KEY",
                        help=f"every endpoint but /health needs Authorization: Bearer KEY (default: ${API_KEY}; "
                             "none: open to whoever reaches the port)")
    parser.add_argument("--public_metrics", action="store_true", help="/metrics answers without the key")
    parser.add_argument("--max_body_bytes", type=ranged(int, 1024), default=4 << 20, metavar="BYTES",
                        help="a request body over this gets 413, unread (default 4 MiB)")
    parser.add_argument("--request_timeout", type=ranged(float, 0, above=True), default=30, metavar="SECONDS",
                        help="a request's headers and body must be in whole within this, else its connection "
                             "is closed (default 30)")
    parser.add_argument("--drain_timeout", type=ranged(float, 0), default=30, metavar="SECONDS",
                        help="after SIGTERM, running requests get this long to finish before they are cut off "
                             "(default 30)")
    parser.add_argument("--docs", action="store_true", help="serve FastAPI's /docs, /redoc and /openapi.json")
