"""Parameter shape lists of published architectures (no weights), for whole-model steps.

Computed from the architectures' hyper-parameters, tensor by tensor, as the Hugging Face
implementations lay them out (GPT-2: Conv1D weights are (in, out) and the LM head is
tied to wte; Llama: Linear weights are (out, in), RMSNorm weights only). Totals equal
the published parameter counts (tests check them):

    gpt2-small      124,439,808    12 layers, d 768                      (GPT-2 paper, HF)
    gpt2-medium     354,823,168    24 layers, d 1024
    gpt2-large      774,030,080    36 layers, d 1280
    gpt2-xl       1,557,611,200    48 layers, d 1600
    llama-1b      1,235,814,400    Llama-3.2-1B: 16 layers, d 2048, GQA 32/8, ffn 8192, vocab 128256, tied
    tinyllama-1.1b 1,100,048,384   22 layers, d 2048, GQA 32/4, ffn 5632, vocab 32000, untied
    llama-7b      6,738,415,616    Llama-2-7B: 32 layers, d 4096, ffn 11008, vocab 32000, untied

plus qstate's own `tiny-lm` / `small-lm` (models/tiny_lm.py: named_shapes, from the config),
small enough for a CPU. A custom list is written `768x3072*12,3072*12,768` (shapes
separated by commas, `*k` repeats one k times).

`--model` (bench kernels, bench memory; a suite point's `model`) takes several models, and
a comma separates models as well as a custom model's shapes, so `split_models` reads a value
so: commas separate built-in names (`gpt2-small,llama-1b`: two models), and shapes written
one after another are one custom model (`4096x1024*2,1024*4`: one model of 6 tensors;
`gpt2-small,768x768,768`: two). Two custom models are two values (`--model 768x768
--model 1024x1024`; a YAML list `[768x768, 1024x1024]`). `qstate audit --model` takes one
model, so its value is always one.
"""
from __future__ import annotations

import functools
import math

from ..errors import QstateError, clip
from ..quant.formats import suggest

Shape = tuple[int, ...]


def gpt2(n_layer: int, d: int, vocab: int = 50257, ctx: int = 1024) -> list[tuple[str, Shape]]:
    """(name, shape) of GPT-2's parameters, named as Hugging Face's GPT2Model names them."""
    named: list[tuple[str, Shape]] = [("wte.weight", (vocab, d)), ("wpe.weight", (ctx, d))]  # wte: tied LM head
    for i in range(n_layer):
        named += [(f"h.{i}.{name}", shape) for name, shape in (
            ("ln_1.weight", (d,)), ("ln_1.bias", (d,)),
            ("attn.c_attn.weight", (d, 3 * d)), ("attn.c_attn.bias", (3 * d,)),
            ("attn.c_proj.weight", (d, d)), ("attn.c_proj.bias", (d,)),
            ("ln_2.weight", (d,)), ("ln_2.bias", (d,)),
            ("mlp.c_fc.weight", (d, 4 * d)), ("mlp.c_fc.bias", (4 * d,)),
            ("mlp.c_proj.weight", (4 * d, d)), ("mlp.c_proj.bias", (d,)))]
    return named + [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]


def llama(n_layer: int, d: int, ffn: int, n_head: int, n_kv: int, vocab: int,
          tied: bool) -> list[tuple[str, Shape]]:
    """(name, shape) of a Llama's parameters, named as Hugging Face's LlamaForCausalLM names them."""
    hd = d // n_head
    named: list[tuple[str, Shape]] = [("model.embed_tokens.weight", (vocab, d))]
    for i in range(n_layer):
        named += [(f"model.layers.{i}.{name}", shape) for name, shape in (
            ("self_attn.q_proj.weight", (n_head * hd, d)), ("self_attn.k_proj.weight", (n_kv * hd, d)),
            ("self_attn.v_proj.weight", (n_kv * hd, d)), ("self_attn.o_proj.weight", (d, n_head * hd)),
            ("mlp.gate_proj.weight", (ffn, d)), ("mlp.up_proj.weight", (ffn, d)),
            ("mlp.down_proj.weight", (d, ffn)),
            ("input_layernorm.weight", (d,)), ("post_attention_layernorm.weight", (d,)))]
    named.append(("model.norm.weight", (d,)))
    if not tied:
        named.append(("lm_head.weight", (vocab, d)))
    return named


def _tiny_lm(name: str) -> list[tuple[str, Shape]]:
    from ..models.tiny_lm import SIZES, named_shapes

    return named_shapes(SIZES[name])


MODELS = {
    "gpt2-small": lambda: gpt2(12, 768),
    "gpt2-medium": lambda: gpt2(24, 1024),
    "gpt2-large": lambda: gpt2(36, 1280),
    "gpt2-xl": lambda: gpt2(48, 1600),
    "llama-1b": lambda: llama(16, 2048, 8192, 32, 8, 128256, tied=True),
    "tinyllama-1.1b": lambda: llama(22, 2048, 5632, 32, 4, 32000, tied=False),
    "llama-7b": lambda: llama(32, 4096, 11008, 32, 32, 32000, tied=False),
    "tiny-lm": lambda: _tiny_lm("tiny-lm"),
    "small-lm": lambda: _tiny_lm("small-lm"),
}


