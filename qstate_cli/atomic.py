"""Atomic writes that respect what the output already is (results.py re-exports them).

`atomic_path(path)` yields a temporary path in the folder of the file to write and renames
it over that file on success, so readers never see a half-written file. A path the user
typed (`--json out.json`) is written where it leads:

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

A file whose name qstate picks inside a folder (`atomic_path(path, picked_in=FOLDER)`: a
suite's OUT/<run>.json, OUT/report.html, reports/<stem>.md, the PNGs of a plots folder, a
trace folder's manifest.json) is always a regular file at that name, inside that folder:

- a symlink at the name is replaced by the file (the rename lands on the link itself; its
  target is left as it was), and so is a FIFO or a device node there: nothing is written
  through it or in place. Replaced, not refused: the name is qstate's own, in qstate's
  folder, so nothing the user made is lost but a link, while a refusal would come after
  the work (a suite's report is written when every point has run) and a link planted in
  a results folder (one unpacked from a tarball, then `qstate run --resume` or `qstate
  report`) could otherwise overwrite any file the user can write;
- the folder holding the file (FOLDER itself, or a folder qstate makes inside it, such as
  a plots folder) must lie inside FOLDER once links are resolved (`check_inside`): one
  that leads elsewhere is refused, `HOLDER: this folder leads outside FOLDER (to ...)`
  (exit 2), which the CLI checks before any work starts.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import tempfile
import time
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


def check_inside(holder, folder) -> Path:
    """Refuse (QstateError) a folder `holder` that qstate writes files it names into, when
    it does not lie inside `folder` once links are resolved (module docstring): a link
    planted in a results folder must not carry qstate's files out of it. A holder that
    does not exist yet resolves by its existing part, as the write would create it."""
    holder, folder = Path(holder), Path(folder)
    real_holder, real_folder = os.path.realpath(holder), os.path.realpath(folder)
    if os.path.commonpath([real_holder, real_folder]) != real_folder:
        raise QstateError(f"{holder}: this folder leads outside {folder} (to {real_holder}); qstate writes the "
                          f"files it names only inside {folder}: remove the link")
    return holder


@contextlib.contextmanager
def atomic_path(path, picked_in=None):
    """Yield a temporary path in the folder of `path`'s target; on success rename it to
    that target (atomic on POSIX), on any error remove it; a device or FIFO: the path
    itself is yielded and written in place. With `picked_in` (a name qstate picked inside
    that folder), the target is `path` itself, never a link's target or a device
    (module docstring)."""
    path = Path(path)
    if picked_in is not None:
        check_inside(path.parent, picked_in)
    if path.is_dir() and (picked_in is None or not path.is_symlink()):
        raise QstateError(f"{path}: is a folder; name a file")
    if picked_in is None and writes_in_place(path):
        try:
            yield str(path)
        except OSError as exc:
            raise QstateError(f"{path}: cannot write ({exc.strerror or exc})") from None
        return
    target = path if picked_in is not None else write_target(path)
    try:
        old = os.lstat(target) if os.path.lexists(target) else None
        old_mode = stat.S_IMODE(old.st_mode) if old is not None and stat.S_ISREG(old.st_mode) else None
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


def write_bytes_atomic(path, data: bytes, picked_in=None) -> Path:
    """Write `data` to `path` through atomic_path (a plot's PNG; results.py writes JSON and text)."""
    with atomic_path(path, picked_in) as tmp, open(tmp, "wb") as fh:
        fh.write(data)
    return Path(path)


def remove_stale_temporaries(folder, names, idle_s: float = 10.0) -> list[Path]:
    """Remove the temporary files atomic_path names for `names` in `folder` (`.NAME.XXXXXXXX.tmp`)
    that a write stopped by SIGKILL, the OOM killer or a power cut left behind (the final
    files are whole; the temporaries were never renamed): regular files not written for
    `idle_s` seconds (a live write's grows as it goes). Returns them."""
    folder = Path(folder)
    now = time.time()
    pattern = re.compile(r"\.(%s)\.[A-Za-z0-9_]{8}\.tmp" % "|".join(re.escape(n) for n in names))
    removed = []
    try:
        entries = list(os.scandir(folder)) if names else []
    except OSError:
        return removed
    for entry in entries:
        if pattern.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            try:
                if now - entry.stat(follow_symlinks=False).st_mtime < idle_s:
                    continue
                os.unlink(entry.path)
                removed.append(Path(entry.path))
            except OSError:
                pass
    return removed
