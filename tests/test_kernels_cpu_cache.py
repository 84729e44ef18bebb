"""Where the CPU path's compiled kernels are cached (kernels/cpu/__init__.numba_cache_dir):
one folder per version of the kernel sources, since numba invalidates a cached kernel only
when its own file changes, not when an inlined helper in codec.py does; versions unused for
30 days are removed when another starts (cache_in_use); any checkout of the same sources
loads the kernels another compiled (locator.py)."""
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qstate_cli.kernels import cpu

SOURCES = Path(cpu.__file__).parent


def test_folder_is_named_by_the_sources_digest_under_the_qstate_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("QSTATE_CACHE", str(tmp_path))
    files = sorted(SOURCES.glob("*.py")) + [SOURCES.parents[1] / "fp32_math.py"]  # its constants compile in
    assert {f.name for f in files} >= {"codec.py", "adamw.py", "host.py", "fp32_math.py"}
    digest = hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in files)
                            + f"bf16 NaN {cpu.bf16_nan()}".encode()).hexdigest()[:16]
    assert cpu.numba_cache_dir() == tmp_path / "numba" / digest


def test_another_bf16_nan_of_torchs_is_another_folder(monkeypatch, tmp_path):
    """The kernels compile torch's bf16 NaN in (codec.BF16_NAN): a torch that casts NaN to
    other bits (ATEN_CPU_CAPABILITY=default: 0x7FC0) loads kernels of its own."""
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("QSTATE_CACHE", str(tmp_path))
    folders = set()
    for nan in (0xFFFF, 0x7FC0, None):
        monkeypatch.setattr(cpu, "bf16_nan", lambda nan=nan: nan)
        folders.add(cpu.numba_cache_dir())
    assert len(folders) == 3


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
    assert (Path(where) / cpu.USED).is_file()  # marked as used (cache_in_use)


DAY = 86400


def _version(root: Path, name: str, unused_days: float, now: float, mark: bool = True) -> Path:
    """A cache folder as numba leaves it (a subfolder per kernel file), last used `unused_days` ago."""
    folder = root / name
    (folder / "qstate_cli_kernels_cpu_adamw").mkdir(parents=True)
    t = now - unused_days * DAY
    if mark:
        (folder / cpu.USED).touch()
        os.utime(folder / cpu.USED, (t, t))
    os.utime(folder, (t, t))
    return folder


def test_versions_unused_for_30_days_go_when_another_version_starts(monkeypatch, tmp_path):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("QSTATE_CACHE", str(tmp_path))
    now, root = time.time(), tmp_path / "numba"
    kept = [_version(root, "fedcba9876543210", cpu.UNUSED_DAYS - 1, now),  # used 29 days ago
            _version(root, "00000000000000bb", 2, now, mark=False),  # from before the mark, written 2 days ago
            _version(root, "not-a-version", 400, now)]  # not named like a digest: not ours to judge
    _version(root, "0123456789abcdef", cpu.UNUSED_DAYS + 1, now)
    _version(root, "00000000000000aa", cpu.UNUSED_DAYS + 1, now, mark=False)
    current = cpu.cache_in_use(now)
    assert current == cpu.numba_cache_dir()
    assert (current / cpu.USED).stat().st_mtime == pytest.approx(now)
    assert sorted(p.name for p in root.iterdir()) == sorted([current.name] + [p.name for p in kept])


