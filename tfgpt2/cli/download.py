"""Download one of OpenAI's GPT-2 checkpoints into <models_dir>/<model_name>, as the original
download_model.py does:

    tfgpt2 download 124M
    tfgpt2 download 355M --models_dir models
    tfgpt2 download 124M --base_url https://mirror.example/gpt-2 --quiet

Each file is written to <file>.part and renamed once complete; a rerun skips the files already
whole and resumes a .part file where the server allows it. Progress: a bar per file on
stderr; --quiet leaves the errors and warnings.
"""
import argparse
import os
import sys

from ..formats.folders import offline
from ..formats.openai_download import BASE_URL, MODEL_NAMES, DownloadError, Unreachable, download_model
from ..hparams import ALIASES, published_name
from .common import add_quiet


def main(argv=None, prog="tfgpt2 download"):
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('model_name', help=f"{', '.join(MODEL_NAMES)} (or {', '.join(ALIASES)})")
    parser.add_argument('--models_dir', default='models', help='default: %(default)s')
    parser.add_argument('--base_url', default=BASE_URL, help='default: %(default)s')
    add_quiet(parser)
    args = parser.parse_args(argv)
    try:
        folder = download_model(args.model_name, args.models_dir, args.base_url, progress=not args.quiet)
    except Unreachable as e:
        print(f'{prog}: error: {e}; {offline(published_name(args.model_name), args.models_dir)}', file=sys.stderr)
        return 1
    except (DownloadError, OSError) as e:
        print(f'{prog}: error: {e}', file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f'{prog}: interrupted; rerun to resume', file=sys.stderr)
        return 130
    print(f'{folder}: {os.path.basename(folder)} complete')
    return 0
