"""Reset advice that helps: every recommended period is replayed against the fp32
optimizer without resets and kept only where it lowers the update error."""
import numpy as np
import pytest

from qstate_cli import theory
from qstate_cli.diagnose import diagnose, evidence, validate as validate_mod
from qstate_cli.diagnose.recommend import recommend
from qstate_cli.diagnose.replay import ReplayOptions, replay
from qstate_cli.diagnose.validate import candidates, update_error, update_errors, validate
from qstate_cli.errors import QstateError
from qstate_cli.quant import parse_config, parse_spec
from qstate_cli.trace import synthetic


def test_candidates_include_the_published_period_for_minifloats():
    assert candidates(parse_spec("bf16"), 0.999, 827) == [827, 1000]
    assert candidates(parse_spec("e2m2"), 0.999, 33) == [33, 200]
    assert candidates(parse_spec("bf16"), 0.999, None) == [827, 1000]  # the corpus said no reset: both replayed
    assert candidates(parse_spec("bf16"), 0.99, 80) == [69, 80]  # published periods are for beta2 = 0.999
    assert candidates(parse_spec("lin4nz:nearest:b128"), 0.999, None) == [1000]  # frozen from the start: try its memory
    assert candidates(parse_spec("de8u:nearest:b256"), 0.999, 913) == [913]


def test_the_replay_decides(monkeypatch):
    """The decision rule, on given errors: the best candidate is kept when it lowers the
    error by at least 1%, and a reset that does not pay is said to, with the numbers."""
    spec, cfg = parse_spec("bf16"), parse_config("bf16")
    errors = {827: 0.09, 1000: 0.08}
    monkeypatch.setattr(validate_mod, "update_error", lambda trace, c, p, *a: errors[p])
    v = validate(None, cfg, spec, 0.999, (827, "model"), 3000, baseline=0.1)
    assert v.period == 1000 and "better than the derived 827" in v.reason and v.error_with == 0.08
    errors.update({827: 0.2, 1000: 0.0995})
    v = validate(None, cfg, spec, 0.999, (827, "model"), 3000, baseline=0.1)
    assert v.period is None and "does not pay" in v.reason and "none: 0.1; every 827: 0.2, every 1000: 0.0995" in v.reason
    v = validate(None, cfg, spec, 0.999, (827, "model"), 500, baseline=0.1)  # too short to see a reset
    assert v.period == 827 and "not validated" in v.reason
    bred = parse_config("bred-4bit")
    assert validate(None, bred, bred.v, 0.999, (None, "BReD"), 3000, 0.1).reason == "BReD"


def test_frozen_codes_get_replayed_advice_with_its_numbers():
    """nearest-4bit's v codes freeze from the first steps (no build-up): the advice is no
    longer 'too little stalling' but a replay of a reset every 1/(1 - beta2) steps, and it
    is kept exactly when it lowers the update error against fp32."""
    trace = synthetic.gaussian(2048, 1500, beta2=0.999, seed=5)
    cfg = parse_config(f"m=fp32,v={parse_config('nearest-4bit').v}")  # v decides; an fp32 m halves the cost
    doc, _ = diagnose(trace, [cfg], check_resets=True)
    v = [r for r in doc["records"] if r["state"] == "v"][0]
    assert v["code_stall_rate_late"] > 0.95 and "too little stalling" not in v["reset_reason"]
    assert "replayed" in v["reset_reason"] and "every 1000" in v["reset_reason"]
    assert v["no_reset_update_error"] == pytest.approx(v["update_rel_error"])
    assert v["reset_update_error"] == pytest.approx(update_error(trace, cfg, 1000, None, "cpu"))
    pays = v["reset_update_error"] < 0.99 * v["no_reset_update_error"]
    assert (v["reset_period"] == 1000) == pays
    assert ("does not pay" in v["reset_reason"]) == (not pays)


