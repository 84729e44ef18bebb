"""Reset advice that helps: every recommended period is replayed against the fp32
optimizer without resets and kept only where it lowers the update error."""
import pytest

from qstate_cli.diagnose import diagnose, validate as validate_mod
from qstate_cli.diagnose.validate import candidates, update_error, validate
from qstate_cli.quant import parse_config, parse_spec
from qstate_cli.trace import synthetic


def test_candidates_include_the_published_period_for_minifloats():
    assert candidates(parse_spec("bf16"), 0.999, 827) == [827, 1000]
    assert candidates(parse_spec("e2m2"), 0.999, 33) == [33, 200]
    assert candidates(parse_spec("bf16"), 0.99, 80) == [80]  # published periods are for beta2 = 0.999
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
    cfg = parse_config("nearest-4bit")
    doc, _ = diagnose(trace, [cfg], check_resets=True)
    v = [r for r in doc["records"] if r["state"] == "v"][0]
    assert v["code_stall_rate_late"] > 0.95 and "too little stalling" not in v["reset_reason"]
    assert "replayed" in v["reset_reason"] and "every 1000" in v["reset_reason"]
    assert v["no_reset_update_error"] == pytest.approx(v["update_rel_error"])
    assert v["reset_update_error"] == pytest.approx(update_error(trace, cfg, 1000, None, "cpu"))
    pays = v["reset_update_error"] < 0.99 * v["no_reset_update_error"]
    assert (v["reset_period"] == 1000) == pays
    assert ("does not pay" in v["reset_reason"]) == (not pays)