def _is_shape(part: str) -> bool:
    """A piece of a custom shape list (`768x3072*12`, `768`), as model_named_shapes reads one."""
    key = part.strip().lower()
    return any(ch.isdigit() for ch in key) and all(ch in "0123456789x* " for ch in key)


def split_models(value) -> list:
    """The models a `--model` value names (see module doc): one value, a list of them, or
    comma-separated text; a shape piece that follows a shape piece of the same value
    continues that custom model, every other piece is a model of its own."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    out: list = []
    for item in items:
        if not isinstance(item, str):
            if item is not None:
                out.append(item)
            continue
        models: list[str] = []
        for part in (p.strip() for p in item.split(",")):
            if not part:
                continue
            if models and _is_shape(part) and _is_shape(models[-1].rpartition(",")[2]):
                models[-1] += "," + part
            else:
                models.append(part)
        out += models
    return out


def model_shapes(name: str) -> list[Shape]:
    """The parameter shapes of a built-in model, or of a custom list (see module doc)."""
    return [shape for _, shape in model_named_shapes(name)]


def model_named_shapes(name: str) -> list[tuple[str, Shape]]:
    """(name, shape) per parameter: a built-in model's own names, `param{i}` in a custom list."""
    key = name.strip().lower()
    if key in MODELS:
        return list(_builtin(key))
    if any(ch.isdigit() for ch in key) and all(ch in "0123456789x*, " for ch in key):
        return [(f"param{i}", shape) for i, shape in enumerate(_parse_custom(key))]
    raise QstateError(f"unknown model {name!r}{suggest(key, list(MODELS))} "
                      f"(or give shapes such as 768x3072*12,768)")


@functools.lru_cache(maxsize=None)
def _builtin(key: str) -> tuple[tuple[str, Shape], ...]:
    return tuple(MODELS[key]())  # once per process: a suite checks every point's model


MAX_TENSORS = 100_000  # tensors of a custom shape list: llama-7b has 291; more is a typo


def _parse_custom(text: str) -> list[Shape]:
    """`768x3072*12,768`; at most MAX_TENSORS tensors and 2^48 elements in all, both
    counted before the list is built (`5*99999999999999999999` is refused at once)."""
    parsed: list[tuple[Shape, int]] = []
    tensors = elements = 0
    for part in (p.strip() for p in text.split(",") if p.strip()):
        shape_text, _, times = part.partition("*")
        try:
            shape = tuple(int(d) for d in shape_text.split("x"))
            count = int(times) if times else 1
        except ValueError:
            raise QstateError(f"bad shape {part!r} in {_clip(text)!r}: write e.g. 768x3072*12") from None
        if not shape or min(shape) < 1 or count < 1:
            raise QstateError(f"bad shape {part!r} in {_clip(text)!r}: dimensions and counts must be >= 1")
        tensors += count
        elements += math.prod(shape) * count
        if tensors > MAX_TENSORS:
            raise QstateError(f"shapes {_clip(text)!r}: more than {MAX_TENSORS:,} tensors")
        if elements.bit_length() > MAX_COUNT_BITS:
            raise QstateError(f"shapes {_clip(text)!r}: more than 2^{MAX_COUNT_BITS} elements")
        parsed.append((shape, count))
    return [shape for shape, count in parsed for _ in range(count)]


def _clip(text: str) -> str:
    return clip(text, 60)


def numel(shapes) -> int:
    return sum(math.prod(s) for s in shapes)


def sweep_shape(n: int, matrix: bool) -> Shape:
    """One tensor of n elements: (n,) or, for Muon (matrix=True), the squarest
    (rows, n // rows) with rows a power of two dividing n."""
    if not matrix:
        return (n,)
    rows = 1
    while rows * 2 <= math.isqrt(n) and n % (rows * 2) == 0:
        rows *= 2
    return (rows, n // rows)


MAX_COUNT_BITS = 48  # 2^48 elements: far past any memory; larger is a typo, not a size to try


def parse_count(text) -> int:
    """An element count: 1048576, "1e8", "2^20" or "2**20", below 2^48 (QstateError
    otherwise; a power is bounded before it is computed, so 9^99999999 is refused at once)."""
    if isinstance(text, bool):
        raise QstateError(f"numel {text!r}: give a whole number of elements (1048576, 1e8, 2^20)")
    if isinstance(text, int):
        if text.bit_length() > MAX_COUNT_BITS:
            raise QstateError(f"numel {text}: more than 2^{MAX_COUNT_BITS} elements")
        return text
    t = str(text).strip().lower().replace("_", "")
    too_big = QstateError(f"numel {text!r}: more than 2^{MAX_COUNT_BITS} elements")
    try:
        if "^" in t or "**" in t:
            base, _, exp = t.replace("**", "^").partition("^")
            base, exp = int(base), int(exp)
            if exp < 0:
                raise ValueError
            if base > 1 and exp * math.log2(base) > MAX_COUNT_BITS:  # before computing a huge power
                raise too_big
            value = base ** exp
        else:
            f = float(t)
            if math.isfinite(f) and f >= 2.0 ** MAX_COUNT_BITS:
                raise too_big
            if f != int(f):
                raise ValueError
            value = int(f)
    except (ValueError, OverflowError):
        raise QstateError(f"numel {text!r}: give a whole number of elements (1048576, 1e8, 2^20)") from None
    if value.bit_length() > MAX_COUNT_BITS:
        raise QstateError(f"numel {text!r}: more than 2^{MAX_COUNT_BITS} elements")
    return value
