"""What a benchmark steps: our optimizers under a state configuration, and the baselines.

A Subject builds an optimizer over given parameters and says which states it keeps on
each tensor (for the bytes model and the memory accounting):

    ours        qstate_cli.optim.<Optimizer>(states=config, backend=...); path from
                opt.path_for(p): triton | triton-interpreter | cpu-numba | reference
    torch-fused / torch-foreach   torch.optim.AdamW / SGD; states in the parameter dtype
                (torch allows no other: fp32 states at --dtype fp32, bf16 at bf16)
    torch-muon  torch.optim.Muon (2-D parameters only); path "torch" (a per-tensor loop)
    bf16-states qstate's `bf16` preset (bf16 m and v, round to nearest) through our
                optimizer: fp32 or bf16 parameters alike; path as labelled
    bnb-*8bit   bitsandbytes AdamW8bit / Lion8bit / SGD8bit: DE maps, block 256, fp32
                absmax; tensors under 4096 elements keep fp32 states; path "bnb"
    torchao-adamw8bit / -adamw4bit   torchao.optim: block 256 / 128; a tensor is
                quantized when it has >= 4096 elements and a multiple of the block,
                otherwise its states are zeros_like(param); torch.compile per parameter
                (compile time reported apart as compile_ms); path "torchao"
    flashoptim-adamw   FlashOptim's FlashAdamW (fused Triton): int8 m and v with one
                fp16 scale per 32 (bytes modelled with 2-byte scales), v stored as sqrt;
                bf16/fp16 parameters keep an int8 correction (+1 byte read and written per
                element); path "flashoptim"
    te-fusedadam   Transformer Engine's FusedAdam (adam_w_mode), fp32 states (its
                default); path "te"
    (the last two run only when named: --baseline flashoptim-adamw,te-fusedadam; on a
    machine without network they come from .peers/, scripts/gpu_check.sh)

Peers are imported lazily; one that is missing or fails raises Unavailable(reason),
which the engine records as a row with status "unavailable".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import QstateError
from ..optim.registry import optimizer_info
from ..quant.config import StateConfig, StateSpec, parse_config, parse_spec
from ..quant.formats import close_to
from .bytes_model import DTYPE_NAMES, dtype_bytes, step_bytes

PEERS_HINT = "pip install 'qstate-cli[peers]'"
FP32 = parse_spec("fp32")


class Unavailable(Exception):
    """This subject cannot run here; the message says why."""


@dataclass(frozen=True)
class Context:
    """What every build needs to know about the run."""

    optimizer: str
    device: torch.device
    cuda_graph: bool = False
    backend: str = "auto"


@dataclass(frozen=True)
class Subject:
    name: str  # row name: config name or baseline id
    role: str  # "config" | "baseline"
    build: Callable[[list, Context], tuple[torch.optim.Optimizer, str]]  # -> (optimizer, path)
    config: Callable[[torch.dtype], StateConfig]  # states on tensors it quantizes
    fallback: str = "fp32"  # states of tensors it does not quantize: "fp32" | "param"
    min_numel: int = 4096
    block_multiple: bool = False  # quantizes only tensors whose numel is a multiple of the block
    compiles: bool = False  # torch.compile: first step reported as compile_ms
    path: str | None = None  # peers: fixed; ours: from the backend (nominal_path)
    extra_bytes: Callable[[torch.dtype], float] | None = None  # per element, beyond params/grads/states

    def nominal_path(self, ctx: Context) -> str:
        """The path a row is labelled with before (or without) building the optimizer."""
        if self.path:
            return self.path
        if ctx.backend == "reference" or (ctx.backend == "auto" and ctx.device.type != "cuda"):
            return "reference"
        if ctx.backend == "cpu":
            return "cpu-numba"
        return "triton" if ctx.device.type == "cuda" else "triton-interpreter"

    def specs_for(self, optimizer: str, numel: int, param_dtype: torch.dtype) -> list[StateSpec]:
        cfg = self.config(param_dtype)
        specs = [cfg.spec(s) for s in optimizer_info(optimizer).states]
        blocks_ok = all(not self.block_multiple or not s.scaled or numel % s.block == 0 for s in specs)
        if numel >= self.min_numel and blocks_ok:
            return specs
        keep = FP32 if self.fallback == "fp32" else parse_spec(DTYPE_NAMES[param_dtype])
        return [keep] * len(specs)

    def bytes_moved(self, optimizer: str, numels, param_dtype: torch.dtype) -> int:
        b = dtype_bytes(param_dtype)
        extra = self.extra_bytes(param_dtype) if self.extra_bytes else 0
        numels = list(numels)
        return step_bytes(numels, b, b, lambda n: self.specs_for(optimizer, n, param_dtype)) + int(extra * sum(numels))

    def config_text(self, param_dtype: torch.dtype) -> str:
        return self.config(param_dtype).canonical()


def _fixed(cfg: StateConfig):
    return lambda dtype: cfg


PARAM_DTYPE_STATES = {dtype: parse_config(name) for dtype, name in DTYPE_NAMES.items()}


def _param_dtype_states(dtype: torch.dtype) -> StateConfig:
    return PARAM_DTYPE_STATES[dtype]


# ---- ours ------------------------------------------------------------------------------
def ours(config: StateConfig | str, name: str | None = None, role: str = "config", per_param: bool = False) -> Subject:
    """Our optimizer with `config` states. per_param: one param group per tensor, so the
    kernel path makes one launch per parameter (as bitsandbytes, torchao and lpmm do),
    instead of one launch per group: the launch-overhead baseline for --model runs."""
    cfg = parse_config(config)

    def build(params, ctx: Context):
        groups = [{"params": [p]} for p in params] if per_param else params
        opt = optimizer_info(ctx.optimizer).cls(groups, states=cfg, backend=ctx.backend)
        try:
            path = opt.path_for(params[0])
        except QstateError as exc:
            raise Unavailable(str(exc)) from None
        return opt, path

    return Subject(name or str(cfg), role, build, _fixed(cfg))


# ---- torch -------------------------------------------------------------------------------
def _torch(impl: str) -> Subject:
    def build(params, ctx: Context):
        kw = {"fused": True} if impl == "fused" else {"foreach": True}
        if ctx.cuda_graph:
            kw["capturable"] = True
        if ctx.optimizer == "adamw":
            opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, **kw)
        elif ctx.optimizer == "sgd":
            kw.pop("capturable", None)
            opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9, **kw)
        else:
            raise Unavailable(f"torch has no {ctx.optimizer}")
        return opt, f"torch-{impl}"

    return Subject(f"torch-{impl}", "baseline", build, _param_dtype_states, fallback="param", min_numel=0,
                   path=f"torch-{impl}")


def _torch_muon() -> Subject:
    def build(params, ctx: Context):
        if not hasattr(torch.optim, "Muon"):
            raise Unavailable(f"torch {torch.__version__} has no torch.optim.Muon")
        bad = [tuple(p.shape) for p in params if p.ndim != 2]
        if bad:
            raise Unavailable(f"torch.optim.Muon takes 2-D parameters only (got shape {bad[0]})")
        return torch.optim.Muon(params, lr=0.02, weight_decay=0.0), "torch"

    return Subject("torch-muon", "baseline", build, _param_dtype_states, fallback="param", min_numel=0,
                   path="torch")


# ---- peers -------------------------------------------------------------------------------
def import_bitsandbytes():
    try:
        import bitsandbytes
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
        raise Unavailable(f"bitsandbytes is not importable ({type(exc).__name__}: {exc}); {PEERS_HINT}") from None
    return bitsandbytes


def _quiet_torchao_warnings() -> None:
    """torch.compile warns once per shape that torchao's state subclasses lack a stable
    cache hash; that is torchao's business, not the user's: keep stderr readable."""
    import warnings

    warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching.*")


def import_torchao_optim():
    try:
        import torchao.optim
    except Exception as exc:  # noqa: BLE001
        raise Unavailable(f"torchao is not importable ({type(exc).__name__}: {exc}); {PEERS_HINT}") from None
    return torchao.optim


def _bnb(optimizer: str) -> Subject:
    cls_name = {"adamw": "AdamW8bit", "lion": "Lion8bit", "sgd": "SGD8bit"}[optimizer]

    def build(params, ctx: Context):
        bnb = import_bitsandbytes()
        cls = getattr(bnb.optim, cls_name)
        kw = {"lr": 1e-2, "momentum": 0.9} if optimizer == "sgd" else {}
        return cls(params, **kw), "bnb"

    cfg = parse_config("bnb-8bit")
    return Subject(f"bnb-{optimizer}8bit", "baseline", build, _fixed(cfg), path="bnb")


def _torchao(bits: int) -> Subject:
    def build(params, ctx: Context):
        ao = import_torchao_optim()
        _quiet_torchao_warnings()
        torch._dynamo.reset()  # compile each row afresh: fair compile_ms, no cache limits
        return getattr(ao, f"AdamW{bits}bit")(params), "torchao"

    cfg = parse_config(f"torchao-{bits}bit")
    return Subject(f"torchao-adamw{bits}bit", "baseline", build, _fixed(cfg), fallback="param",
                   block_multiple=True, compiles=True, path="torchao")


def _flashoptim() -> Subject:
    def build(params, ctx: Context):
        try:
            from flashoptim import FlashAdamW
        except Exception as exc:  # noqa: BLE001
            raise Unavailable(f"flashoptim is not importable ({type(exc).__name__}: {exc}); "
                              "pip install flashoptim (or carry it in .peers/)") from None
        try:
            return FlashAdamW(params, lr=1e-3, weight_decay=1e-2), "flashoptim"
        except Exception as exc:  # noqa: BLE001 - e.g. a parameter dtype it does not take
            raise Unavailable(f"FlashAdamW refused these parameters: {type(exc).__name__}: {exc}") from None

    cfg = parse_config("m=int8:nearest:b32:sbf16,v=uint8:nearest:b32:sqrt:sbf16")
    correction = lambda dtype: 0.0 if dtype == torch.float32 else 2.0  # noqa: E731 - int8 read + written
    return Subject("flashoptim-adamw", "baseline", build, _fixed(cfg), min_numel=0, path="flashoptim",
                   extra_bytes=correction)


def _te_fused_adam() -> Subject:
    def build(params, ctx: Context):
        try:
            from transformer_engine.pytorch.optimizers import FusedAdam
        except Exception as exc:  # noqa: BLE001
            raise Unavailable(f"transformer_engine is not importable ({type(exc).__name__}: {exc})") from None
        return FusedAdam(params, lr=1e-3, weight_decay=1e-2, adam_w_mode=True), "te"

    return Subject("te-fusedadam", "baseline", build, _fixed(parse_config("fp32")), min_numel=0, path="te")


NAMED_ONLY = ("-per-param", "flashoptim-adamw", "te-fusedadam")  # baselines that run only when named


def baselines(optimizer: str) -> dict[str, Subject]:
    """Every baseline for `optimizer`, in report order."""
    out = {}
    if optimizer in ("adamw", "sgd"):
        out["torch-fused"] = _torch("fused")
        out["torch-foreach"] = _torch("foreach")
    if optimizer == "muon":
        out["torch-muon"] = _torch_muon()
    out["bf16-states"] = ours("bf16", name="bf16-states", role="baseline")
    out["bred-4bit-per-param"] = ours("bred-4bit", name="bred-4bit-per-param", role="baseline", per_param=True)
    if optimizer in ("adamw", "lion", "sgd"):
        out[f"bnb-{optimizer}8bit"] = _bnb(optimizer)
    if optimizer == "adamw":
        out["torchao-adamw8bit"] = _torchao(8)
        out["torchao-adamw4bit"] = _torchao(4)
        out["flashoptim-adamw"] = _flashoptim()
        out["te-fusedadam"] = _te_fused_adam()
    return out


def default_baselines(optimizer: str, bits: int | None) -> list[str]:
    """All baselines, except the torchao peer of the other bit width when the configs
    are all `bits` wide (--bits 4 meets torchao's AdamW4bit, --bits 8 its AdamW8bit;
    `--baseline all` keeps both). The per-parameter-launch baseline only means something
    with many tensors (--model), so it runs when named."""
    names = [n for n in baselines(optimizer) if not n.endswith(NAMED_ONLY)]  # asked for by name
    if bits in (4, 8):
        names = [n for n in names if n != f"torchao-adamw{12 - bits}bit"]
    return names


NONE = "none"  # --config none / --baseline none: nothing of that kind (a suite's empty list)


def config_or_none(text) -> StateConfig | str:
    """A --config value: a configuration, or `none` (time the baselines only)."""
    return NONE if str(text).strip().lower() == NONE else parse_config(text)


def chosen_configs(given: list, defaults: list[str]) -> list[StateConfig]:
    """The configurations to measure: those given, none for [`none`], else the defaults."""
    if NONE in given:
        if len(given) > 1:
            raise QstateError("--config none: name it alone (it means no configuration, the baselines only)")
        return []
    return list(given) or [parse_config(c) for c in defaults]


def select_baselines(optimizer: str, names, bits: int | None = None) -> list[Subject]:
    """`names` empty: the defaults for `bits`; ["all"]: all; ["none"]: none; else those named."""
    known = baselines(optimizer)
    names = [n.strip().lower() for n in (names or default_baselines(optimizer, bits)) if n.strip()]
    if names == ["all"]:
        return list(known.values())
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in known]
    if unknown:
        raise QstateError(f"unknown baseline {unknown[0]!r} for {optimizer}: choose from {', '.join(known)}, all, "
                          f"none{close_to(unknown[0], known)}")
    return [known[n] for n in names]
