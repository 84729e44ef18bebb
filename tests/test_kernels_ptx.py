"""The kernels compiled for sm_90 (no GPU needed): what the interpreter cannot show.

- no fp32 multiply-add is contracted into an FMA (enable_fp_fusion=False), every division
  and square root is the correctly rounded one, and no instruction flushes subnormals to
  zero: the GPU rounds like the reference (torch's CUDA kernels keep subnormals too);
- the widest values (AdamW: the parameter and gradient; Muon: the fp32 update) move with
  16-byte vector accesses, and no tile-sized register layout conversion goes through
  shared memory (launch.tile_shape)."""
import pytest

from kernel_parity import run_compile_probe


@pytest.fixture(scope="module")
def probes():
    rows = run_compile_probe("kernel_ptx_probe.py", timeout=600)
    if all("unavailable" in r for r in rows):
        pytest.skip(f"Triton cannot compile for CUDA here: {rows[0]['unavailable']}")
    return rows


def test_no_fma_no_flush_to_zero_and_only_correctly_rounded_division_and_sqrt(probes):
    """The only FMAs are fastmath.div_top's (their multiplier is -TOP or rn(1/TOP)), the
    only .ftz instructions are inside fastmath.sqrt_rn's blocks (ptxas's own sqrt.rn fast
    path: tests/test_kernels_fastmath.py)."""
    for r in probes:
        ops = r["all"]
        assert ops.get("fma.rn.f32", 0) == r["div_top_fma"] and r["ftz"] == 0, r
        assert ops.get("div.rn.f32", 0) > 0, r
        assert not any(k.startswith(("div.full", "div.approx", "sqrt.approx")) for k in ops), r
        if r["op"] == "adamw":
            assert ops.get("sqrt.rn.f32", 0) + r["fastmath_sqrt"] > 0, r
            assert r["div_top_fma"] > 0 or "torchao" in r["states"], r  # m=int4 divides by 7


def test_widest_values_move_in_16_byte_vectors_and_tiles_need_no_layout_conversion(probes):
    for r in probes:
        ops = r["all"]
        assert ops.get("st.global.v4.b32", 0) >= 1, r
        if r["op"] == "adamw":
            assert ops.get("ld.global.v4.b32", 0) >= 2, r  # parameter and gradient
        else:  # Muon: bf16 gradient, 4 per thread to match the fp32 update
            assert ops.get("ld.global.v2.b32", 0) >= 1, r
        # a tile-sized register layout conversion goes through shared memory in 128-bit
        # pieces; only per-row vectors (block scales, a few values) may pass there
        assert not any(k.startswith(("ld.shared.v4", "st.shared.v4")) for k in ops), r