def test_minifloat_advice_follows_the_corpus_evidence(monkeypatch):
    """Without a replay, a minifloat v gets the option that had the lowest update error on
    the corpus (evidence.py), not the model's period by default; changing the evidence
    changes the advice."""
    stall = np.full(200, 0.9)
    for key, rows in evidence.EVIDENCE.items():
        spec = parse_spec(key)
        assert str(spec) == key  # keyed on the canonical spec the corpus replayed
        # the model's period when the row was replayed (bf16-sr: 776, 777 since theory.py's quadrature fix)
        assert all(abs(r.model - theory.reset_period(spec, 0.999)) <= 1 for r in rows)
        assert all(r.published == theory.REPORTED_PERIODS[spec.fmt.name] for r in rows)
    period, why = recommend(parse_spec("bf16"), "v", "adamw", 0.999, stall, None)
    assert period is None and "on the trace corpus no reset had the lowest update error" in why
    assert "on 3 of 3 traces" in why and "tiny-lm (bf16, 2000 steps): none 0.04286" in why
    # fp8's and fp4's corpus rows had v broken (errors 12 to 8771 without resets): no evidence, the model's period
    for key in ("e2m2:nearest:b128", "e4m3:nearest:b256"):
        period, why = recommend(parse_spec(key), "v", "adamw", 0.999, stall, None)
        assert period == theory.reset_period(parse_spec(key), 0.999) and "trace corpus" not in why
    # evidence for one spec is not applied to another of the same format and rounding (te-fp8's tensor scale,
    # a sqrt v): its own model's period, in words that agree with it
    for key in ("e4m3:nearest:tensor", "bf16:nearest:sqrt"):
        spec = parse_spec(key)
        period, why = recommend(spec, "v", "adamw", 0.999, stall, None)
        assert period == theory.reset_period(spec, 0.999) and "trace corpus" not in why
        assert f"by step {period} after a reset" in why
    # at another beta2, or without evidence for the format and rounding, the model's period stands
    assert recommend(parse_spec("bf16"), "v", "adamw", 0.99, stall, None)[0] == theory.reset_period(
        parse_spec("bf16"), 0.99)
    assert recommend(parse_spec("bf16:stochastic"), "v", "adamw", 0.999, stall, None)[0] is None
    assert recommend(parse_spec("e2m2:stochastic:b128"), "v", "adamw", 0.999, stall, None)[0] == theory.reset_period(
        parse_spec("e2m2:stochastic"), 0.999)
    # evidence where the published period wins on 2 of 3 traces: the advice follows it
    rows = [evidence.Row("a", "bf16", 3000, 827, 1000, 0.30, 0.29, 0.25),
            evidence.Row("b", "bf16", 3000, 827, 1000, 0.30, 0.31, 0.28),
            evidence.Row("c", "bf16", 3000, 827, 1000, 0.30, 0.20, 0.31)]
    monkeypatch.setattr(evidence, "EVIDENCE", {"bf16:nearest": rows})
    period, why = recommend(parse_spec("bf16"), "v", "adamw", 0.999, stall, None)
    assert period == 1000 and "on 2 of 3 traces" in why and "a (bf16, 3000 steps): none 0.3, every 827 0.29" in why
    # a period that beats no reset by under 1% does not count: no reset wins
    rows = [evidence.Row("a", "bf16", 3000, 827, 1000, 0.30, 0.299, 0.2995)]
    monkeypatch.setattr(evidence, "EVIDENCE", {"bf16:nearest": rows})
    assert recommend(parse_spec("bf16"), "v", "adamw", 0.999, stall, None)[0] is None


def test_advice_after_a_short_applied_reset_names_the_reset_not_the_trace():
    """--reset 1 on a 100-step trace said "only 1 steps: ... record a longer trace"."""
    stall = np.full(100, 0.3)
    period, why = recommend(parse_spec("int4:nearest:b128"), "m", "adamw", 0.9, stall, 1)
    assert period is None and why.startswith("the replay reset every 1 steps: too few between resets (1)")
    assert "--reset none" in why
    period, why = recommend(parse_spec("int4:nearest:b128"), "m", "adamw", 0.9, stall[:10], 50)
    assert why.startswith("only 10 steps: too short")  # the trace itself is short: record a longer one


