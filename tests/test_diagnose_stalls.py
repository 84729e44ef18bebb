"""Code-level stalling: a block-scaled state whose value moves with its block's absmax
while the element's own code is frozen; counted on the stored codes (or a float state's
raw bits), against a brute-force replay of v with quant.encode and the reference rule."""
import numpy as np
import pytest
import torch

from qstate_cli.diagnose import diagnose
from qstate_cli.diagnose.summary import late_start
from qstate_cli.optim.rules import ema
from qstate_cli.quant import QuantizedState, Stream, parse_config
from qstate_cli.quant.packing import unpack
from qstate_cli.trace.schema import Trace, TraceTensor


def gaussian_trace(n: int, steps: int, beta2: float, seed: int = 0) -> Trace:
    gen = torch.Generator().manual_seed(seed)
    grads = torch.randn(steps, n, generator=gen)
    return Trace("adamw", {"betas": [0.9, beta2], "eps": 1e-8}, 0, 1, steps, "fp32",
                 [TraceTensor("w", 0, (n,), torch.arange(-(-n // 2048)), grads)])


def brute_force_code_stalls(trace: Trace, spec, beta2: float):
    """Per step: (#nominal, #value stalls, #code stalls) of v, replayed element by element."""
    g = trace.tensors[0].grads
    q = QuantizedState(spec, (g.shape[1],), Stream(0, 0, 1))
    v_hat = torch.zeros(g.shape[1])
    codes = torch.zeros(g.shape[1], dtype=torch.int32)
    out = []
    for t in range(g.shape[0]):
        x = ema(v_hat, g[t] * g[t], beta2)
        q.encode(x, t + 1)
        new, new_codes = q.decode(), unpack(q.codes, spec.fmt.bits, g.shape[1])
        nominal = x != v_hat
        out.append((int(nominal.sum()), int((nominal & (new == v_hat)).sum()),
                    int((nominal & (new_codes == codes)).sum())))
        v_hat, codes = new, new_codes
    return np.array(out, dtype=float)


def test_code_stalls_equal_a_brute_force_replay_and_see_what_values_miss():
    n, steps, beta2 = 2048, 300, 0.99
    trace = gaussian_trace(n, steps, beta2)
    cfg = parse_config("nearest-4bit")
    doc, _ = diagnose(trace, [cfg, parse_config("bf16"), parse_config("fp32")])
    ref = brute_force_code_stalls(trace, cfg.v, beta2)
    rows = [r for r in doc["series"] if r["config"] == "nearest-4bit" and r["state"] == "v"]
    assert len(rows) == steps
    ok = ref[:, 0] > 0
    assert [r["code_stall_rate"] for r in rows] == pytest.approx((ref[ok, 2] / ref[ok, 0]).tolist(), abs=1e-12)
    assert [r["stall_rate"] for r in rows] == pytest.approx((ref[ok, 1] / ref[ok, 0]).tolist(), abs=1e-12)
    rec = {(r["config"], r["state"]): r for r in doc["records"]}
    v4 = rec[("nearest-4bit", "v")]
    late = late_start(steps)
    assert late == steps - 30
    assert v4["code_stall_rate"] == pytest.approx(ref[:, 2].sum() / ref[:, 0].sum())
    assert v4["code_stall_rate_late"] == pytest.approx(ref[late:, 2].sum() / ref[late:, 0].sum())
    assert v4["stall_rate_late"] == pytest.approx(ref[late:, 1].sum() / ref[late:, 0].sum())
    # the block absmax moves every step, so the value read back almost never stays put,
    # while the element's own 4-bit code is frozen most of the time
    assert v4["stall_rate"] < 0.01 and v4["code_stall_rate_late"] > 0.9
    # an unscaled float: its raw bits are its value, so the two rates are one
    bf = rec[("bf16", "v")]
    assert bf["code_stall_rate"] == pytest.approx(bf["stall_rate"]) and bf["code_stall_rate"] > 0.05
    assert rec[("fp32", "v")]["code_stall_rate"] == 0 and rec[("fp32", "v")]["stall_rate"] == 0
    # per code: counts and code stalls add up to the record; staleness is measured on codes
    per = [r for r in doc["per_code"] if r["config"] == "nearest-4bit" and r["state"] == "v"]
    assert sum(r["count"] for r in per) == ref[:, 0].sum()
    assert sum(r["count"] * r["code_stall_rate"] for r in per) == pytest.approx(ref[:, 2].sum())
    assert v4["staleness_p90"] > 20
    tensor = [r for r in doc["per_tensor"] if r["config"] == "nearest-4bit" and r["state"] == "v"][0]
    assert tensor["code_stall_rate"] == pytest.approx(v4["code_stall_rate"])


def test_v_statistics_do_not_depend_on_how_m_is_stored():
    """v's recursion reads only g and v: replaying nearest-4bit's v beside an fp32 m gives
    the same v statistics (the cheaper path the large tests use)."""
    trace = gaussian_trace(2048, 120, 0.99, seed=1)
    full = parse_config("nearest-4bit")
    cheap = parse_config(f"m=fp32,v={full.v}")
    doc, _ = diagnose(trace, [full, cheap])
    v = {r["config"]: r for r in doc["records"] if r["state"] == "v"}
    keys = ("stall_rate", "code_stall_rate", "code_stall_rate_late", "drift_final", "rel_rms_error", "staleness_p90")
    assert [v[str(full)][k] for k in keys] == [v[str(cheap)][k] for k in keys]
