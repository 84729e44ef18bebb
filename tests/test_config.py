"""The naming grammar: parse/print round trips, presets, defaults, and helpful errors."""
import pytest

from qstate_cli.errors import QstateError
from qstate_cli.quant import PRESETS, parse_config, parse_spec


@pytest.mark.parametrize("text", ["int4:bred:b128", "uint4:bred:b128:sqrt", "de8:nearest:b256", "bf16:stochastic",
                                  "e4m3:nearest:b256", "int8:bred:b64:sbf16", "fp32", "lin4nz:nearest:b32"])
def test_spec_text_round_trips(text):
    assert str(parse_spec(text)) == text
    assert parse_spec(str(parse_spec(text))) == parse_spec(text)


def test_aliases_and_defaults():
    assert str(parse_spec("fp8:sr")) == "e4m3:stochastic"
    assert parse_spec("int4").block == 128 and parse_spec("de8").block == 256
    assert parse_spec("bf16").block is None and parse_spec("int4").rounding == "nearest"


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_parse_and_print_their_name(name):
    cfg = parse_config(name)
    assert str(cfg) == name or PRESETS[str(cfg)][0] == PRESETS[name][0]
    again = parse_config(cfg.canonical())
    assert again.canonical() == cfg.canonical()


def test_required_presets_exist_with_the_peer_settings():
    assert parse_config("bnb-8bit").canonical() == "m=de8:nearest:b256,v=de8u:nearest:b256"
    assert parse_config("torchao-4bit").canonical() == "m=de4:nearest:b128,v=lin4nz:nearest:b128"
    for name in ["fp32", "bf16", "bf16-sr", "fp8", "nearest-4bit", "sr-4bit", "bred-4bit"]:
        assert name in PRESETS


def test_explicit_config_is_named_after_a_matching_preset():
    assert str(parse_config("m=int4:bred:b128,v=lin4nz:bred:b128")) == "bred-4bit"
    assert str(parse_config("m=int4:bred:b64,v=uint4:bred:b64")) == "m=int4:bred:b64,v=uint4:bred:b64"


@pytest.mark.parametrize("bad,hint", [
    ("bred4bit", "bred-4bit"), ("torchao4bit", "torchao-4bit"), ("int5:bred", "int4"),
    ("int4:bredd", "bred"), ("m=int4,w=int4", "states are m and v"), ("int4:b7", "block size"),
    ("int4:b4096", "block size"), ("", "empty")])
def test_unknown_names_fail_with_the_closest_matches(bad, hint):
    with pytest.raises(QstateError, match=hint):
        parse_config(bad)


def test_m_alone_is_for_momentum_optimizers_and_refused_where_there_is_a_v():
    cfg = parse_config("m=int4:bred:b128")
    assert cfg.spec("m") == parse_config("int4:bred:b128").m
    with pytest.raises(QstateError, match="the v state needs a spec too"):
        cfg.spec("v")