def test_candidate_runs_replay_together_with_the_errors_they_get_alone(monkeypatch):
    """validate.update_errors replays several (configuration, period) runs in one replay (one
    gradient gather, one fp32 shadow): each run's error is the one it gets replayed alone,
    bit for bit, on the same layout unit; `batch` bounds how many step at once."""
    trace = synthetic.gaussian(1024, 120, beta2=0.99, seed=3)
    near, bnb = parse_config("nearest-4bit"), parse_config("bnb-8bit")  # blocks 128 and 256
    runs = [(near, 40), (near, None), (bnb, 30), (near, 70)]
    alone = [update_errors(trace, [r], None, "cpu", unit=256)[0] for r in runs]
    assert len(set(alone)) == 4  # four different replays, not one repeated
    calls = []
    real = validate_mod.replay
    monkeypatch.setattr(validate_mod, "replay", lambda *a, **k: calls.append(len(a[1].configs)) or real(*a, **k))
    assert update_errors(trace, runs, None, "cpu", unit=256) == alone and calls == [4]
    calls.clear()
    assert update_errors(trace, runs, None, "cpu", batch=3, config_threads=2, unit=256) == alone and calls == [2, 2]
    with pytest.raises(QstateError, match="2 resets for 1 configurations"):
        replay(trace, ReplayOptions([near], resets=["none", "40"], device="cpu"))


def test_the_reset_check_replays_every_candidate_in_one_batch(monkeypatch):
    """`diagnose --check-resets`: the candidate runs of all configurations replay in batches
    of at most max(3, configurations) runs, on the diagnose's own layout unit, and each
    advice carries the error its run gets alone."""
    trace = synthetic.gaussian(1024, 1200, beta2=0.999, seed=4)
    cfgs = [parse_config("bf16"), parse_config("nearest-4bit")]  # candidates: 827 and 1000; 1000
    calls = []
    real = validate_mod.replay
    monkeypatch.setattr(validate_mod, "replay",
                        lambda *a, **k: calls.append([(str(c), r) for c, r in zip(a[1].configs, a[1].resets)])
                        or real(*a, **k))
    doc, raw = diagnose(trace, cfgs, check_resets=True)
    assert calls == [[("bf16", "827"), ("bf16", "1000"), ("nearest-4bit", "1000")]]
    rows = {r["config"]: r for r in doc["records"] if r["state"] == "v"}
    for cfg in cfgs:
        row = rows[str(cfg)]
        tried = [int(p) for c, p in calls[0] if c == str(cfg)]
        alone = {p: update_errors(trace, [(cfg, p)], None, "cpu", unit=raw.layout.unit)[0] for p in tried}
        assert row["reset_update_error"] == min(alone.values())
        assert f"every {tried[-1]}: {alone[tried[-1]]:.4g}" in row["reset_reason"]
    calls.clear()  # replayed with resets, the diagnose has no error without them: those runs join the batch
    doc, _ = diagnose(trace, cfgs, reset="auto", check_resets=True)  # (nearest-4bit: every 33, as AdamW's auto)
    assert {r["config"]: r["reset_applied"] for r in doc["records"]} == {"bf16": 827, "nearest-4bit": 33}
    assert [len(c) for c in calls] == [2, 3]  # 5 runs, at most max(3, 2) at once: evenly, 2 + 3
    assert sorted(sum(calls, [])) == [("bf16", "1000"), ("bf16", "827"), ("bf16", "none"), ("nearest-4bit", "1000"),
                                      ("nearest-4bit", "none")]


def test_the_reset_check_reports_its_steps():
    """The check replays the trace again after the replay (a minute on the demo) and said
    nothing meanwhile: a CI log went quiet. Each of its replays now reports every step."""
    trace = synthetic.gaussian(512, 12, beta2=0.999, seed=3)
    runs = [(parse_config("nearest-4bit"), p) for p in (4, 8, None)]
    calls = []
    update_errors(trace, runs, None, "cpu", batch=2, progress=lambda *a: calls.append(a))
    assert [c[:2] for c in calls] == [(0, 2)] * 12 + [(1, 2)] * 12
    assert [c[2:] for c in calls[:12]] == [(i, 12) for i in range(1, 13)]
