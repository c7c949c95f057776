"""Tokens per second of tfgpt2's encoder against OpenAI's src/encoder.py, on the same text.

    python tools/benchmark_tokenizer.py [--mb 2] [--runs 5] [--shared ../shared]

Both read <shared>/gpt2-vocab; the reference is <shared>/openai-gpt-2/src/encoder.py (it needs
the regex package).  The text is generated from a seed: vocabulary tokens, numbers, several
scripts, emoji, code and contractions, joined by varied whitespace.  Each figure is the median
of --runs timed runs after one untimed run, so the reference's BPE cache is warm, as in use.
"""

import argparse
import importlib.util
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tfgpt2 import encoder as tfgpt2_encoder  # noqa: E402

SNIPPETS = [
    '你好，世界。日本語のテキスト', 'مرحبا بالعالم', 'नमस्ते दुनिया', 'Привет, мир', 'e\u0301a\u0308',
    '👍🏽', '👨‍👩‍👧‍👦', '🇫🇷', "I'LL", "don't", "THEY'RE", "we've",
    'def f(x):\n    return x ** 2\n', 'if (a != b) { return -1; }', '<a href="/x">y</a>',
]
SEPARATORS = [' '] * 12 + ['\n', '\n\n', '  ', '\t', ', ', '. ']


def make_text(encoder, n_chars, seed=0):
    """About n_chars of varied text, the same for the same seed and vocabulary."""
    rng = random.Random(seed)
    pieces, size = [], 0
    while size < n_chars:
        roll = rng.random()
        if roll < 0.8:
            piece = encoder.decode([rng.randrange(encoder.eot_token)]).strip()
        elif roll < 0.9:
            piece = str(rng.randrange(10 ** rng.randint(1, 9)))
        else:
            piece = rng.choice(SNIPPETS)
        pieces.append(piece + rng.choice(SEPARATORS))
        size += len(pieces[-1])
    return ''.join(pieces)


def median_seconds(fn, runs):
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def load_reference(shared):
    path = shared / 'openai-gpt-2' / 'src' / 'encoder.py'
    spec = importlib.util.spec_from_file_location('reference_encoder', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_encoder('gpt2-vocab', str(shared))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--mb', type=float, default=2.0, help='text size in millions of characters')
    parser.add_argument('--runs', type=int, default=5)
    parser.add_argument('--shared', type=Path,
                        default=Path(os.environ.get('TFGPT2_SHARED', ROOT.parent / 'shared')))
    args = parser.parse_args()
    reference = load_reference(args.shared)
    ours = tfgpt2_encoder.get_encoder('gpt2-vocab', str(args.shared))
    text = make_text(ours, int(args.mb * 1e6))
    lines = text.splitlines(keepends=True)
    ids = ours.encode(text)
    same = ids == reference.encode(text)
    n_batch = sum(map(len, ours.encode_batch(lines)))
    rows = [
        ('encode (one text)', len(ids), lambda: reference.encode(text), lambda: ours.encode(text)),
        ('encode_batch (lines)', n_batch, lambda: [reference.encode(line) for line in lines],
         lambda: ours.encode_batch(lines)),
        ('decode', len(ids), lambda: reference.decode(ids), lambda: ours.decode(ids)),
    ]
    print(f'$ python {" ".join(sys.argv)}')
    print(f'{len(text):,} characters, {len(lines):,} lines, {len(ids):,} tokens, '
          f'ids identical to the reference: {"yes" if same else "NO"}; '
          f'median of {args.runs} runs, {os.cpu_count()} CPUs\n')
    print(f'| {"operation":<22} | {"reference tok/s":>15} | {"tfgpt2 tok/s":>13} | speedup |')
    print(f'| {"-" * 22} | {"-" * 14}: | {"-" * 12}: | ------: |')
    for name, n_tokens, ref_fn, our_fn in rows:
        ref_rate = n_tokens / median_seconds(ref_fn, args.runs)
        our_rate = n_tokens / median_seconds(our_fn, args.runs)
        print(f'| {name:<22} | {ref_rate:>15,.0f} | {our_rate:>13,.0f} | '
              f'{our_rate / ref_rate:>6.1f}x |')
    return 0 if same else 1


if __name__ == '__main__':
    sys.exit(main())
