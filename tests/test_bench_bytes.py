"""The bytes model against hand-computed cases (BRIEF §2), and the model shape lists
against the published parameter counts."""
import pytest
import torch

from qstate_cli.bench.bytes_model import bytes_per_element, gbps, step_bytes
from qstate_cli.bench.shapes import model_shapes, numel, parse_count, sweep_shape
from qstate_cli.bench.subjects import baselines, ours
from qstate_cli.errors import QstateError
from qstate_cli.quant import parse_config


def specs(config, states=("m", "v")):
    cfg = parse_config(config)
    return [cfg.spec(s) for s in states]


@pytest.mark.parametrize("config, p, expected", [
    ("bred-4bit", 2, 8.125),        # BRIEF: 2*2 + 2 + 2*2*0.5 + 8*2/128
    ("bred-4bit", 4, 14.125),       # fp32 p and g
    ("nearest-4bit", 2, 8.125),     # rounding does not change the bytes
    ("torchao-4bit", 4, 14.125),    # DE m / no-zero v, block 128: same bytes
    ("fp32", 2, 22.0),              # torch fused AdamW, fp32 states, bf16 p/g
    ("fp32", 4, 28.0),              # ... fp32 p/g
    ("bnb-8bit", 2, 6 + 2 * 2 * (1 + 4 / 256)),   # 10.0625
    ("bf16", 4, 12 + 2 * 2 * 2),    # 20
    ("m=int4:bred:b128:sbf16,v=uint4:bred:b128:sqrt:sbf16", 2, 6 + 2 * 2 * (0.5 + 2 / 128)),  # bf16 scales: 8.0625
    ("m=int4:bred:b32,v=uint4:bred:b32", 2, 6 + 2 * 2 * (0.5 + 4 / 32)),  # block 32: 8.5
])
def test_adamw_bytes_per_element(config, p, expected):
    assert bytes_per_element(p, p, specs(config)) == pytest.approx(expected, abs=1e-12)


def test_one_state_optimizers():
    assert bytes_per_element(4, 4, specs("bred-4bit", ("m",))) == pytest.approx(12 + 2 * (0.5 + 4 / 128))  # Lion/SGD/Muon
    assert bytes_per_element(2, 2, specs("fp32", ("m",))) == 14.0


def test_step_bytes_exact_with_a_short_last_block():
    # 130 int4 elements at block 128: codes ceil(130*4/8) = 65 bytes, scales 2 blocks * 4 = 8
    per_state = 65 + 8
    assert step_bytes([130], 4, 4, lambda n: specs("nearest-4bit")) == 130 * 12 + 2 * 2 * per_state
    # odd element count: 3 int4 codes need 2 bytes
    assert step_bytes([3], 2, 2, lambda n: specs("nearest-4bit", ("m",))) == 3 * 6 + 2 * (2 + 4)


def test_subject_bytes_follow_what_each_optimizer_keeps():
    fp32 = torch.float32
    n = 1 << 20
    # ours: quantized at >= 4096 elements (1.0625 bytes/param in the limit), fp32 below
    assert ours("bred-4bit").bytes_moved("adamw", [n], fp32) == n * 14.125
    assert ours("bred-4bit").bytes_moved("adamw", [100], fp32) == 100 * 28
    b = baselines("adamw")
    assert b["torch-fused"].bytes_moved("adamw", [n], fp32) == n * 28
    assert b["torch-fused"].bytes_moved("adamw", [n], torch.bfloat16) == n * (6 + 2 * 2 * 2)  # bf16 states
    assert b["bnb-adamw8bit"].bytes_moved("adamw", [4095], fp32) == 4095 * 28               # < 4096: fp32 states
    ao = b["torchao-adamw4bit"]
    assert ao.bytes_moved("adamw", [n], fp32) == n * 14.125
    # torchao quantizes only multiples of the block; others keep zeros_like(param) states
    assert ao.bytes_moved("adamw", [4096 + 64], torch.bfloat16) == (4096 + 64) * (6 + 8)
    assert b["torch-fused"].config_text(fp32) == "m=fp32,v=fp32"


def test_gbps():
    assert gbps(2_000_000_000, 1000.0) == 2.0


@pytest.mark.parametrize("name, total", [
    ("gpt2-small", 124_439_808), ("gpt2-medium", 354_823_168), ("gpt2-large", 774_030_080),
    ("gpt2-xl", 1_557_611_200), ("llama-1b", 1_235_814_400), ("tinyllama-1.1b", 1_100_048_384),
    ("llama-7b", 6_738_415_616),
])
def test_model_shapes_match_published_counts(name, total):
    assert numel(model_shapes(name)) == total


def test_published_models_name_every_parameter_once():
    from qstate_cli.bench.shapes import model_named_shapes

    llama = dict(model_named_shapes("llama-7b"))
    assert len(llama) == 291 and llama["lm_head.weight"] == (32000, 4096)
    assert llama["model.layers.31.mlp.down_proj.weight"] == (4096, 11008)
    assert "lm_head.weight" not in dict(model_named_shapes("llama-1b"))  # tied to the embedding
    assert model_named_shapes("3x4*2")[1] == ("param1", (3, 4))


@pytest.mark.parametrize("name", ["tiny-lm", "small-lm"])
def test_tiny_lm_shapes_equal_the_real_module(name):
    from qstate_cli.bench.shapes import model_named_shapes
    from qstate_cli.models.tiny_lm import build

    assert model_named_shapes(name) == [(n, tuple(p.shape)) for n, p in build(name).named_parameters()]


def test_tiny_lm_shapes_do_not_import_dynamo():
    """Built on the meta device, tiny-lm's shapes imported torch._dynamo (and sympy): 1-2 s
    more for every `bench memory`, `suite validate` and `qstate run` of a suite naming it."""
    import subprocess
    import sys

    code = ("import sys; from qstate_cli.bench.shapes import model_shapes; model_shapes('small-lm'); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_custom_shapes_and_errors():
    assert model_shapes("768x3072*2, 3") == [(768, 3072), (768, 3072), (3,)]
    with pytest.raises(QstateError, match="gpt2-small"):
        model_shapes("gpt2-smal")
    with pytest.raises(QstateError):
        model_shapes("0x5")


def test_counts_and_sweep_shapes():
    assert [parse_count(t) for t in ("1048576", "1e6", "2^20", "2**10", 7)] == [1 << 20, 10**6, 1 << 20, 1024, 7]
    with pytest.raises(QstateError):
        parse_count("1.5")
    assert sweep_shape(1 << 20, matrix=False) == (1 << 20,)
    assert sweep_shape(1 << 20, matrix=True) == (1024, 1024)
    assert sweep_shape(3 * 4096, matrix=True) == (64, 192)


def test_flashoptim_bytes_count_its_int8_correction_of_bf16_parameters():
    n = 1 << 20
    fo = baselines("adamw")["flashoptim-adamw"]
    assert fo.bytes_moved("adamw", [n], torch.bfloat16) == n * (6 + 2 * 2 * (1 + 2 / 32) + 2)
    assert fo.bytes_moved("adamw", [n], torch.float32) == n * (12 + 2 * 2 * (1 + 2 / 32))
