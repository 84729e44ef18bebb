"""The replay's fused AdamW rule (kernels/cpu/replay_rule.py) against Recursion.step, the
reference rule (optim.rules.adamw with p = 0), bit for bit: the new m, v and the update
direction, including the sign of zeros, on inputs that exercise every rounding (values over
40 binades, subnormals, zeros of both signs, gradients that overflow g*g to inf), for several
betas / eps and at steps 1, 2, 10 and 5000 (bias corrections), on one thread and on
threads (a layout over the per-thread minimum). The whole replay's records through
`--backend auto` (this rule) and `reference` are compared in test_replay_codec_cpu.py.
Skipped without numba."""
import pytest
import torch

from qstate_cli.diagnose.recursions import recursion_for
from qstate_cli.kernels import cpu
from qstate_cli.runtime import torch_threads

pytestmark = pytest.mark.skipif(cpu.unavailable_reason("cpu") is not None, reason="numba is not installed")


def awkward(n: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-40, 40, (n,), generator=gen).float())
    x[::17] = 0.0
    x[5::17] = -0.0
    x[7::31] = 1e-42  # subnormal
    x[9::37] = 3e19  # g * g overflows to inf
    return x


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("hp", [{}, {"betas": (0.8, 0.95), "eps": 1e-6}, {"betas": (0.0, 0.5), "eps": 1e-30}])
@pytest.mark.parametrize("threads, n", [(1, 6 * 4096 + 128), (3, 3 * 65536 + 4096)])
def test_fused_adamw_rule_is_the_reference(hp, threads, n):
    from qstate_cli.diagnose.recursions import fused_rule

    rec = recursion_for("adamw", hp)
    rule, why = fused_rule(rec, torch.device("cpu"))
    assert rule is not None, why
    gen = torch.Generator().manual_seed(n + len(hp))
    with torch_threads(threads):
        for since in (1, 2, 10, 5000):
            g = awkward(n, gen)
            x_hat = {"m": awkward(n, gen), "v": awkward(n, gen).abs()}
            x_hat["v"][3::23] = 0.0
            first = {"m": since == 1, "v": since == 1}
            u_ref, new_ref = rec.step(g, x_hat, since, first)
            u, new = rule.step(g, x_hat, since, first)
            assert torch.equal(bits(u), bits(u_ref)), since
            for s in ("m", "v"):
                assert torch.equal(bits(new[s]), bits(new_ref[s])), (since, s)


@pytest.mark.parametrize("threads, unit, n_units", [(1, 128, 200), (3, 256, 1040), (1, 2048, 9), (1, 96, 40)])
def test_fused_shadow_step_is_the_rule_and_torchs_sums(threads, unit, n_units, monkeypatch):
    """FusedAdamRule.shadow_step (kernels/cpu/replay_rule.adamw_shadow): the rule's u, m, v and,
    per unit, the sums of m^2, v^2, u^2 that step.step_shadow took with torch
    ((x * x).view(-1, unit).sum(1)), bit for bit, streamed (128, 256), on rows (96, 2048:
    past the stream's groups), over threads; and None where torch's order is unknown."""
    from qstate_cli.diagnose.recursions import fused_rule
    from qstate_cli.diagnose.stats import unit_sums
    from qstate_cli.kernels.cpu import torch_sum

    rule, _ = fused_rule(recursion_for("adamw", {"betas": (0.8, 0.95)}), torch.device("cpu"))
    gen = torch.Generator().manual_seed(unit)
    n = unit * n_units
    with torch_threads(threads):
        for since in (1, 7):
            g = awkward(n, gen)
            x = {"m": awkward(n, gen), "v": awkward(n, gen).abs()}
            u, new, x2, u2 = rule.shadow_step(g, x, since, unit)
            u_ref, new_ref = rule.step(g, x, since, {})
            assert torch.equal(bits(u), bits(u_ref))
            assert torch.equal(bits(u2), bits(unit_sums(u_ref * u_ref, unit)))
            for s in ("m", "v"):
                assert torch.equal(bits(new[s]), bits(new_ref[s])), s
                assert torch.equal(bits(x2[s]), bits(unit_sums(new_ref[s] * new_ref[s], unit))), s
            assert torch.isinf(x2["v"]).any()  # the squares overflow: inf sums, as torch's
    monkeypatch.setattr(torch_sum, "lanes", lambda: None)
    assert rule.shadow_step(g, x, 1, unit) is None


def test_other_optimizers_keep_the_reference():
    from qstate_cli.diagnose.recursions import fused_rule

    rule, why = fused_rule(recursion_for("lion", {}), torch.device("cpu"))
    assert rule is None and "lion" in why


@pytest.mark.parametrize("threads,unit,torch_sums", [(1, 128, False), (3, 128, False), (1, 2048, False),
                                                     (3, 1024, True)])
def test_fused_update_stats_are_the_torch_path(threads, unit, torch_sums, monkeypatch):
    """UpdateStats with the products and their sums in numba (torch's order,
    kernels/cpu/torch_sum.py; torch_sums: no order found, torch sums the products) collects
    exactly what its torch path collects (per-step and per-unit sums), over steps of awkward
    values, in units up to 2048 (the order's second level)."""
    from qstate_cli.diagnose.layout import Layout
    from qstate_cli.diagnose.stats import UpdateStats, unit_sums
    from qstate_cli.kernels.cpu import torch_sum
    from test_replay_codec_cpu import small_trace

    if torch_sums:
        monkeypatch.setattr(torch_sum, "lanes", lambda: None)
    layout = Layout(small_trace(2), unit, torch.device("cpu"))
    gen = torch.Generator().manual_seed(threads)
    n = layout.n
    with torch_threads(threads):
        fused, plain = UpdateStats(layout, 5, fused=True), UpdateStats(layout, 5)
        assert fused.fused and not plain.fused
        for i in range(5):
            u, ref = awkward(n, gen), awkward(n, gen)
            r2 = unit_sums(ref * ref, layout.unit)
            for st in (fused, plain):
                st.observe(i, u, ref, r2)
        a, b = fused.collect(), plain.collect()
    for k in ("sums", "units"):
        assert a[k].tobytes() == b[k].tobytes(), k


def test_rules_of_the_same_betas_and_eps_share_a_steps_scalars():
    """FusedAdamRule.scalars is computed once per step for every rule of the same betas and eps
    (the shadow's and each configuration's), and rules that differ get their own."""
    import numpy as np
    from qstate_cli.diagnose.recursions import fused_rule

    cpu_dev = torch.device("cpu")
    a, b = (fused_rule(recursion_for("adamw", {}), cpu_dev)[0] for _ in range(2))
    c = fused_rule(recursion_for("adamw", {"eps": 1e-6}), cpu_dev)[0]
    d = fused_rule(recursion_for("adamw", {"betas": (0.8, 0.95)}), cpu_dev)[0]
    assert a.scalars(7) is b.scalars(7) and a.scalars(8) is not a.scalars(7)
    assert c.scalars(7)[5] == np.float32(1e-6) and a.scalars(7)[5] == np.float32(1e-8)
    assert d.scalars(7)[0] == np.float32(0.8) and a.scalars(7)[0] == np.float32(0.9)
    assert not np.array_equal(d.scalars(7)[4:], a.scalars(7)[4:])  # the bias corrections of other betas
