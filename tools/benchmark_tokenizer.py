#!/usr/bin/env python3
"""Tokens per second of tfgpt2's encoder against OpenAI's src/encoder.py, on the same text.

    python tools/benchmark_tokenizer.py [--mb 2] [--runs 5] [--shared ../shared]

Both read <shared>/gpt2-vocab; the reference is <shared>/openai-gpt-2/src/encoder.py (it needs
the regex package); where it is absent, tfgpt2 runs alone (its packaged vocabulary).  The text is
generated from a seed: vocabulary tokens, numbers, several scripts, emoji, code and
contractions, joined by varied whitespace.  Each figure is the median and range of --runs timed
runs after one untimed run, so the reference's BPE cache is warm, as in use.  The report
(tools/report.py) goes to `--report DIR` as `--name`.json and .md (default tokenizer);
the exit status is 1 where the two tokenizers' ids differ.
"""

import argparse
import importlib.util
import os
import random
import sys
import time
from pathlib import Path

from tfgpt2 import encoder as tfgpt2_encoder

try:
    from . import report
except ImportError:  # run as `python tools/benchmark_tokenizer.py`: this folder is on sys.path
    import report

ROOT = Path(report.ROOT)

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


def rates(fn, n_tokens, runs):
    """Tokens per second of each of `runs` calls fn(), after one untimed call."""
    fn()
    found = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        found.append(n_tokens / (time.perf_counter() - start))
    return found


def load_reference(shared):
    """OpenAI's encoder on <shared>/gpt2-vocab, or None where its code or vocabulary is absent."""
    path = shared / 'openai-gpt-2' / 'src' / 'encoder.py'
    if not path.is_file() or not (shared / 'gpt2-vocab' / 'encoder.json').is_file():
        return None
    spec = importlib.util.spec_from_file_location('reference_encoder', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_encoder('gpt2-vocab', str(shared))


COLUMNS = [report.column('operation', 'operation'), report.column('tokens', 'tokens', ','),
           report.column('reference', 'reference tokens/s', ',.0f'), report.column('tfgpt2', 'tfgpt2 tokens/s', ',.0f'),
           report.column('speedup', 'speedup', '.1f')]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--mb', type=float, default=2.0, help='text size in millions of characters')
    parser.add_argument('--runs', type=int, default=5)
    parser.add_argument('--shared', type=Path,
                        default=Path(os.environ.get('TFGPT2_SHARED', ROOT.parent / 'shared')))
    report.add_arguments(parser, 'tokenizer')
    args = parser.parse_args(argv)
    reference = load_reference(args.shared)
    if reference is None:
        ours = tfgpt2_encoder.default_encoder()
        print(f'{args.shared}: no OpenAI encoder.py and vocabulary there; tfgpt2 alone', file=sys.stderr)
    else:
        ours = tfgpt2_encoder.get_encoder('gpt2-vocab', str(args.shared))
    text = make_text(ours, int(args.mb * 1e6))
    lines = text.splitlines(keepends=True)
    ids = ours.encode(text)
    same = None if reference is None else ids == reference.encode(text)
    n_batch = sum(map(len, ours.encode_batch(lines)))
    operations = [
        ('encode (one text)', len(ids), lambda: reference.encode(text), lambda: ours.encode(text)),
        ('encode_batch (lines)', n_batch, lambda: [reference.encode(line) for line in lines],
         lambda: ours.encode_batch(lines)),
        ('decode', len(ids), lambda: reference.decode(ids), lambda: ours.decode(ids)),
    ]
    rows = []
    for name, n_tokens, ref_fn, our_fn in operations:
        print(f'measuring {name} ...', file=sys.stderr, flush=True)
        row = {'operation': name, 'tokens': n_tokens, 'reference': None, 'speedup': None,
               'tfgpt2': report.spread(rates(our_fn, n_tokens, args.runs))}
        if reference is not None:
            row['reference'] = report.spread(rates(ref_fn, n_tokens, args.runs))
            row['speedup'] = row['tfgpt2']['median'] / row['reference']['median']
        rows.append(row)
    notes = [f'{len(text):,} characters of generated text (seed 0: vocabulary tokens, numbers, several scripts, '
             f'emoji, code), {len(lines):,} lines, {len(ids):,} tokens; tokens per second, median and range of '
             f'{args.runs} runs after a warm-up one, in one process.',
             'The reference: OpenAI\'s src/encoder.py, absent here.' if reference is None else
             f'The reference: OpenAI\'s src/encoder.py; ids identical to tfgpt2\'s: {"yes" if same else "NO"}.']
    headlines = [{'what': f'tokenizer, {r["operation"]}',
                  'figure': f'{r["tfgpt2"]["median"]:,.0f} tokens/s'
                  + (f', {r["speedup"]:.1f}x the reference' if r['speedup'] else '')}
                 for r in rows if r['operation'] == 'encode (one text)']
    settings = {'mb': args.mb, 'runs': args.runs, 'characters': len(text), 'lines': len(lines),
                'tokens': len(ids), 'reference': reference is not None, 'identical_ids': same}
    report.publish(args, 'Tokenizer speed', [report.table(COLUMNS, rows)], tool=__file__, argv=argv,
                   settings=settings, notes=notes, headlines=headlines)
    return 1 if same is False else 0


if __name__ == '__main__':
    sys.exit(main())
