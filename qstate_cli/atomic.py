"""Atomic writes that respect what the output already is (results.py re-exports them).

`atomic_path(path)` yields a temporary path in the folder of the file to write and renames
it over that file on success, so readers never see a half-written file, and:

- a new file gets the mode a plain open() would give (0666 less the umask), not
  mkstemp's 0600; a file replaced keeps its mode (a 0600 file stays 0600);
- a symlink's target is written, atomically; the link stays a link;
- an existing output that is not a regular file (a character device such as /dev/null,
  a FIFO, a pipe such as /dev/fd/63) is opened and written where it is: replacing it with
  a regular file would destroy it (as root, /dev/null itself);
- a write that fails because of where it goes (WRITE_ERRNOS: a full disk, a quota, a file
  size limit, an I/O error, a read-only file system, no permission) is a QstateError that
  names the file, `PATH: cannot write (No space left on device)` (exit 2 in the CLI), and
  the temporary file is removed; so is it on any other error and on Ctrl-C or SIGTERM
  (cli/group.py raises a KeyboardInterrupt for it).
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

from .errors import QstateError

# why a write fails that is about where it goes, not about the program: said in one line
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS, errno.EACCES,
                          errno.EPERM})


def umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_target(path: Path) -> Path:
    """The file a write to `path` lands in: a symlink's target (the link stays a link)."""
    path = Path(path)
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def writes_in_place(path) -> bool:
    """Whether `path` is an existing output that is not a regular file (a device, a FIFO, a
    pipe), also through symlinks: it is written where it is, never replaced."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode) and not os.path.isdir(path)
    except OSError:
        return False


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path in the folder of `path`'s target; on success rename it to
    that target (atomic on POSIX), on any error remove it; a device or FIFO: the path
    itself is yielded and written in place (module docstring)."""
    path = Path(path)
    if path.is_dir():
        raise QstateError(f"{path}: is a folder; name a file")
    if writes_in_place(path):
        try:
            yield str(path)
        except OSError as exc:
            raise QstateError(f"{path}: cannot write ({exc.strerror or exc})") from None
        return
    target = write_target(path)
    try:
        old_mode = stat.S_IMODE(os.stat(target).st_mode) if target.is_file() else None
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise QstateError(f"{path}: cannot write ({exc.strerror or exc})") from None
    os.fchmod(fd, 0o666 & ~umask())
    os.close(fd)
    try:
        yield tmp
        if old_mode is not None:  # after the write: a read-only file stays read-only
            os.chmod(tmp, old_mode)
        os.replace(tmp, target)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS:
            raise QstateError(f"{path}: cannot write ({exc.strerror or exc})") from None
        raise
