"""`tfgpt2 download` (`tfgpt2.formats.openai_download`) against a fake of OpenAI's storage on 127.0.0.1."""
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.helpers import ROOT, Storage, free_port, serving
from tfgpt2.cli import download as download_cli
from tfgpt2.formats import openai_download as dm

BIG = 'model.ckpt.data-00000-of-00001'


def fake_model(seed=0):
    """{filename: bytes}; the data file spans several download chunks."""
    rng = random.Random(seed)
    sizes = {BIG: 5 * dm.CHUNK_SIZE + 123, 'model.ckpt.meta': 20_000}
    return {name: rng.randbytes(sizes.get(name, 300)) for name in dm.FILENAMES}


@pytest.fixture
def storage():
    """A Storage of fake_model() as 124M, serving on an ephemeral port; .url is its base URL."""
    files = fake_model()
    store = Storage({f'/models/124M/{name}': data for name, data in files.items()})
    store.model = files
    with serving(store):
        yield store


def assert_complete(folder, files):
    assert sorted(p.name for p in Path(folder).iterdir()) == sorted(files)
    for name, data in files.items():
        assert (Path(folder) / name).read_bytes() == data, name


def run_cli(*args):
    """`tfgpt2 download ARGS` as the console script runs it, in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != 'TF_CPP_MIN_LOG_LEVEL'}
    env['PYTHONPATH'] = str(ROOT)
    return subprocess.Popen([sys.executable, '-m', 'tfgpt2_cli', 'download', *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(child):
    out, err = child.communicate(timeout=120)
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


def run_main(capsys, *args):
    """`tfgpt2 download ARGS` run in this process: (exit status, stdout, stderr)."""
    code = download_cli.main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def assert_one_line_error(result, *fragments):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert 'Traceback' not in result.stderr
    assert lines[-1].startswith('tfgpt2 download: error: '), result.stderr
    for fragment in fragments:
        assert fragment in lines[-1]


def test_complete_download(storage, tmp_path):
    folder = dm.download_model('124M', tmp_path / 'models', storage.url)
    assert Path(folder) == tmp_path / 'models' / '124M'
    assert_complete(folder, storage.model)
    assert sorted(storage.gets()) == sorted(storage.files)


def test_hugging_faces_name_downloads_the_size(storage, tmp_path):
    folder = dm.download_model('gpt2', tmp_path / 'models', storage.url)
    assert Path(folder) == tmp_path / 'models' / '124M'
    assert_complete(folder, storage.model)


@pytest.mark.slow  # a fresh TensorFlow process
def test_cli_complete_download(storage, tmp_path):
    """The command shows a bar per file on stderr and says where the model is on stdout; with
    --quiet, stdout alone. Nothing of TensorFlow's start-up reaches stderr."""
    loud, quiet = (run_cli('124M', '--models_dir', str(tmp_path / name), '--base_url', storage.url + '/', *flags)
                   for name, flags in (('loud', []), ('quiet', ['--quiet'])))
    for result, name in ((finish(loud), 'loud'), (finish(quiet), 'quiet')):
        assert result.returncode == 0, result.stderr
        assert result.stdout == f'{tmp_path / name / "124M"}: 124M complete\n'
        assert_complete(tmp_path / name / '124M', storage.model)
        if name == 'loud':
            assert 'Fetching ' + BIG in result.stderr
            assert 'absl' not in result.stderr and 'cudart' not in result.stderr, result.stderr
        else:
            assert result.stderr == ''


@pytest.mark.parametrize('ranges', [True, False], ids=['resume', 'restart'])
def test_cut_connection_then_rerun(storage, tmp_path, ranges):
    storage.ranges = ranges
    path = f'/models/124M/{BIG}'
    storage.cut[path] = 2 * dm.CHUNK_SIZE + 7
    with pytest.raises(dm.DownloadError, match=f'{storage.url}{path}: the connection broke'):
        dm.download_model('124M', tmp_path, storage.url)
    folder = tmp_path / '124M'
    assert not (folder / BIG).exists()
    kept = (folder / (BIG + '.part')).stat().st_size
    assert 0 < kept <= 2 * dm.CHUNK_SIZE + 7
    del storage.requests[:]
    dm.download_model('124M', tmp_path, storage.url)
    assert_complete(folder, storage.model)
    [(_, _, asked)] = [r for r in storage.requests if r[:2] == ('GET', path)]
    assert asked == f'bytes={kept}-'


