"""Compile the fused kernels for an sm_90 target without a GPU and count PTX instructions.

Run as a script (TRITON_INTERPRET unset): `python tests/kernel_ptx_probe.py` prints one
JSON object per variant. The real launchers (kernels/*.py) are called with CPU tensors
and a stand-in kernel that records the launch arguments; the recorded arguments then
compile the real Triton kernel through `triton.compile`, as a launch on an H100/H200 would.
"""
from __future__ import annotations

import json
import re
import sys
from collections import Counter

import torch

TYPES = {torch.float32: "*fp32", torch.int64: "*i64", torch.int32: "*i32", torch.uint8: "*u8",
         torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int16: "*i16"}
OPS = r"^\s+(?:@!?%p\d+ )?((?:ld|st)\.(?:global|shared)[.\w]*|fma\.rn\.f32|div\.\w+\.f32|sqrt\.\w+\.f32|bar\.sync)"


class Recorder:
    def __init__(self, jit):
        self.jit, self.calls = jit, []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((args, kw))


def record(op: str, states: str, dtype: torch.dtype, numel: int = 4096):
    from qstate_cli.kernels import adamw, launch, muon
    from qstate_cli.optim import rules
    from qstate_cli.quant import QuantizedState, parse_config

    c = parse_config(states)
    p = torch.zeros(numel, dtype=dtype)
    qs = {n: QuantizedState(c.spec(n), p.shape) for n in "mv"}
    member = launch.Member(p, p.clone(), {n: (q.codes, q.scales) for n, q in qs.items()},
                           torch.zeros((), dtype=torch.int64), 0,
                           out=torch.zeros(numel) if op == "muon" else None)
    batch = launch.build_batch([member], c.m.block)
    lm, lv = launch.kernel_layout(c.m), launch.kernel_layout(c.v)
    scal = rules.pack_scalars(rules.step_scalars(1e-3, 0.0, 0.9, 0.999, 1, "cpu"))
    mod = {"adamw": adamw, "muon": muon}[op]
    name = f"_{op}_kernel"
    rec = Recorder(getattr(mod, name))
    setattr(mod, name, rec)
    try:
        if op == "adamw":
            adamw.adamw_step(batch, scal, lm, lv, p_kind=launch.VALUE_KINDS[dtype], g_kind=launch.VALUE_KINDS[dtype],
                             step=2, written=(1, 1), fresh=(False, False), beta1=0.9, beta2=0.999, eps=1e-8,
                             tables=(lm.table("cpu"), lv.table("cpu")))
        else:
            muon.muon_momentum_step(batch, lm, g_kind=launch.VALUE_KINDS[dtype], step=2, written=1,
                                    fresh=False, momentum=0.95, nesterov=True, table=lm.table("cpu"))
    finally:
        setattr(mod, name, rec.jit)
    return rec.jit, rec.calls[0]


def compile_ptx(jit, call, arch: int = 90) -> str:
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    args, kw = call
    names = list(inspect.signature(jit.fn).parameters)
    options = {k: kw.pop(k) for k in ("num_warps", "enable_fp_fusion") if k in kw}
    values = dict(zip(names, args), **kw)
    sig, const, attrs = {}, {}, {}
    for i, n in enumerate(names):
        v = values[n]
        if n in kw:
            sig[n] = "constexpr"
            const[(i,)] = v
        elif isinstance(v, torch.Tensor):
            sig[n] = TYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[n] = "fp32" if isinstance(v, float) else "i32"
    src = ASTSource(jit, sig, const, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options).asm["ptx"]


def summarize(ptx: str) -> dict:
    """Counts of memory, division, sqrt, FMA and barrier instructions, and of .ftz ones."""
    return {"all": dict(Counter(re.findall(OPS, ptx, re.M))), "ftz": len(re.findall(r"\.ftz\b", ptx))}


VARIANTS = [("adamw", "bred-4bit", torch.bfloat16), ("adamw", "torchao-4bit", torch.float32),
            ("muon", "m=int8:sr:b256", torch.bfloat16)]

if __name__ == "__main__":
    for op, states, dtype in VARIANTS:
        jit, call = record(op, states, dtype)
        try:
            result = summarize(compile_ptx(jit, call))
        except Exception as exc:  # noqa: BLE001
            from triton.compiler.errors import CompilationError

            if isinstance(exc, CompilationError):  # an error in the kernel's code: report it
                raise
            # no CUDA backend or toolchain here, or another Triton version's compile API
            result = {"unavailable": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(dict(op=op, states=states, dtype=str(dtype), **result)), flush=True)
    sys.exit(0)
