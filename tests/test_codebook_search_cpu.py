"""The kernels' floor code of a code book (kernels/cpu/search.py: floor_code, the bucketed
search of host.search_table, floor_codes, the same over a row in stages (the replay's), and
scan_code for books of at most 16 entries) against
numpy's searchsorted, at every entry, the fp32 values next to it on both sides, the midpoints,
their negatives, zeros, tiny and out-of-range values: k = clamp(#(table <= v) - 1, 0, NT - 2)
and the entries table[k], table[k + 1] that the rounding reads, exactly.

Skipped where numba is not installed. Two small helpers compile (seconds)."""
import numpy as np
import pytest

from qstate_cli.kernels import cpu

needs_numba = pytest.mark.skipif(cpu.unavailable_reason("cpu") is not None, reason="numba is not installed")
BOOKS = ["de4", "de4u", "de4nz", "de4unz", "de8", "de8u", "de8nz", "de8unz"]


def candidates(table: np.ndarray) -> np.ndarray:
    up, down = np.nextafter(table, np.float32(2)), np.nextafter(table, np.float32(-2))
    mids = (table[1:] + table[:-1]) / np.float32(2)
    extra = np.array([0.0, -0.0, 1e-38, -1e-38, 2.0 ** -31, 1.5, -1.5, 3e38, -3e38], np.float32)
    v = np.concatenate([table, up, down, mids, extra]).astype(np.float32)
    return np.concatenate([v, -v])


def _helpers():
    from numba import njit
    from qstate_cli.kernels.cpu import layout as c
    from qstate_cli.kernels.cpu.search import floor_code, floor_codes, scan_code

    @njit(error_model="numpy")
    def search(table, lay, vs, k, lo, hi):
        for j in range(vs.size):
            kj = floor_code(table, lay, lay[c.NT], vs[j])
            k[j], lo[j], hi[j] = kj, table[kj], table[kj + 1]

    @njit(error_model="numpy")
    def scan(table, nt, vs, k, lo, hi):
        for j in range(vs.size):
            k[j], lo[j], hi[j] = scan_code(table, nt, vs[j])

    @njit(error_model="numpy")
    def staged(table, lay, vs, k, lo, hi):
        q, w = np.empty(vs.size, np.int32), np.empty(vs.size, np.uint64)
        floor_codes(table, lay, lay[c.NT], vs, vs.size, q, lo, hi, w)
        for j in range(vs.size):
            k[j] = q[j]

    return search, scan, staged


@needs_numba
@pytest.mark.parametrize("name", BOOKS)
def test_floor_code_of_every_code_book_at_its_entries_and_their_neighbours(name):
    from qstate_cli.kernels.cpu.host import layout_arrays
    from qstate_cli.kernels.launch import kernel_layout
    from qstate_cli.quant import parse_spec
    kl = kernel_layout(parse_spec(f"{name}:nearest:b32"))
    table = np.asarray(kl.table("cpu").numpy(), np.float32)
    lay, _, prepared = layout_arrays(kl, kl.table("cpu"))
    nt = table.size
    vs = candidates(table)
    want = np.clip(np.searchsorted(table, vs, side="right") - 1, 0, nt - 2)
    search, scan, staged = _helpers()
    paths = [("bucketed search", search, lay), ("in stages", staged, lay)] + ([("scan", scan, nt)] if nt <= 16 else [])
    for what, fn, arg in paths:
        k, lo, hi = np.zeros(vs.size, np.int64), np.zeros(vs.size, np.float32), np.zeros(vs.size, np.float32)
        fn(prepared, arg, vs, k, lo, hi)
        bad = np.flatnonzero(k != want)
        assert bad.size == 0, f"{name} {what}: k at v={vs[bad[:3]]} is {k[bad[:3]]}, want {want[bad[:3]]}"
        assert np.array_equal(lo.view(np.uint32), table[want].view(np.uint32)), f"{name} {what}: lo"
        assert np.array_equal(hi.view(np.uint32), table[want + 1].view(np.uint32)), f"{name} {what}: hi"


@needs_numba
def test_a_dense_book_needs_three_steps_and_both_searches_find_its_floor():
    """40 entries in [0.9, 0.97]: host.search_table's buckets (its finest, 2**7 a binade) hold
    up to 3 entries above their least value (STEPS 3), so the last step of floor_codes starts
    from neither neighbour of many values; both searches still give numpy's floor and its two
    entries."""
    from qstate_cli.kernels.cpu.host import search_table
    table = np.linspace(0.9, 0.97, 40).astype(np.float32)
    prepared, search = search_table(table.tobytes())
    assert search[2] == 3
    lay = (0, 8, 0, table.size, 0, 0, 0, 0) + search  # codec's 8 columns (KIND, BITS, SIGNED, NT, ...), then the buckets'
    vs = candidates(table)
    want = np.clip(np.searchsorted(table, vs, side="right") - 1, 0, table.size - 2)
    search_fn, _, staged = _helpers()
    for what, fn in [("bucketed search", search_fn), ("in stages", staged)]:
        k, lo, hi = np.zeros(vs.size, np.int64), np.zeros(vs.size, np.float32), np.zeros(vs.size, np.float32)
        fn(prepared, lay, vs, k, lo, hi)
        assert np.array_equal(k, want), what
        assert np.array_equal(lo.view(np.uint32), table[want].view(np.uint32)), what
        assert np.array_equal(hi.view(np.uint32), table[want + 1].view(np.uint32)), what
