"""numba's disk cache for this folder's kernels, filed by what they are, not where they are.

numba files a cached function under a subfolder named by the sha1 of its source folder's
path and checks the file's stamp ((mtime, size) in numba 0.59, its sha256 in 0.68): a
second checkout, a moved one or a fresh clone of the same sources compiled every kernel
again (1-2 minutes; seen 2026-12-06 in a clone beside /work/main). The cache root is
already one folder per version of these sources (numba_cache_dir), so SourceLocator files
the kernels of this folder directly in it and stamps them with their file's sha256: every
checkout of the same sources on a machine shares one compiled copy. Functions elsewhere
keep numba's own locators. Imports numba (codec.py installs it before any kernel compiles).

A kernel of this folder that compiled but cannot be saved (a full disk, a quota, a file
size limit: numba raised from the first step, a training job's traceback) runs from memory,
with one warning per process; the next process compiles it again (install: the save is
guarded for this folder's kernels only). A cache folder that cannot be written at all
never gets here: SourceLocator steps aside and numba's own locators are asked.
"""
from __future__ import annotations

import errno
import functools
import hashlib
import os
import warnings
from pathlib import Path

import numba
from numba.core import caching

HERE = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def _sha256(path: str, mtime_ns: int, size: int) -> str:
    """The file's sha256 (cached per (mtime, size): a file edited while a process runs is read again)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class SourceLocator(caching._CacheLocator):
    """Cache files of a kernel of kernels/cpu: in numba's CACHE_DIR itself (numba_cache_dir,
    the sources' version), named by module, function and line as numba names them, and valid
    while its file's bytes are the same."""

    def __init__(self, py_func, py_file: str, root: str):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._root = root

    def get_cache_path(self) -> str:
        return self._root

    def get_source_stamp(self) -> str:
        st = os.stat(self._py_file)
        return _sha256(self._py_file, st.st_mtime_ns, st.st_size)

    def get_disambiguator(self) -> str:
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file):
        """This locator for a function of this folder while a cache root is set, else None
        (the next locator is asked)."""
        root = numba.config.CACHE_DIR
        try:
            if not root or Path(py_file).resolve().parent != HERE:
                return None
            self = cls(py_func, py_file, root)
            self.ensure_cache_path()
        except OSError:
            return None
        return self


# what a save that cannot be written raises: no space, over quota, read-only, not allowed,
# a file size limit (ulimit -f)
UNSAVED = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG)
_warned: list = []


def _guarded(save):
    """numba's Cache.save_overload, for a kernel of this folder (SourceLocator) not fatal
    where the cache cannot be written (UNSAVED): the compiled kernel is in memory already."""
    @functools.wraps(save)
    def save_overload(self, sig, data):
        if not isinstance(getattr(getattr(self, "_impl", None), "locator", None), SourceLocator):
            return save(self, sig, data)
        try:
            return save(self, sig, data)
        except OSError as exc:
            if exc.errno not in UNSAVED:
                raise
            if not _warned:
                _warned.append(exc)
                warnings.warn(f"qstate: a compiled CPU kernel could not be saved in {numba.config.CACHE_DIR} "
                              f"({exc.strerror or exc}): it runs from memory, and the next process compiles it "
                              "again (free space there, or set NUMBA_CACHE_DIR)", RuntimeWarning, stacklevel=2)
            return None
    save_overload.qstate_guarded = True
    return save_overload


def install() -> bool:
    """Put SourceLocator first among numba's locators (once), and guard its kernels' cache
    saves (_guarded); False where this numba has no locator list to put it in (numba's own
    locators then cache by path, as before)."""
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)  # 0.68 / 0.59 names
    classes = getattr(impl, "_locator_classes", None)
    if not isinstance(classes, list):
        return False
    if SourceLocator not in classes:
        classes.insert(0, SourceLocator)
    save = getattr(caching.Cache, "save_overload", None)
    if save is not None and not getattr(save, "qstate_guarded", False):
        caching.Cache.save_overload = _guarded(save)
    return True
