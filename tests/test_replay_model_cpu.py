"""The replay's fused staleness model (kernels/cpu/replay_model.py) against the reference
staleness.predict / windows, bit for bit per element: the empirical P(stall) (padding
masked as ModelStats masks it), the nominal mask and count, and the cell (down, up) of the
fp32 shadow the Gaussian part takes, incl. NaN positions (inf * 0 in a zero block), on
every format and rounding the fused codec covers; and whole replays whose records are the
same through the fused model and the reference.

Inputs: values stored on the grid (the reference codec's read-back), blocks whose absmax
makes n = the value exactly, holding grid points, exact midpoints and their fp32
neighbours, zero blocks, -0.0, negative values of unsigned formats, nominal updates that
land exactly on the cell's edges, non-finite x_new and s, and padding.
The tests of the kernel skip where numba is not installed."""
import math

import pytest
import torch

from qstate_cli.diagnose import diagnose
from qstate_cli.diagnose.staleness import predict, windows
from qstate_cli.kernels import cpu
from qstate_cli.quant import QuantizedState, Stream, parse_config, parse_spec
from qstate_cli.quant.codebooks import codebook_tensor

needs_numba = pytest.mark.skipif(cpu.unavailable_reason("cpu") is not None, reason="numba is not installed")

N = 8192
FORMATS = ["int4", "uint4", "de4", "de4u", "lin4nz", "de4unz", "int8", "uint8", "de8", "de8u", "lin8nz", "de8nz"]
CASES = []
for _i, _f in enumerate(FORMATS):
    for _j, _r in enumerate(("nearest", "stochastic", "bred")):
        _b = (32, 128, 256)[(_i + _j) % 3]
        _sqrt = ":sqrt" if (_i + _j) % 2 and not _f.startswith("int") else ""
        _bf16 = ":sbf16" if (_i + _j) % 3 == 1 else ""
        CASES.append(f"{_f}:{_r}:b{_b}{_sqrt}{_bf16}")
CASES += ["uint4:nearest:b32:sqrt", "uint8:stochastic:b64:sqrt:sbf16", "de4u:stochastic:b128:sqrt"]
for _i, _f in enumerate(["e4m3", "e5m2", "e2m1", "e2m2"]):  # minifloats: binade-averaged gaps for emp
    for _j, _r in enumerate(("nearest", "stochastic", "bred")):
        _sqrt = ":sqrt" if (_i + _j) % 2 and _f == "e2m2" else ""
        CASES.append(f"{_f}:{_r}:b{(32, 128, 256)[(_i + _j) % 3]}{_sqrt}")
CASES += ["bf16:nearest", "bf16:stochastic:sqrt", "fp16:stochastic", "fp16:nearest:sqrt"]  # unscaled: delta = 1


def grid_points(spec) -> torch.Tensor:
    """Normalised values where windows can go wrong: grid points, exact midpoints, their fp32
    neighbours, zeros of both signs, beyond the ends."""
    fmt = spec.fmt
    if fmt.kind == "linear":
        lo, hi = fmt.code_range
        pts = torch.arange(lo - 1, hi + 2, dtype=torch.float32)
        pts = torch.cat([pts, pts + 0.5])
    else:
        table = codebook_tensor(fmt.name) if fmt.kind == "table" else fmt.code_value(torch.arange(fmt.max_ordinal + 1))
        if table.numel() > 512:  # bf16, fp16: the ends and a sample of neighbouring ordinal pairs between
            pick = torch.randperm(table.numel() - 8, generator=torch.Generator().manual_seed(3))[:248] + 4
            ends = torch.cat([torch.arange(4), torch.arange(table.numel() - 4, table.numel())])
            table = table[torch.cat([ends, pick, pick + 1]).unique()]  # sorted: each pair's midpoint is a tie
        pts = torch.cat([table, (table[1:] + table[:-1]) / 2, -table])
    pts = torch.cat([pts, torch.nextafter(pts, torch.tensor(1e9)), torch.nextafter(pts, torch.tensor(-1e9)),
                     torch.tensor([0.0, -0.0, 1e-41])])
    return pts.clamp(-fmt.top, fmt.top)


