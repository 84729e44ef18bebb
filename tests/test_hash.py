"""The counter-based hash: reference values, tensor == int, uniformity, independence."""
import numpy as np
import pytest
import torch
from scipy import stats

from qstate_cli.quant import hash as qhash


def _hash32_numpy(x):
    """lowbias32 written independently with numpy uint32 (wrapping) arithmetic."""
    x = np.asarray(x, dtype=np.uint32)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x7FEB352D)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x846CA68B)
        x = x ^ (x >> np.uint32(16))
    return x


def test_hash32_matches_uint32_oracle_on_tensors_and_ints():
    xs = np.array([0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xDEADBEEF], dtype=np.uint64)
    want = _hash32_numpy(xs.astype(np.uint32)).astype(np.int64)
    got = qhash.hash32(torch.tensor(xs.astype(np.int64)))
    assert got.tolist() == want.tolist()
    assert [qhash.hash32(int(v)) for v in xs] == want.tolist()


def test_hash32_is_a_bijection_on_a_sample():
    x = torch.arange(0, 1 << 20, dtype=torch.int64) * 4093 + 7
    assert qhash.hash32(x).unique().numel() == x.numel()


def test_uniform_is_on_the_24bit_grid_in_unit_interval():
    u = qhash.uniform_for(seed=3, tensor_id=1, state_id=0, step=9, n=100_000)
    assert u.dtype == torch.float32
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert torch.equal(u * 2**24, torch.floor(u * 2**24))


def test_uniform_passes_kolmogorov_smirnov():
    u = qhash.uniform_for(seed=0, tensor_id=0, state_id=0, step=1, n=200_000).double().numpy()
    assert stats.kstest(u, "uniform").pvalue > 1e-4


@pytest.mark.parametrize("field", ["seed", "tensor_id", "state_id", "step"])
def test_each_stream_field_changes_the_bits(field):
    base = dict(seed=1, tensor_id=2, state_id=0, step=10)
    other = dict(base, **{field: base[field] + 1})
    a = qhash.uniform_for(n=4096, **base)
    b = qhash.uniform_for(n=4096, **other)
    assert (a == b).float().mean() < 0.01
    # and the streams are uncorrelated
    assert abs(np.corrcoef(a.numpy(), b.numpy())[0, 1]) < 5 / np.sqrt(4096)


def test_same_seed_replays_the_same_bits():
    a = qhash.uniform_for(seed=42, tensor_id=5, state_id=1, step=77, n=1000)
    b = qhash.uniform_for(seed=42, tensor_id=5, state_id=1, step=77, n=1000)
    assert torch.equal(a, b)


def test_consecutive_counters_are_uncorrelated():
    u = qhash.uniform_for(seed=9, tensor_id=0, state_id=0, step=1, n=100_000).double().numpy()
    r = np.corrcoef(u[:-1], u[1:])[0, 1]
    assert abs(r) < 5 / np.sqrt(u.size)