def test_body_shorter_than_content_length(storage, tmp_path):
    path = f'/models/124M/{BIG}'
    storage.promise[path] = len(storage.model[BIG]) + 1000
    for attempt in range(2):
        with pytest.raises(dm.DownloadError, match=f'{storage.url}{path}: the connection broke'):
            dm.download_model('124M', tmp_path, storage.url)
        assert not (tmp_path / '124M' / BIG).exists()


def test_short_body_is_caught_without_urllib3_enforcing_length(storage, tmp_path, monkeypatch):
    """urllib3 1.x ends a short body silently; the size check before the rename catches it."""
    iter_content = requests.Response.iter_content

    def lenient(self, *args, **kwargs):
        try:
            yield from iter_content(self, *args, **kwargs)
        except requests.RequestException:
            return
    monkeypatch.setattr(requests.Response, 'iter_content', lenient)
    path = f'/models/124M/{BIG}'
    storage.cut[path] = dm.CHUNK_SIZE
    with pytest.raises(dm.DownloadError, match=f'{storage.url}{path}: received {dm.CHUNK_SIZE} of'):
        dm.download_model('124M', tmp_path, storage.url)
    assert not (tmp_path / '124M' / BIG).exists()
    dm.download_model('124M', tmp_path, storage.url)
    assert_complete(tmp_path / '124M', storage.model)


def test_body_longer_than_content_length(storage, tmp_path):
    path = f'/models/124M/{BIG}'
    storage.grow[path] = b'more'
    with pytest.raises(dm.DownloadError, match=f'{storage.url}{path}: Content-Length'):
        dm.download_model('124M', tmp_path, storage.url)
    assert not (tmp_path / '124M' / BIG).exists()


def test_404_names_the_url(storage, tmp_path):
    del storage.files['/models/124M/vocab.bpe']
    with pytest.raises(dm.DownloadError) as error:
        dm.download_model('124M', tmp_path, storage.url)
    assert str(error.value) == f'HTTP 404 Not Found for {storage.url}/models/124M/vocab.bpe'
    assert not (tmp_path / '124M' / 'vocab.bpe').exists()
    assert (tmp_path / '124M' / BIG).read_bytes() == storage.model[BIG]


def test_complete_files_are_not_fetched_again(storage, tmp_path):
    folder = Path(dm.download_model('124M', tmp_path, storage.url))
    (folder / 'hparams.json').write_bytes(b'{}')  # truncated, as the original script can leave
    (folder / 'vocab.bpe').unlink()
    (folder / 'encoder.json').rename(folder / 'encoder.json.part')  # complete but not renamed
    del storage.requests[:]
    dm.download_model('124M', tmp_path, storage.url)
    assert_complete(folder, storage.model)
    assert sorted(storage.gets()) == ['/models/124M/hparams.json', '/models/124M/vocab.bpe']
    assert len(storage.requests) == len(dm.FILENAMES) + 2


def test_offline_rerun_keeps_complete_files(storage, tmp_path, capfd):
    """Files under their final names were written whole, so without a network a rerun keeps
    them (saying so) and fails only for a missing file."""
    folder = Path(dm.download_model('124M', tmp_path, storage.url))
    offline = f'http://127.0.0.1:{free_port()}'
    assert dm.download_model('124M', tmp_path, offline) == str(folder)
    assert_complete(folder, storage.model)
    assert capfd.readouterr().err.count('unchecked') == len(dm.FILENAMES)
    (folder / 'vocab.bpe').unlink()
    with pytest.raises(dm.DownloadError, match=r'cannot reach .*/models/124M/vocab\.bpe'):
        dm.download_model('124M', tmp_path, offline)


@pytest.mark.parametrize('model_name, server, fragments', [
    ('2B', 'up', ["unknown model '2B'", '124M, 355M, 774M, 1558M']),
    ('117M', 'up', ['117M was renamed 124M']),
    ('355M', 'up', ['HTTP 404', '/models/355M/checkpoint']),
    ('124M', 'down', ['cannot reach http://127.0.0.1:', 'Connection refused',
                      'offline, `tfgpt2 make-checkpoint 124M --models_dir ']),
])
def test_cli_errors_are_one_line(storage, tmp_path, capsys, model_name, server, fragments):
    url = storage.url if server == 'up' else f'http://127.0.0.1:{free_port()}'
    result = run_main(capsys, model_name, '--models_dir', str(tmp_path / 'models'), '--base_url', url)
    assert_one_line_error(result, *fragments)
    assert not (tmp_path / 'models').exists()  # no empty models/<name>/ left behind
    if model_name not in dm.MODEL_NAMES:
        assert storage.requests == []
