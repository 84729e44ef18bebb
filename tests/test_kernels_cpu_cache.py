"""Where the CPU path's compiled kernels are cached (kernels/cpu/__init__.numba_cache_dir):
one folder per version of the kernel sources, since numba invalidates a cached kernel only
when its own file changes, not when an inlined helper in codec.py does."""
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qstate_cli.kernels import cpu

SOURCES = Path(cpu.__file__).parent


def test_folder_is_named_by_the_sources_digest_under_the_qstate_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("QSTATE_CACHE", str(tmp_path))
    files = sorted(SOURCES.glob("*.py"))
    assert {f.name for f in files} >= {"codec.py", "adamw.py", "host.py"}
    digest = hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in files)).hexdigest()[:16]
    assert cpu.numba_cache_dir() == tmp_path / "numba" / digest


def test_numba_cache_dir_is_the_root_of_the_per_version_folders(monkeypatch, tmp_path):
    """Under NUMBA_CACHE_DIR too, one folder per source version: with the bare folder an
    edited rounding.py (inlined into adamw.py's kernels) loaded the kernels compiled before."""
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("QSTATE_CACHE", str(tmp_path))
    digest = cpu.numba_cache_dir().name
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "mine"))
    assert cpu.numba_cache_dir() == tmp_path / "mine" / digest and len(digest) == 16


def test_codec_points_numba_there_before_compiling(tmp_path):
    pytest.importorskip("numba")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["QSTATE_CACHE"] = str(tmp_path)
    code = ("import numba; from qstate_cli.kernels.cpu import codec, numba_cache_dir; "
            "print(numba.config.CACHE_DIR == str(numba_cache_dir()), numba.config.CACHE_DIR)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    ok, where = out.stdout.split()
    assert ok == "True" and where.startswith(str(tmp_path / "numba"))