def test_under_numba_cache_dir_only_marked_versions_go(monkeypatch, tmp_path):
    """NUMBA_CACHE_DIR may be shared: a folder without qstate's mark is not removed there."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    now = time.time()
    unmarked = _version(tmp_path, "00000000000000aa", 400, now, mark=False)
    _version(tmp_path, "0123456789abcdef", cpu.UNUSED_DAYS + 1, now)
    current = cpu.cache_in_use(now)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([current.name, unmarked.name])


def test_a_cache_that_cannot_be_written_is_left_alone(monkeypatch):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("QSTATE_CACHE", "/proc/qstate-cannot-write")
    assert cpu.cache_in_use() == cpu.numba_cache_dir()


def _target_features(env_extra: dict) -> list[str]:
    """The features numba's codegen compiles for after importing the CPU codec, in a fresh process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU_")} | env_extra
    code = ("from qstate_cli.kernels.cpu import codec; from numba.core.registry import cpu_target; "
            "print(cpu_target.target_context.codegen()._tm_features)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(",")


def _host_features() -> str:
    from numba.core.codegen import get_host_cpu_features
    return get_host_cpu_features()


def test_an_avx512_host_compiles_for_512_bit_vectors():
    """LLVM's tuning for AVX-512 cores prefers 256-bit vectors; the codec turns that off
    (native.wide_features) and nothing else: the features are the host's plus -prefer-256-bit
    where it has avx512f, the host's alone where it has not."""
    pytest.importorskip("numba")
    host = _host_features().split(",")
    expected = host + ["-prefer-256-bit"] if "+avx512f" in host else host
    assert _target_features({}) == expected


def test_a_target_the_user_chose_is_kept():
    pytest.importorskip("numba")
    host = _host_features()
    assert _target_features({"NUMBA_CPU_FEATURES": host}) == host.split(",")


def test_256_bit_vectors_give_the_reference_bits_too():
    """The kernels at the width a host without AVX-512 compiles them for (256 bits, the host's
    own features without -prefer-256-bit): sr-4bit, the hash and both encoders, against the
    reference with resets, on two threads (the presets test, in a process whose target is
    that). The 512-bit build runs every other parity test on an AVX-512 host."""
    pytest.importorskip("numba")
    host = _host_features()
    if "+avx512f" not in host.split(","):
        pytest.skip("no AVX-512 here: every other test already runs the 256-bit kernels")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU_")} | {"NUMBA_CPU_FEATURES": host}
    root = Path(__file__).parent.parent
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernels_cpu.py",
                          "-k", "presets and sr-4bit"], capture_output=True, text=True, env=env, cwd=root, timeout=1200)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_numba_compiles_reach_the_compile_clock(monkeypatch):
    """codec.py reports numba's compilations to runtime.COMPILES (kernels/cpu/compiling.py):
    a function compiled here (no disk cache) counts once with its seconds and the notice names
    the cache folder; a second call of the same types compiles nothing."""
    numba = pytest.importorskip("numba")
    from qstate_cli import runtime
    from qstate_cli.kernels.cpu import codec  # noqa: F401 - installs the listener

    told = []
    monkeypatch.setattr(runtime.COMPILES, "notice", told.append)
    monkeypatch.setattr(runtime.COMPILES, "_told", False)
    count, seconds = runtime.COMPILES.count, runtime.COMPILES.seconds

    @numba.njit
    def inner(x):
        return x * 3

    @numba.njit
    def outer(x):
        return inner(x) + 1  # compiles inner inside outer's compilation

    held = runtime.COMPILES.held
    assert outer(2) == 7 and outer(5) == 16
    assert runtime.COMPILES.count == count + 1 and runtime.COMPILES.seconds > seconds
    assert len(told) == 1 and numba.config.CACHE_DIR in told[0] and "first use" in told[0]
    assert runtime.COMPILES.held - held >= runtime.COMPILES.seconds - seconds  # compiled inside its lock


def test_a_load_from_numbas_cache_is_held_not_compiled(tmp_path):
    """A kernel loaded from numba's disk cache, in a fresh process, holds numba's compiler lock
    (runtime.COMPILES.held) and compiles nothing: the replay profile's load seconds."""
    pytest.importorskip("numba")
    src = tmp_path / "cached_kernel.py"
    src.write_text("from numba import njit\n\n@njit(cache=True)\ndef triple(x):\n    return x * 3\n")
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); from qstate_cli import runtime;"
             "from qstate_cli.kernels.cpu import codec; import cached_kernel;"
             "c, h = runtime.COMPILES.seconds, runtime.COMPILES.held; cached_kernel.triple(2);"
             "print(runtime.COMPILES.seconds - c, runtime.COMPILES.held - h)")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, "-c", probe, str(tmp_path)], env=env, capture_output=True, text=True,
                           check=True).stdout.split() for _ in range(2)]
    (compiled1, held1), (compiled2, held2) = ([float(v) for v in r] for r in runs)
    assert compiled1 > 0 and held1 >= compiled1  # the first process compiles
    assert compiled2 == 0 and held2 > 0  # the second loads it, inside the lock


