"""Shared test settings: deterministic threads, hypothesis profile, Triton's interpreter for
the kernel tests when there is no GPU, and the markers that skip on a stack without what a
test needs: cuda (a CUDA device), triton (a Triton that qstate_cli.kernels runs the kernels
on), fsdp2_on_gloo (torch >= 2.9) and schema (pydantic >= 2.5)."""
import functools
import os
import re

import pytest
import torch

# Under pytest-xdist the workers share the cores: each gets its share of threads.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # xdist's workers get COLUMNS=80 / LINES=24; a plain run has neither, and the CLI's
    # tables are then 160 wide when piped (cli/output.py), which the tests read.
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)

if not torch.cuda.is_available():
    # The kernels run in Triton's interpreter on CPU tensors. Triton reads this when a
    # kernel is decorated, so it must be set before anything imports the kernel modules.
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    from hypothesis import settings

    # CI: fixed examples (deterministic). QSTATE_HYPOTHESIS=wide explores afresh, longer.
    settings.register_profile("qstate", max_examples=60, deadline=None, derandomize=True, database=None)
    settings.register_profile("wide", max_examples=600, deadline=None, database=None)
    settings.load_profile(os.environ.get("QSTATE_HYPOTHESIS", "qstate"))
except ImportError:  # pragma: no cover
    pass


@pytest.fixture
def one_thread():
    """One intra-op thread for tests of many tiny ops: on a small, loaded CPU, OpenMP's
    fork/join per op makes them many times slower (nothing asserts on time); restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Test files of the replay's fused CPU path: they share its numba kernels (the replay codec's
# first compile alone is ~100 s on a 2-core machine), so `make test-cpu-path` (`--dist
# loadgroup`) runs them on one worker, while the optimizer kernels' tests, each compiling its
# own kernel, spread over the other workers one test at a time (pytest_xdist_make_scheduler).
REPLAY_CPU_FILES = {"test_replay_codec_cpu.py", "test_replay_stats_cpu.py", "test_replay_model_cpu.py",
                    "test_replay_gauss_cpu.py", "test_replay_rule_cpu.py", "test_replay_step_cpu.py",
                    "test_torch_sum_cpu.py"}


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: ignored where xdist is not installed
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`: the replay CPU files as one unit of work, every other test its own.
    xdist's own loadgroup reads `xdist_group` marks from a suffix it writes into each item's
    `_nodeid`, which pytest 9.2's `nodeid` no longer reads (it is built from `_id`), so with
    xdist 3.8 the marked tests were spread over both workers; the units are drawn here, from
    the node ids themselves. Other --dist modes keep xdist's own schedulers."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ReplayFilesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ReplayFilesTogether(config, log)


def work_unit(nodeid: str) -> str:
    """The unit of work of a test under `--dist loadgroup` (pytest_xdist_make_scheduler)."""
    return "replay-cpu" if nodeid.split("::")[0].rsplit("/", 1)[-1] in REPLAY_CPU_FILES else nodeid


# FSDP2 (fully_shard) on the CPU, over gloo, works from torch 2.9 (README): 2.6's CPU
# Stream has no record_event, 2.7 refuses ReduceOp.AVG on gloo, 2.8 sums the gradients
# where it should average them. Tests that run fully_shard on gloo carry this marker.
FSDP2_ON_GLOO = (2, 9)
TORCH = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())


@functools.lru_cache(maxsize=None)
def triton_problem() -> str | None:
    """Why the Triton kernels cannot run in these tests, or None. qstate_cli.kernels decides
    (triton_version_problem: MIN_TRITON compiled for CUDA, MIN_TRITON_INTERPRET in Triton's
    interpreter), as its optimizers do when they fall back to the reference path. Tests that
    need the kernels to run carry the `triton` marker; a module that imports the kernels at
    import time skips itself with this (test_kernels_launch.py)."""
    from qstate_cli import kernels

    try:
        import triton
    except Exception as exc:  # noqa: BLE001 - as kernels._triton_import_error
        return f"triton is not importable: {exc}"
    version = getattr(triton, "__version__", None)
    if torch.cuda.is_available():
        return kernels.triton_version_problem(version, kernels.MIN_TRITON)
    return kernels.triton_version_problem(version, kernels.MIN_TRITON_INTERPRET, " in Triton's interpreter")


def fsdp2_on_gloo_problem() -> str | None:
    """Why FSDP2 on gloo cannot run on this torch, or None (FSDP2_ON_GLOO)."""
    if TORCH >= FSDP2_ON_GLOO:
        return None
    return (f"FSDP2 on the CPU (gloo) needs torch >= {'.'.join(map(str, FSDP2_ON_GLOO))}, this is torch "
            f"{torch.__version__} (2.6: CPU Stream has no record_event; 2.7: gloo refuses ReduceOp.AVG; "
            "2.8: gradients are summed, not averaged)")


def schema_problem() -> str | None:
    """Why the suite schema (pydantic's) cannot load here, or None: a test that asserts
    pydantic's messages skips where suites get the basic check (the GPU machine: no pydantic)."""
    try:
        import qstate_cli.suites.schema  # noqa: F401
    except ImportError as exc:
        return f"the suite schema needs pydantic >= 2.5 ({exc})"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "triton: runs the Triton kernels (skipped where qstate_cli.kernels "
                                       "refuses this Triton: conftest.triton_problem)")
    config.addinivalue_line("markers", "fsdp2_on_gloo: runs FSDP2 (fully_shard) on gloo (skipped on torch < 2.9)")
    config.addinivalue_line("markers", "schema: asserts the pydantic suite schema's messages (skipped without it)")


def pytest_collection_modifyitems(config, items):
    cuda = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    fsdp2 = fsdp2_on_gloo_problem()
    for item in items:
        if cuda is not None and "cuda" in item.keywords:
            item.add_marker(cuda)
        if fsdp2 is not None and item.get_closest_marker("fsdp2_on_gloo") is not None:
            item.add_marker(pytest.mark.skip(reason=fsdp2))
        if item.get_closest_marker("triton") is not None and triton_problem() is not None:
            item.add_marker(pytest.mark.skip(reason=triton_problem()))
        if item.get_closest_marker("schema") is not None and schema_problem() is not None:
            item.add_marker(pytest.mark.skip(reason=schema_problem()))
