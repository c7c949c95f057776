"""tfgpt2/formats/files.py's lock files (`hold`, `release`), and the run folder's lock
(`train.run_folder.locked`) that holds one while a training run writes its folder: held while
a run lasts, refused to another, taken over from a run that died, and gone once a run ends.
(Another process is played by another open file description: an fcntl lock is theirs.)"""
import os
import socket

import pytest

from tfgpt2.formats.files import hold, release
from tfgpt2.train import run_folder


def test_a_held_lock_file_is_refused_until_released_and_then_gone(tmp_path):
    path = str(tmp_path / "out.jsonl.lock")
    fd = hold(path)
    assert fd is not None and hold(path) is None
    release(path, fd)
    assert not os.path.exists(path)
    again = hold(path)
    assert again is not None
    release(path, again)


def test_a_lock_file_left_by_a_run_that_died_is_taken_over(tmp_path):
    path = tmp_path / ".lock"
    path.write_text("pid 1 on a machine\n")  # its process gone, its fcntl lock with it
    fd = hold(str(path))
    assert fd is not None and hold(str(path)) is None
    release(str(path), fd)
    assert not path.exists()


def test_the_run_folders_lock_names_its_run_and_goes_with_it(tmp_path):
    """Held while the block runs (its pid and host in it; a second run refused, naming them);
    removed when the block ends, whether it wrote the folder or raised; a folder made for a
    run that wrote nothing is removed with it."""
    run_dir = tmp_path / "checkpoint" / "run1"
    with run_folder.locked(str(run_dir)):
        me = f"pid {os.getpid()} on {socket.gethostname()}"
        assert (run_dir / ".lock").read_text() == me + "\n"
        with pytest.raises(BlockingIOError, match=rf"run1 is in use by another training run \({me}, which holds "
                                                  rf"\S+run1/\.lock\): wait for it to end"):
            with run_folder.locked(str(run_dir)):
                pass
        (run_dir / "counter").write_text("1")
    assert os.listdir(run_dir) == ["counter"]
    with pytest.raises(ValueError), run_folder.locked(str(run_dir)):
        raise ValueError("a run that failed")
    assert os.listdir(run_dir) == ["counter"]
    with run_folder.locked(str(tmp_path / "new" / "run2")):
        pass
    assert not (tmp_path / "new").exists()