def test_two_checkouts_of_the_same_sources_share_the_compiled_kernels(tmp_path):
    """numba files a cache under a folder named by the source folder's path: a second checkout
    of the same sources compiled every kernel again. The kernels of kernels/cpu are filed in
    the version's folder itself (locator.SourceLocator), so a copy of the package elsewhere
    loads what the first compiled: one SGD kernel, 5-7 s, then none."""
    numba = pytest.importorskip("numba")
    import shutil

    package = Path(cpu.__file__).parents[2]  # qstate_cli
    probe = ("import torch; from qstate_cli import runtime; from qstate_cli.optim import SGD; "
             "p = torch.nn.Parameter(torch.randn(8192)); p.grad = torch.randn(8192); "
             "opt = SGD([p], lr=0.01, momentum=0.9, states='m=int8:nearest:b256', min_quant_numel=0); opt.step(); "
             "print(opt.path_for(p), runtime.COMPILES.seconds)")
    numba_path = str(Path(numba.__file__).parents[1])
    seconds = []
    for name in ("a", "b"):
        shutil.copytree(package, tmp_path / name / "qstate_cli", ignore=shutil.ignore_patterns("__pycache__"))
        env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"),
               "PYTHONPATH": os.pathsep.join([str(tmp_path / name), numba_path])}
        out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path / name, env=env, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        path, compiled = out.stdout.split()
        assert path == "cpu-numba"
        seconds.append(float(compiled))
    assert seconds[0] > 0 and seconds[1] == 0, seconds
    (version,) = (tmp_path / "cache").iterdir()
    assert version.name == cpu.numba_cache_dir().name and any(version.glob("sgd.*.nbi"))
    assert not [p for p in version.iterdir() if p.is_dir()]  # no folder per checkout path


def test_the_cli_says_on_stderr_that_it_compiles(monkeypatch, capsys):
    """The root command points the notice at stderr (output.say): a first use compiles for
    minutes and would otherwise look like a hang."""
    from typer.testing import CliRunner

    from qstate_cli import runtime
    from qstate_cli.cli import app

    monkeypatch.setattr(runtime.COMPILES, "notice", None)
    monkeypatch.setattr(runtime.COMPILES, "_told", False)
    assert CliRunner().invoke(app, ["formats", "--json"]).exit_code == 0
    capsys.readouterr()
    runtime.COMPILES.begin("qstate: compiling the CPU kernels for this machine")
    runtime.COMPILES.end()
    assert "qstate: compiling the CPU kernels for this machine" in capsys.readouterr().err


@pytest.mark.parametrize("code, fatal", [("ENOSPC", False), ("EDQUOT", False), ("EROFS", False), ("EFBIG", False),
                                         ("EIO", True)])
def test_a_kernel_that_cannot_be_saved_runs_from_memory(code, fatal, monkeypatch, tmp_path):
    """A full cache disk: the kernel compiled, then numba's save raised ENOSPC out of the
    first optimizer step (a training job's traceback, a bench row failed). Now a save that
    cannot be written warns once and the step goes on; another OSError still raises, and a
    function outside kernels/cpu keeps numba's behaviour."""
    import errno
    import types
    import warnings

    pytest.importorskip("numba")
    from numba.core import caching

    from qstate_cli.kernels.cpu import locator

    locator.install()
    monkeypatch.setattr(locator, "_warned", [])

    def cache(loc):
        obj = object.__new__(caching.FunctionCache)
        obj._impl = types.SimpleNamespace(locator=loc)
        obj._enabled = True

        def refuse(sig, data):
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
        obj._save_overload = refuse
        return obj

    ours = cache(locator.SourceLocator(test_a_kernel_that_cannot_be_saved_runs_from_memory, __file__, str(tmp_path)))
    if fatal:
        with pytest.raises(OSError):
            caching.Cache.save_overload(ours, None, None)
        return
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert caching.Cache.save_overload(ours, None, None) is None
        caching.Cache.save_overload(ours, None, None)
    assert len(seen) == 1 and "could not be saved" in str(seen[0].message)
    with pytest.raises(OSError):  # numba's own locators: numba's behaviour
        caching.Cache.save_overload(cache(types.SimpleNamespace()), None, None)
