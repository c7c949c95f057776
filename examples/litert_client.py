"""Generate text with a tfgpt2 LiteRT file, using nothing but ai_edge_litert and NumPy (and
tiktoken for text in and out). The file's contract is in docs/litert.md.

    pip install ai-edge-litert numpy tiktoken
    python litert_client.py gpt2-int8.tflite --prompt "The meaning of life is" --length 40
    python litert_client.py gpt2.tflite --ids 464,3290,286 --length 8 --temperature 0

With --ids the token ids go in and come out as numbers (no tiktoken; it fetches GPT-2's
vocabulary the first time). Sampling: temperature, then the top_k most likely tokens.
"""
import argparse

import numpy as np
from ai_edge_litert.interpreter import Interpreter


def pick(logits, temperature, top_k, rng):
    """Greedy at temperature 0, else a draw from softmax(logits / temperature) over the top_k."""
    if temperature == 0:
        return int(np.argmax(logits))
    logits = logits.astype(np.float64) / temperature
    if top_k:
        logits = np.where(logits < np.sort(logits)[-top_k], -np.inf, logits)
    p = np.exp(logits - logits.max())
    return int(rng.choice(len(p), p=p / p.sum()))


def generate(path, ids, length, *, temperature=1.0, top_k=0, seed=None):
    """`length` new token ids after `ids`: `prefill` the prompt, then `decode` one token at a
    time at the next free slot of the cache, passing the cache tensors back each step."""
    interpreter = Interpreter(model_path=path)
    prefill, decode = interpreter.get_signature_runner("prefill"), interpreter.get_signature_runner("decode")
    outputs = prefill.get_output_details()
    n_ctx = min(int(d["shape"][1]) for name, d in outputs.items() if name.startswith("cache"))
    if not ids or len(ids) + length - 1 > n_ctx:
        raise SystemExit(f"the prompt ({len(ids)} tokens) plus {length} new ones must fit in n_ctx={n_ctx} (+1)")
    rng = np.random.default_rng(seed)
    out = prefill(input_ids=np.array([ids], np.int32))
    new = []
    for i in range(length):
        new.append(pick(out["logits"][0], temperature, top_k, rng))
        if i + 1 < length:
            cache = {name: value for name, value in out.items() if name.startswith("cache")}
            out = decode(input_ids=np.array([[new[-1]]], np.int32), position=np.array(len(ids) + i, np.int32),
                         **cache)
    return new


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", help="a .tflite file of `tfgpt2 export --format litert`")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="text to continue (tiktoken's GPT-2 encoding)")
    source.add_argument("--ids", help="token ids to continue, comma-separated")
    parser.add_argument("--length", type=int, default=20)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top_k", type=int, default=40)
    parser.add_argument("--seed", type=int)
    args = parser.parse_args()
    if args.ids is not None:
        ids = [int(i) for i in args.ids.split(",")]
        new = generate(args.file, ids, args.length, temperature=args.temperature, top_k=args.top_k, seed=args.seed)
        print(",".join(map(str, new)))
    else:
        import tiktoken
        enc = tiktoken.get_encoding("gpt2")
        new = generate(args.file, enc.encode(args.prompt), args.length, temperature=args.temperature,
                       top_k=args.top_k, seed=args.seed)
        print(args.prompt + enc.decode(new))


if __name__ == "__main__":
    main()