def state_values(spec, gen: torch.Generator) -> torch.Tensor:
    """fp32 values of a state: a spread of magnitudes, blocks whose absmax is top (so the
    normalised value is the value itself) holding grid_points, an all-zero block, one of
    subnormals, a NaN and infinities (s only: the grid takes them as torch does)."""
    x = torch.randn(N, generator=gen) * torch.exp(2 * torch.randn(N, generator=gen))
    pts = grid_points(spec)
    B = int(spec.block or 256)  # unscaled (bf16, fp16): n is the value anyway
    exact = pts.repeat(-(-1024 // pts.numel()))[:1024].clone()
    exact[::B] = spec.fmt.top  # each block's absmax: delta = 1
    if spec.sqrt:
        exact = exact * exact  # sqrt brings them back (torch's sqrt: up to an ulp)
    x[1024:2048] = exact[torch.randperm(1024, generator=gen)].view(-1, B).sort(1, descending=True).values.view(-1)
    x[2048:2048 + B] = 0.0
    x[2048 + B:2048 + 2 * B] = -0.0
    x[2048 + 2 * B:2048 + 3 * B] = 1e-41
    return x


def inputs(spec, seed: int):
    gen = torch.Generator().manual_seed(seed)
    s = state_values(spec, gen)
    ref = QuantizedState(spec, (N,), Stream(seed, 0, 1), device="cpu")
    ref.encode(s + 0.05 * s.abs() * torch.randn(N, generator=gen), 3)
    x_hat = ref.decode()  # on the grid, as the replay's stored values
    x_hat[1024:2048] = s[1024:2048]  # the exact grid points and midpoints themselves
    x_hat[2048:2048 + 256] = 0.0
    sr = spec.rounding == "stochastic"
    down, up = windows(spec, x_hat, full=sr)
    pick = torch.randint(0, 6, (N,), generator=gen)
    step = 0.3 * x_hat.abs() * torch.randn(N, generator=gen)
    cand = torch.stack([x_hat - down, x_hat + up, x_hat, x_hat + step,
                        torch.nextafter(x_hat + up, x_hat), torch.nextafter(x_hat - down, x_hat)])
    x_new = cand.gather(0, pick[None]).squeeze(0)
    x_new[7], x_new[8], x_new[9] = float("nan"), float("inf"), -float("inf")
    s[11], s[3000], s[5000] = float("nan"), float("inf"), -float("inf")
    valid = torch.ones(N, dtype=torch.bool)
    valid[4096 + 200:4096 + 256] = False  # padding: tails of blocks
    valid[N - 100:] = False
    return x_hat, x_new, s, valid


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def check(spec_text: str, seed: int = 1) -> None:
    from qstate_cli.kernels.cpu.replay_model import StalenessModel
    spec = parse_spec(spec_text)
    x_hat, x_new, s, valid = inputs(spec, seed)
    emp, nominal, count, cell = StalenessModel(spec, N, valid).predict(x_hat, x_new, s)
    want_emp, want_nom, _ = predict(spec, x_hat, x_new, s, None)
    want_nom = want_nom & valid
    want_emp = torch.where(valid, want_emp, 0.0)
    assert torch.equal(nominal, want_nom) and count == int(want_nom.sum()), f"{spec_text}: nominal"
    bad = torch.nonzero(bits(emp) != bits(want_emp)).flatten()
    assert bad.numel() == 0, f"{spec_text}: emp differs at {bad[:5].tolist()}: {emp[bad[:5]]} vs {want_emp[bad[:5]]}"
    if spec.rounding == "bred":
        assert cell is None and not emp.any()
        return
    assert 0 < count < N and emp.isnan().sum() == want_emp.isnan().sum()
    for got, want, side in zip(cell, windows(spec, s, full=spec.rounding == "stochastic"), ("down", "up")):
        bad = torch.nonzero(bits(got) != bits(want)).flatten()
        assert bad.numel() == 0, f"{spec_text}: {side} differs at {bad[:5].tolist()}: {got[bad[:5]]} vs {want[bad[:5]]}"


@needs_numba
@pytest.mark.parametrize("spec", CASES)
def test_fused_model_equals_staleness_predict_bit_for_bit(spec):
    check(spec)


@needs_numba
@pytest.mark.parametrize("spec", ["int4:nearest:b128", "de8:stochastic:b64:sqrt", "lin4nz:nearest:b32:sbf16"])
def test_fused_model_without_the_gaussian_part(spec):
    """No Gaussian model (Lion, SGD, a float v: s is None): the empirical part alone, NaN and
    infinities in x_hat too, and no cell."""
    from qstate_cli.kernels.cpu.replay_model import StalenessModel
    spec = parse_spec(spec)
    x_hat, x_new, s, valid = inputs(spec, 2)
    x_hat[20], x_hat[21], x_hat[22] = float("nan"), float("inf"), -float("inf")
    emp, nominal, count, cell = StalenessModel(spec, N, valid).predict(x_hat, x_new, None)
    want_emp, want_nom, _ = predict(spec, x_hat, x_new, s, None)
    want_nom = want_nom & valid
    assert cell is None and torch.equal(nominal, want_nom) and count == int(want_nom.sum())
    assert torch.equal(bits(emp), bits(torch.where(valid, want_emp, 0.0)))
    if spec.rounding == "stochastic":  # 1 - |NaN| / cell: the non-finite x_hat did reach the kernel
        assert emp.isnan().any()


@needs_numba
def test_fused_models_of_one_layout_share_their_buffers():
    """Every state's model on a layout of n elements writes the same buffers (13 bytes per
    element once per replay, not per configuration and state); each result is read before
    the next pass, as ModelStats does."""
    from qstate_cli.kernels.cpu.replay_model import StalenessModel
    a, b = parse_spec("int4:nearest:b128"), parse_spec("de8:stochastic:b64")
    xa, na, sa, valid = inputs(a, 3)
    first = StalenessModel(a, N, valid).predict(xa, na, sa)
    emp_a = first[0].clone()
    second = StalenessModel(b, N, valid).predict(*inputs(b, 4)[:3])
    assert second[0].data_ptr() == first[0].data_ptr() and not torch.equal(second[0], emp_a)


@needs_numba
def test_replays_in_threads_of_one_process_do_not_share_buffers():
    """Replays side by side in one process (test_diagnose_split.py runs its ranks as threads)
    each get their own buffers: with one set per process, predictions running at once wrote
    into each other's (a split replay's stall_rate_predicted was 3% off). Each thread predicts
    its own inputs many times while the other runs; every result equals the lone one."""
    import threading
    from qstate_cli.kernels.cpu.replay_model import StalenessModel
    spec = parse_spec("int4:stochastic:b128")
    model = StalenessModel(spec, N, None)
    jobs = [inputs(spec, seed)[:3] for seed in (5, 6)]
    want = [[t.clone() for t in (r[0], r[1], *r[3])] for r in (model.predict(*job) for job in jobs)]
    assert not torch.equal(bits(want[0][0]), bits(want[1][0]))
    bad, start = [], threading.Barrier(2)

    def same(a, b):  # bit for bit (NaN is one of the model's values)
        return torch.equal(a, b) if a.dtype == torch.bool else torch.equal(bits(a), bits(b))

    def run(k):
        start.wait()
        ptr = None
        for _ in range(30):
            emp, nominal, _, (down, up) = model.predict(*jobs[k])
            ptr = ptr or emp.data_ptr()
            bad.extend(k for got, exp in zip((emp, nominal, down, up), want[k]) if not same(got, exp))
        return ptr

    out = [None, None]
    threads = [threading.Thread(target=lambda k=k: out.__setitem__(k, run(k))) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out[0] != out[1] and not bad


def test_the_inputs_reach_the_cases_that_matter():
    """The adversarial inputs do hold what they claim: NaN cells (inf * 0 in a zero block),
    inf cells (the grid's ends), half-to-even midpoints, and stalls and moves of both kinds."""
    spec = parse_spec("uint4:nearest:b128")
    x_hat, x_new, s, valid = inputs(spec, 1)
    down, up = windows(spec, s, full=False)
    assert down.isnan().any() and torch.isinf(down).any() and torch.isinf(up).any()
    n = s[1024:2048]
    assert ((n - n.floor()) == 0.5).sum() > 20  # exact midpoints with delta = 1
    emp, nominal, _ = predict(spec, x_hat, x_new, s, None)
    assert (emp[nominal] == 1).sum() > 100 and (emp[nominal] == 0).sum() > 100


@needs_numba
def test_fused_model_over_threads(monkeypatch):
    from qstate_cli.kernels.cpu import host
    monkeypatch.setattr(host, "MIN_THREAD_ELEMENTS", 1024)
    monkeypatch.setattr(host, "threads", lambda: 3)
    for spec in ("int4:stochastic:b128", "de8:nearest:b256:sbf16"):
        check(spec, seed=2)


def _long_inputs(spec, n: int, seed: int):
    """inputs() tiled to n elements (blocks of at most 256 divide N), x_new with fresh noise and finite."""
    x_hat, x_new, s, valid = inputs(spec, seed)
    reps = -(-n // N)
    tile = [t.repeat(reps)[:n].clone() for t in (x_hat, x_new, s, valid)]
    gen = torch.Generator().manual_seed(seed + 100)
    tile[1] = (tile[1] * (1 + 1e-3 * torch.randn(n, generator=gen))).nan_to_num(0.0, 0.0, 0.0)  # finite sums
    return tile


@needs_numba
@pytest.mark.parametrize("spec_text,gaussian", [("de8:nearest:b256", ("m", 0.9)), ("int4:stochastic:b128", ("m", 0.5)),
                                                ("lin4nz:stochastic:b128", ("v", 0.999)),
                                                ("uint4:nearest:b64:sqrt", ("v", 0.95)), ("de8u:nearest:b256", None)])
@pytest.mark.parametrize("n,threads", [(N, 1), (65536, 2), (98304, 2), (65792, 2), (3 * 32768, 3)])
def test_sums_in_one_pass_equal_predict_then_the_gaussian_then_sum64(monkeypatch, spec_text, gaussian, n, threads):
    """StalenessModel.sums (one handoff: each thread's range runs the pass, the Gaussian's
    pipeline, and the fp64 row sums of what it wrote where its range is one of sum64's rows)
    gives predict's count and sum64's bits of emp and of masked_gaussian's G; ranges that
    are not sum64's rows (65792: 257 blocks over 2 threads) sum after the pass."""
    from qstate_cli.kernels.cpu import host
    from qstate_cli.kernels.cpu.replay_gauss import masked_gaussian
    from qstate_cli.kernels.cpu.replay_model import StalenessModel
    from qstate_cli.kernels.cpu.torch_sum import split_found, sum64
    from qstate_cli.runtime import torch_threads
    monkeypatch.setattr(host, "MIN_THREAD_ELEMENTS", 1024)
    spec = parse_spec(spec_text)
    x_hat, x_new, s, valid = _long_inputs(spec, n, 7)
    s = s.nan_to_num(0.0, 0.0, 0.0)
    if gaussian is not None and gaussian[0] == "v":
        s = s.abs()
    g = None if gaussian is None else (gaussian + ((s.abs() + 1e-9) * 0.5,) if gaussian[0] == "m" else gaussian + (0.7,))
    model = StalenessModel(spec, n, valid)
    with torch_threads(threads):
        split_found()  # torch's sum order at this count, probed as the replay does before torch_aside
    with torch_threads(threads), host.torch_aside(threads):
        emp, nominal, count, cell = model.predict(x_hat, x_new, s if g is not None else None)
        want = (count, sum64(emp), None if g is None else sum64(masked_gaussian(
            spec.rounding == "stochastic", g, s, *cell, nominal)))
        got = model.sums(x_hat, x_new, s, g)
    assert got[0] == want[0]
    for a, b in zip(got[1:], want[1:]):
        assert (a is None and b is None) or torch.tensor(a, dtype=torch.float64).view(torch.int64) == \
            torch.tensor(b, dtype=torch.float64).view(torch.int64), (got, want)
    assert all(math.isfinite(v) and v != 0 for v in want[1:] if v is not None)


def test_model_refuses_what_it_does_not_cover():
    from qstate_cli.kernels.cpu.replay_model import StalenessModel
    for spec in ("e4m3:nearest:tensor", "bf16:bred"):
        with pytest.raises(ValueError, match="no fused staleness model"):
            StalenessModel(parse_spec(spec), N)
    with pytest.raises(ValueError, match="does not divide"):
        StalenessModel(parse_spec("int4:nearest:b256"), 1000)


CONFIGS = ["nearest-4bit", "sr-4bit", "bred-4bit", "bnb-8bit", "torchao-4bit",
           "m=lin4nz:stochastic:b64:sbf16,v=uint4:nearest:b32:sqrt",
           "m=int8:stochastic:b128,v=de8u:stochastic:b64:sqrt:sbf16", "fp8", "fp4-sr", "bf16", "bf16-sr"]


def comparable(doc: dict) -> dict:
    meta = {k: v for k, v in doc["meta"].items() if k not in ("profile", "codec")}
    env = {k: v for k, v in doc["env"].items() if k not in ("created", "git_sha")}  # a commit mid-suite
    return {**doc, "meta": meta, "env": env}


@needs_numba
@pytest.mark.parametrize("reset", ["none", "3"])
def test_replay_records_are_the_same_through_the_fused_model(reset, monkeypatch):
    """Whole replays (every step a model step at 8 steps): the JSON documents of --backend
    auto (fused codec and model) and reference are equal but for timings, codec paths and
    creation time; the fused model did run for every covered state."""
    from qstate_cli.kernels.cpu import replay_model
    from test_replay_codec_cpu import small_trace
    calls = []
    real = replay_model.StalenessModel._pass

    def spy(self, *a):
        calls.append(self.rounding)
        return real(self, *a)

    monkeypatch.setattr(replay_model.StalenessModel, "_pass", spy)  # predict's and sums' pass
    trace = small_trace(8)
    cfgs = [parse_config(c) for c in CONFIGS]
    auto, _ = diagnose(trace, cfgs, reset=reset, backend="auto")
    assert len(calls) >= 2 * len(CONFIGS) * 8 and set(calls) == {"nearest", "stochastic", "bred"}
    n_auto = len(calls)
    ref, _ = diagnose(trace, cfgs, reset=reset, backend="reference")
    assert len(calls) == n_auto  # the reference path never calls the fused model
    assert comparable(auto) == comparable(ref)
    rows = [r for r in auto["records"] if r.get("stall_rate_predicted_empirical") is not None]
    assert rows, "no record carries the model's prediction"


def test_gaussian_stochastic_formulas_computed_once_are_the_textbook_ones():
    """staleness.gaussian_v / gaussian_m under stochastic rounding compute each CDF once;
    the written-out formulas (every CDF where the math names it) give the same bits, incl.
    NaN, 0 and inf cells and a size that is no multiple of the vector width (sqrt and exp:
    the model's, fp32_math's on CPU). Runs without numba."""
    import math

    from qstate_cli import fp32_math as F
    from qstate_cli.diagnose import staleness as st

    def chi3(x):
        x = x.clamp(min=0.0)
        return st._chi2_1(x) - F.sqrt(2 * x / math.pi) * F.exp_tail(-x / 2)

    gen = torch.Generator().manual_seed(3)
    n = 4099
    s = torch.randn(n, generator=gen).abs() * torch.exp(torch.randn(n, generator=gen))
    m = torch.randn(n, generator=gen) * 0.1
    down, up = (s * torch.rand(n, generator=gen) for _ in range(2))
    down[:5], up[5:10], s[10:12] = float("nan"), float("inf"), 0.0
    down[12], up[13] = 0.0, 0.0
    for c in (0.3, 1.0):
        scale = (1 - 0.999) * s
        ok = scale > 0
        scale = torch.where(ok, scale, 1.0)
        w_lo, w_hi = (c * down / scale).clamp(max=1e30), (c * up / scale).clamp(max=1e30)
        a, b = (c - w_lo).clamp(min=0.0), c + w_hi
        cc = torch.full_like(s, c)
        p = ((1 - c / w_lo) * (st._chi2_1(cc) - st._chi2_1(a)) + (chi3(cc) - chi3(a)) / w_lo
             + (1 + c / w_hi) * (st._chi2_1(b) - st._chi2_1(cc)) - (chi3(b) - chi3(cc)) / w_hi)
        want = torch.where(ok & (w_lo > 0) & (w_hi > 0), p.clamp(0.0, 1.0), 0.0)
        assert torch.equal(st.gaussian_v(True, 0.999, c, s, down, up).view(torch.int32), want.view(torch.int32))
    sigma2 = s
    ok = sigma2 > 0
    sigma = F.sqrt(torch.where(ok, sigma2, 1.0))
    lo, hi = (down / (1 - 0.9)).clamp(max=1e30), (up / (1 - 0.9)).clamp(max=1e30)
    a, b, z0 = (m - lo) / sigma, (m + hi) / sigma, m / sigma
    left = (1 - m / lo) * (st._Phi(z0) - st._Phi(a)) + sigma * (st._phi(a) - st._phi(z0)) / lo
    right = (1 + m / hi) * (st._Phi(b) - st._Phi(z0)) - sigma * (st._phi(z0) - st._phi(b)) / hi
    want = torch.where(ok & (lo > 0) & (hi > 0), (left + right).clamp(0.0, 1.0), 0.0)
    assert torch.equal(st.gaussian_m(True, 0.9, m, sigma2, down, up).view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("name", ["de8", "de8u", "de8nz", "de8unz"])
def test_nearest_thresholds_give_the_reference_nearest_code(name):
    """thresholds.nearest_thresholds: #(thresholds <= n) - 1 is the code the reference rounds
    n to (Format.nearest_ordinal, staleness._grid_gaps' rounding) for every value probed: each
    entry, midpoint and threshold with their fp32 neighbours (3 each side), zeros of both
    signs, tiny, infinite and out-of-range values, and 200,000 random ones over [-1.2, 1.2]."""
    import numpy as np
    from qstate_cli.kernels.cpu.thresholds import nearest_thresholds
    from qstate_cli.quant.codebooks import codebook
    fmt = parse_spec(f"{name}:nearest:b32").fmt
    book = np.asarray(codebook(name), np.float32)
    theta = nearest_thresholds(fmt)
    assert theta.dtype == np.float32 and theta.size == book.size + 1 and np.all(np.diff(theta) > 0)
    pts = np.concatenate([book, (book[1:] + book[:-1]) / np.float32(2), theta[1:-1]]).astype(np.float32)
    near = [pts]
    for direction in (np.float32(np.inf), np.float32(-np.inf)):
        p = pts
        for _ in range(3):
            p = np.nextafter(p, direction)
            near.append(p)
    rng = np.random.default_rng(0)
    extra = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-38, -1e-38, 2.0, -2.0, 3e38, -3e38, np.inf, -np.inf], np.float32)
    v = np.concatenate(near + [-np.concatenate(near), extra, rng.uniform(-1.2, 1.2, 200_000).astype(np.float32)])
    want = fmt.nearest_ordinal(torch.from_numpy(v)).numpy()
    got = np.clip(np.searchsorted(theta, v, side="right") - 1, 0, book.size - 1)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{name}: code at n={v[bad[:3]]} is {got[bad[:3]]}, want {want[bad[:3]]}"
