"""Pre-encode a corpus into an .npz of token chunks, as the forks' `encode.py`, so that
training starts without encoding it again.

    tfgpt2 encode corpus/ corpus.npz --model_name 124M --combine 50000
    tfgpt2 encode "texts/*.txt" texts.npz --quiet

The chunks are `np.savez_compressed(out, *chunks)` (arrays arr_0, arr_1, ...), which
`tfgpt2 train --dataset corpus.npz` and the forks' train.py read. OUT_NPZ is a file name
(.npz is added where it lacks it), never a folder; an existing file is replaced only with
--overwrite. Progress: a line on stderr for each stage; --quiet leaves the result line.
"""
import argparse
import os
import sys

import numpy as np

from ..encoder import get_encoder
from ..formats.files import refuse_existing, replacing
from ..train.data import DatasetError, load_dataset
from .args import Parser, ranged
from .common import add_text_flags, parse


def main(argv=None, prog="tfgpt2 encode"):
    p = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("in_text", help="a text file, a folder or a glob")
    p.add_argument("out_npz", help="the .npz file to write (not a folder)")
    p.add_argument("--model_name", default="124M", help="whose encoder.json and vocab.bpe (else the shipped copy)")
    p.add_argument("--models_dir", default="models")
    p.add_argument("--combine", type=ranged(int, 1), default=50000,
                   help="join files with <|endoftext|> until at least this many characters per chunk")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT_NPZ")
    add_text_flags(p, "the text files'")
    args, progress = parse(p, argv)
    out = args.out_npz if args.out_npz.endswith(".npz") else args.out_npz + ".npz"
    if os.path.isdir(args.out_npz) or args.out_npz.endswith(os.sep):
        p.error(f"{args.out_npz} is a folder; name the .npz file to write in it, e.g. "
                f"{os.path.join(args.out_npz, 'corpus.npz')}")
    try:
        if not args.overwrite:
            refuse_existing(out)
        enc = get_encoder(args.model_name, args.models_dir)
        progress.note(f"reading and encoding {args.in_text}")
        chunks = load_dataset(enc, args.in_text, combine=args.combine, encoding=args.encoding)
        if not chunks:
            raise DatasetError(f"{args.in_text}: no text to encode")
        progress.note(f"writing {out}")
        with replacing(out) as tmp:  # ends with .npz, to which savez adds nothing
            np.savez_compressed(tmp, *chunks)
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {out}: {sum(c.size for c in chunks)} tokens in {len(chunks)} chunks "
          f"in {progress.seconds():.1f} s")
