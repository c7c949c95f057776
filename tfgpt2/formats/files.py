"""The one way tfgpt2 writes a file or a folder: under a temporary name beside it, moved to its
final name only when complete, so that an interrupted write never leaves part of a file under
a name that a reader (OpenAI's code, TF Serving, a resumed run) would take for whole. What it
writes has the modes of the user's umask (a SavedModel readable by the user TF Serving runs as),
and a command asks `refuse_existing` before it writes over what a user has. A run that
writes a file or folder over time holds a lock file beside it (`hold`, `release`)."""
import contextlib
import fcntl
import os
import secrets
import shutil


@contextlib.contextmanager
def replacing(path):
    """A temporary path beside `path` (same suffix) to write; moved to `path` when the block
    ends without error, else removed."""
    folder, name = os.path.split(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".tmp-{os.getpid()}-{name}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_text(path, text):
    """`path` holds `text` once complete, and never part of it."""
    with replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


def copy_file(source, path):
    with replacing(path) as tmp:
        shutil.copyfile(source, tmp)


@contextlib.contextmanager
def staging(folder, *, last=None):
    """A temporary folder inside `folder` to write files into; when the block ends without
    error each moves to the same place in `folder`, `last` (a relative path) at the end, so
    that its presence says the rest is there. Removed in any case."""
    os.makedirs(folder, exist_ok=True)
    tmp = _temporary_folder(folder, "staging")
    try:
        yield tmp
        files = [os.path.relpath(os.path.join(root, name), tmp) for root, _, names in os.walk(tmp) for name in names]
        for name in sorted(files, key=lambda f: f == last):
            os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
            os.replace(os.path.join(tmp, name), os.path.join(folder, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def new_folder(path):
    """A temporary folder beside `path` to fill; renamed to `path` when the block ends without
    error (a server watching the parent never sees it half written). `path` must not exist."""
    if os.path.exists(path):
        raise FileExistsError(f"{path} exists; choose another name or remove it")
    parent, name = os.path.split(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = _temporary_folder(parent, name)
    try:
        yield tmp
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _temporary_folder(parent, name):
    """A new folder in `parent` under an unused hidden name, made as `os.makedirs` makes one:
    with the umask's mode, not `tempfile.mkdtemp`'s owner-only 0700."""
    path = os.path.join(parent, f".tmp-{name}-{os.getpid()}-{secrets.token_hex(6)}")
    os.mkdir(path)
    return path


def refuse_existing(path, flag="--overwrite"):
    """FileExistsError where `path` is a file, or a folder with anything in it: what a command
    writes never replaces what a user has unless asked (`flag`)."""
    if os.path.isdir(path) and os.listdir(path):
        raise FileExistsError(f"{path} is a folder with files in it; choose another, or pass {flag} "
                              "to write into it (replacing the files of the same names)")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise FileExistsError(f"{path} exists; choose another name, or pass {flag} to replace it")


def hold(path):
    """An exclusive lock on the lock file `path` (made if absent), not waited for: its open
    descriptor, or None while another process holds it. An fcntl lock ends with its process, so
    the file left by a run that died is taken over; one that its holder removed (`release`)
    after this process opened it is opened again, never held unseen."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        if _is_file(fd, path):
            return fd
        os.close(fd)


def release(path, fd):
    """End `hold`'s lock and remove its file: removed while held, so that no run holds the file
    being removed, and none is left behind."""
    os.unlink(path)
    os.close(fd)


def _is_file(fd, path):
    """Whether the open file `fd` is the file at `path` now."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)
