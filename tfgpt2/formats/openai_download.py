"""Download a GPT-2 checkpoint from OpenAI's public storage, as the original download_model.py
(`tfgpt2 download 124M [--models_dir models] [--base_url URL]`):
fills models/124M/ with the seven files of <base_url>/models/124M/.  Each file is written to
<file>.part and renamed once its size equals the server's Content-Length, so a file under its
final name is complete.  A rerun skips the files whose size matches a HEAD request's
Content-Length (it cannot tell a same-sized file that changed on the server), resumes a .part
file where the server answers a Range request with 206, and restarts it where not.  Where the
server cannot be reached at all, a rerun keeps the files it finds under their final names
(unchecked, with a note) and fails only for a missing one.
"""

import os
import re
import sys

import requests
from tqdm import tqdm

from ..hparams import published_name
from .folders import model_path

BASE_URL = 'https://openaipublic.blob.core.windows.net/gpt-2'
MODEL_NAMES = ('124M', '355M', '774M', '1558M')
RENAMED = {'117M': '124M', '345M': '355M'}  # old names, rejected with a hint
FILENAMES = ('checkpoint', 'encoder.json', 'hparams.json', 'model.ckpt.data-00000-of-00001',
             'model.ckpt.index', 'model.ckpt.meta', 'vocab.bpe')
CHUNK_SIZE = 1 << 16
TIMEOUT = (10, 60)  # seconds to connect, and between two reads


class DownloadError(Exception):
    """A download failed; the message is one line that names the URL where there is one."""


class Unreachable(DownloadError):
    """No connection to the server at all (no network, wrong host)."""


def download_model(model_name, models_dir='models', base_url=BASE_URL, *, progress=True):
    """Fetch every file of `model_name` (or Hugging Face's name of it: gpt2, gpt2-medium, ...)
    into models_dir/model_name; returns that folder (made when the first file arrives)."""
    model_name = published_name(model_name)
    check_model_name(model_name)
    folder = model_path(model_name, models_dir)
    with requests.Session() as session:
        for filename in FILENAMES:
            url = f"{base_url.rstrip('/')}/models/{model_name}/{filename}"
            download_file(session, url, os.path.join(folder, filename), progress=progress)
    return folder


def check_model_name(model_name):
    if model_name in RENAMED:
        raise DownloadError(f'{model_name} was renamed {RENAMED[model_name]}; '
                            f'use {RENAMED[model_name]}')
    if model_name not in MODEL_NAMES:
        raise DownloadError(f"unknown model '{model_name}': choose one of {', '.join(MODEL_NAMES)}")


def download_file(session, url, path, *, progress=True):
    """Make `path` the complete file at `url`, unless it has that file's size already."""
    try:
        size = _request(session, 'HEAD', url, allow_redirects=True).headers.get('Content-Length')
    except Unreachable as e:
        if not os.path.isfile(path):
            raise
        print(f'{e}; keeping {path} unchecked', file=sys.stderr)
        return
    if size is None:
        raise DownloadError(f'{url}: the server gives no Content-Length')
    size = int(size)
    if os.path.isfile(path) and os.path.getsize(path) == size:
        return
    part = path + '.part'
    done = os.path.getsize(part) if os.path.isfile(part) else 0
    if done != size:
        _fetch(session, url, part, done if done < size else 0, size, progress)
    got = os.path.getsize(part)
    if got != size:  # where urllib3 (1.x) does not enforce Content-Length itself
        raise DownloadError(f'{url}: received {got} of {size} bytes; rerun to resume')
    os.replace(part, path)


def _fetch(session, url, part, done, size, progress=True):
    """Append the rest of `url` to `part` from byte `done`, or rewrite it from the start."""
    headers = {'Range': f'bytes={done}-'} if done else {}
    with _request(session, 'GET', url, headers=headers, stream=True) as r:
        if r.status_code != 206:
            done = 0
        elif _range_start(r) != done:
            raise DownloadError(
                f'{url}: asked for bytes {done}-, got {r.headers.get("Content-Range")}')
        length = int(r.headers.get('Content-Length', -1))
        if length != size - done:
            raise DownloadError(f'{url}: Content-Length is {length} bytes, but HEAD said '
                                f'{size - done} were left; did the file change? rerun')
        os.makedirs(os.path.dirname(part), exist_ok=True)  # not before: a failed request leaves no folder
        with open(part, 'ab' if done else 'wb') as f, tqdm(
                desc='Fetching ' + url.rsplit('/', 1)[-1], total=size, initial=done,
                ncols=100, unit='B', unit_scale=True, unit_divisor=1024, disable=not progress) as pbar:
            try:
                for chunk in r.iter_content(CHUNK_SIZE):
                    f.write(chunk)
                    pbar.update(len(chunk))
            except requests.RequestException as e:
                raise DownloadError(f'{url}: the connection broke after {f.tell()} of {size} '
                                    f'bytes ({type(e).__name__}); rerun to resume') from None


def _range_start(response):
    match = re.match(r'bytes (\d+)-', response.headers.get('Content-Range', ''))
    return int(match.group(1)) if match else None


def _request(session, method, url, **kwargs):
    """session.request, with every failure, HTTP errors included, as a DownloadError."""
    try:
        r = session.request(method, url, timeout=TIMEOUT, **kwargs)
    except requests.ConnectionError as e:
        raise Unreachable(f'cannot reach {url}: is the network up? ({_reason(e)})') from None
    except requests.RequestException as e:
        raise DownloadError(f'{url}: {type(e).__name__}: {_reason(e)}') from None
    if r.status_code >= 400:
        r.close()
        raise DownloadError(f'HTTP {r.status_code} {r.reason} for {url}')
    return r


def _reason(error):
    """The innermost cause of a requests error, on one line."""
    while error.__context__ is not None:
        error = error.__context__
    return ' '.join(str(error).split())
