"""matplotlib's config folder where its default cannot be written (a read-only HOME), set
before matplotlib is imported: `qstate report`'s plots (report/plots.py) and `bench train
--plot` (train/plot.py) call `prepare()` first."""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

from .errors import QstateError


def _writable(folder: Path) -> bool:
    """matplotlib's test of its config and cache folders: made if missing, then writable."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return folder.is_dir() and os.access(folder, os.W_OK)


def prepare() -> None:
    """MPLCONFIGDIR set where matplotlib's default folders ($XDG_CONFIG_HOME/matplotlib,
    $XDG_CACHE_HOME/matplotlib, under ~/.config and ~/.cache without them) cannot be written
    (a read-only HOME): qstate's cache/matplotlib, else a temporary folder removed at exit.
    matplotlib would make that temporary folder itself, saying so in two long warnings on
    every report, and rebuild its font cache in it each run."""
    if os.environ.get("MPLCONFIGDIR") or not sys.platform.startswith(("linux", "freebsd")):
        return
    try:
        home = Path.home()
    except RuntimeError:  # no home directory: matplotlib falls back too
        home = None
    defaults = []
    for var, under in (("XDG_CONFIG_HOME", ".config"), ("XDG_CACHE_HOME", ".cache")):
        base = os.environ.get(var) or (home / under if home else None)
        defaults.append(Path(base, "matplotlib").resolve() if base else None)
    if all(folder is not None and _writable(folder) for folder in defaults):
        return
    from . import runtime

    try:
        ours = runtime.cache_dir() / "matplotlib"
    except QstateError:  # a cache folder refused (another user's): not ours to write
        ours = None
    if ours is not None and _writable(ours):
        os.environ["MPLCONFIGDIR"] = str(ours)
        return
    try:
        folder = tempfile.mkdtemp(prefix="qstate-matplotlib-")
    except OSError:
        return  # no temporary folder either: matplotlib says so itself
    atexit.register(shutil.rmtree, folder, True)
    os.environ["MPLCONFIGDIR"] = folder
