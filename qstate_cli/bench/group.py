"""One group of `qstate bench kernels` rows (one size or model, one dtype), timed in rounds
beside same-run references.

Every subject's optimizer is built over the group's tensors first; then the steps and the
references are timed interleaved in R rounds (timing.measure_rounds: A B C, C B A, ...),
so a change in machine load during the group hits every row and its references alike.
The references are never rows of their own; each row carries them:

    ref_copy_ms      median time of a copy of bytes_moved / 8 fp32 values (bytes read +
                     written = the row's own bytes_moved): the same bytes at copy speed
    time_rel_copy    time_ms / ref_copy_ms (how many copies of its own footprint a step costs)
    footprint_copy_gbps, cache_resident
                     the copy bandwidth at the row's own footprint, and whether the row
                     sits in cache (then pct_of_copy is null): roofline.py
    rel_copy_rounds  per round r: median(row, round r) / median(copy, round r)
    ref_fused_ms     median time of torch's fused AdamW over the same tensors
                     (torch.optim.AdamW(fused=True), whatever the optimizer)
    time_rel_fused   time_ms / ref_fused_ms
    round_ms         per round r: median(row, round r), ms
    cpu_share        CPU time / wall time of a busy loop probed before each round and after
                     the last (timing.cpu_share): ~1.0 on a quiet machine

A ratio to a reference measured in the same seconds cancels what slows both alike (clock,
thermal state, a neighbour's memory traffic); cpu_share tells when the machine was shared
so much that nothing measured here means much (compare/noise.py turns that into "noisy").
"""
from __future__ import annotations

import torch

from ..errors import QstateError
from ..runtime import free_memory, is_oom
from .bytes_model import gbps
from .roofline import mark as mark_roofline
from .subjects import Context, Subject, Unavailable
from .timing import CaptureFailed, Item, copy_item, measure_rounds


def failure(subject: Subject, exc: BaseException) -> dict:
    """status and reason of a row whose step raised: out of memory is "failed" (the sweep
    goes on), a baseline that cannot run here is "unavailable", anything else "failed"."""
    if is_oom(exc):
        return {"status": "failed", "reason": f"out of memory: {exc}"}
    status = "unavailable" if subject.role == "baseline" else "failed"
    return {"status": status, "reason": f"{type(exc).__name__}: {exc}"}


def status_of(subject: Subject, exc: BaseException) -> dict:
    """The row's status and reason for an exception raised building or timing it."""
    if isinstance(exc, Unavailable):
        return {"status": "unavailable", "reason": str(exc)}
    if isinstance(exc, CaptureFailed):
        return {"status": "unavailable", "reason": f"CUDA graph capture failed: {exc}"}
    if isinstance(exc, QstateError):  # e.g. backend='triton' where the kernels cannot run
        return {"status": "unavailable", "reason": str(exc)}
    return failure(subject, exc)


def fill_timing(row: dict, timing, compiles: bool = False) -> None:
    st = timing.stats
    row.update(time_ms=st.median, time_ms_iqr=st.iqr, time_ms_min=st.min,
               samples_ms=[float(f"{s:.6g}") for s in st.samples], noisy=st.noisy, reps=timing.reps,
               first_step_ms=timing.first_ms, l2_flush_bytes=timing.flush_bytes,
               gbps=gbps(row["bytes_moved"], st.median))
    if compiles:  # torch.compile: the first step's excess over a step
        row["compile_ms"] = max(0.0, timing.first_ms - st.median)
    elif timing.compile_ms > 0:  # the CPU path's numba kernels compiled in the first step (a first use)
        row["compile_ms"] = timing.compile_ms
    if row.get("copy_gbps"):
        row["pct_of_copy"] = 100.0 * row["gbps"] / row["copy_gbps"]


def _copy_item(nbytes: int, device: torch.device) -> Item:
    """A copy moving `nbytes` (read + written) of random fp32 values."""
    return copy_item(device, max(1, nbytes // 8))


def _fused_item(params, rotate) -> Item:
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, fused=True)
    return Item(opt.step, rotate)


def _reference(make, device):
    """A reference item, or None where it cannot be made here (out of memory, no fused
    AdamW for this device or dtype): its columns are then null."""
    try:
        return make()
    except Exception as exc:  # noqa: BLE001 - a reference is optional
        if is_oom(exc):
            free_memory(device)
        return None


def _round_ratios(num: list[float], den: list[float]) -> list[float]:
    return [float(f"{a / b:.6g}") for a, b in zip(num, den) if b > 0]


def measure_group(jobs: list[tuple[dict, Subject, Context]], tensors, p) -> None:
    """Build, time (rounds, references) and fill every row of one group; failures become
    statuses. `jobs`: (row, subject, context) with the row made by base_row; `tensors`:
    the group's parameters and gradient sets; `p`: the plan (device, rounds, budgets)."""
    built = []  # (row, subject, optimizer)
    for row, subject, ctx in jobs:
        try:
            opt, path = subject.build(tensors.params, ctx)
        except Exception as exc:  # noqa: BLE001 - one bad row must not end the sweep
            row.update(status_of(subject, exc))
            continue
        row["path"] = path
        built.append((row, subject, opt))
    if not built:
        return
    try:
        footprints = sorted({row["bytes_moved"] for row, _, _ in built})
        copies = {b: _reference(lambda b=b: _copy_item(b, p.device), p.device) for b in footprints}
        fused = _reference(lambda: _fused_item(tensors.params, tensors.rotate), p.device)
        items = [Item(opt.step, tensors.rotate, p.cuda_graph) for _, _, opt in built]
        refs = [c for c in copies.values() if c is not None] + ([fused] if fused is not None else [])
        result = measure_rounds(items + refs, p.device, p.rounds, p.warmup_ms, p.rep_ms)
        timed = dict(zip([id(i) for i in items + refs], result.items))
        share = result.cpu_share
        for (row, subject, _), item in zip(built, items):
            got = timed[id(item)]
            if isinstance(got, BaseException):
                row.update(status_of(subject, got))
                continue
            fill_timing(row, got.timing, compiles=subject.compiles)
            rounds = got.round_medians
            row.update(rounds=len(rounds), round_ms=[float(f"{x:.6g}") for x in rounds],
                       cpu_share=None if share is None else round(share, 4))
            copy = timed.get(id(copies[row["bytes_moved"]])) if copies[row["bytes_moved"]] is not None else None
            if copy is not None and not isinstance(copy, BaseException):
                row.update(ref_copy_ms=copy.stats.median, time_rel_copy=row["time_ms"] / copy.stats.median,
                           rel_copy_rounds=_round_ratios(rounds, copy.round_medians))
            mark_roofline(row)  # after ref_copy_ms: without it, judged on gbps alone
            ref = timed.get(id(fused)) if fused is not None else None
            if ref is not None and not isinstance(ref, BaseException):
                row.update(ref_fused_ms=ref.stats.median, time_rel_fused=row["time_ms"] / ref.stats.median)
    finally:
        built.clear()
        copies = fused = items = refs = None  # noqa: F841 - release the buffers and states now
        for prm in tensors.params:
            prm.grad = None
        tensors.rotate()
