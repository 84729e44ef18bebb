"""qstate's cache folder holds pickles that numba loads (runtime.cache_dir): whoever can
write in it runs code as us. A folder qstate makes is 0700; one that another user owns
(QSTATE_CACHE naming a shared folder) is refused in one line; one of ours that group or
others may write in (an older qstate made it under umask 002) loses their write
permission; the usual ~/.cache/qstate, 0755 and ours, is fine.
"""
from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.errors import QstateError
from qstate_cli.runtime import cache_dir


def test_a_new_cache_folder_is_private_and_an_existing_0755_one_of_ours_is_used(tmp_path, monkeypatch):
    monkeypatch.setenv("QSTATE_CACHE", str(tmp_path / "new" / "cache"))
    old = os.umask(0o022)
    try:
        assert cache_dir() == tmp_path / "new" / "cache"
    finally:
        os.umask(old)
    assert (tmp_path / "new" / "cache").stat().st_mode & 0o7777 == 0o700
    (tmp_path / "usual").mkdir()
    (tmp_path / "usual").chmod(0o755)
    monkeypatch.setenv("QSTATE_CACHE", str(tmp_path / "usual"))
    assert cache_dir() == tmp_path / "usual" and (tmp_path / "usual").stat().st_mode & 0o7777 == 0o755


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757, 0o1777], ids=oct)
def test_a_cache_folder_of_ours_others_may_write_in_loses_their_write(mode, tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    monkeypatch.setenv("QSTATE_CACHE", str(shared))
    assert cache_dir() == shared
    assert shared.stat().st_mode & 0o7777 == mode & 0o7755


def test_a_cache_folder_whose_write_cannot_be_taken_away_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("QSTATE_CACHE", str(shared))

    def refused(path, mode):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "chmod", refused)
    with pytest.raises(QstateError, match=rf"^cache {shared}: group or others may write in it \(mode 777\) and chmod "
                                          rf"go-w failed \(Operation not permitted\); .*set QSTATE_CACHE"):
        cache_dir()


def test_a_cache_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    uid = theirs.stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: uid + 1)  # we are someone else (works as root and not)
    monkeypatch.setenv("QSTATE_CACHE", str(theirs))
    with pytest.raises(QstateError, match=rf"^cache {theirs}: owned by another user \(uid {uid}\); .*set QSTATE_CACHE"):
        cache_dir()


def test_the_cli_refuses_a_cache_of_another_user_in_one_line(tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    uid = theirs.stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: uid + 1)
    r = CliRunner().invoke(app, ["trace", "corpus"], env={"QSTATE_CACHE": str(theirs), "COLUMNS": "200"})
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cache {theirs}: owned by another user"), lines
