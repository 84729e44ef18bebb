"""Compile `y = sqrt(x)` for sm_90 twice, with tl.sqrt_rn (ptxas's sqrt.rn.f32) and with
kernels.fastmath.sqrt_rn (four elements per guard), and print as JSON what each computes
on its fast path: per stored element the expression, and the guard's predicates.

Run as a script with TRITON_INTERPRET unset (tests/test_kernels_fastmath.py does). The
fast path is the shortest path from entry to EXIT with slow-path calls costed as never
taken (kernels/sass.py); along it every instruction is evaluated symbolically: loaded
values are x0..x3, immediates stay as written, commutative operands are sorted.
"""
from __future__ import annotations

import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from qstate_cli.kernels import fastmath as fm  # noqa: E402
from qstate_cli.kernels import sass  # noqa: E402

N = 128  # one warp: four elements per thread, one 16-byte load and store


@triton.jit
def _ptxas_sqrt(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, tl.sqrt_rn(tl.load(x_ptr + i)))


@triton.jit
def _fast_sqrt(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, fm.sqrt_rn(tl.load(x_ptr + i), False))


@triton.jit
def _fast_sqrt_low(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, fm.sqrt_rn_low_guard(tl.load(x_ptr + i), False))


def compile_sass(fn) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn, {"x_ptr": "*fp32", "y_ptr": "*fp32", "N": "constexpr"}, {(2,): N},
                    {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "enable_fp_fusion": False})
    return sass.disassemble(kernel.asm["cubin"])


OPERAND = re.compile(r"(-?)\|?([A-Z]*R[0-9Z]+|PT|P[0-6]|[-0-9a-fx.+eINF]+)\|?(?:\.reuse)?")


def _val(env: dict, tok: str) -> str:
    m = OPERAND.fullmatch(tok.strip())
    if not m:
        return tok.strip()
    neg, name = m.groups()
    if re.fullmatch(r"R\d+", name):
        return neg + env.get(name, name)
    return neg + name


def fast_path(text: str) -> dict:
    """{'stored': [expression per stored element], 'guards': sorted predicate atoms}."""
    instrs, labels = sass.parse_sass(text)
    lines = [ln for ln in text.splitlines() if sass.LINE.match(ln)]
    blocks, _ = sass._blocks(instrs, labels)
    costs = [sass._cost(instrs, b) for b in blocks]
    exits = {j for j, b in enumerate(blocks) if instrs[b.end - 1].opcode == "EXIT"}
    _, path = sass._shortest(blocks, costs, 0, exits)
    env, stored, guards = {}, [], set()
    for j in path:
        for i in range(blocks[j].start, blocks[j].end):
            m = sass.LINE.match(lines[i])
            op, args = m.group(3) + m.group(4), [a.strip() for a in m.group(5).split(",")]
            base = m.group(3)
            if base == "LDG":
                first = int(args[0][1:])
                for k in range(4 if op.endswith(".128") else 1):
                    env[f"R{first + k}"] = f"x{k}"
            elif base == "STG":
                first = int(args[-1][1:])
                stored += [env.get(f"R{first + k}", f"R{first + k}") for k in range(4 if op.endswith(".128") else 1)]
            elif base == "MUFU":
                env[args[0]] = f"{op}({_val(env, args[1])})"
            elif base in ("FMUL", "FADD"):
                a, b = sorted((_val(env, args[1]), _val(env, args[2])))
                env[args[0]] = f"{op}({a},{b})"
            elif base == "FFMA":
                a, b = _val(env, args[1]), _val(env, args[2])
                sign = "-" if a.startswith("-") != b.startswith("-") else ""
                a, b = sorted((a.lstrip("-"), b.lstrip("-")))
                env[args[0]] = f"{op}({sign}{a}*{b},{_val(env, args[3])})"
            elif base in ("VIADD", "IADD3"):
                terms = [_val(env, a) for a in args[1:] if a not in ("RZ", "PT")]
                consts = [int(t, 16) % 2 ** 32 for t in terms if re.fullmatch(r"-?0x[0-9a-f]+", t)]
                regs = sorted(t for t in terms if not re.fullmatch(r"-?0x[0-9a-f]+", t))
                env[args[0]] = f"add({','.join(regs)},{hex(sum(consts) % 2 ** 32)})"
            elif base in ("MOV", "IMAD") and op in ("MOV", "IMAD.MOV.U32", "IMAD.MOV"):
                env[args[0]] = _val(env, args[-1] if base == "MOV" else args[3])
            elif base == "FMNMX":
                a, b = sorted((_val(env, args[1]), _val(env, args[2])))
                env[args[0]] = f"{op}({a},{b},{args[3]})"
            elif base == "FSETP":
                guards.add(f"{op}({_val(env, args[2])},{_val(env, args[3])})")
            elif base == "ISETP":
                cmp = op.split(".")[1] + "." + op.split(".")[2]
                guards.add(f"{cmp}({_val(env, args[2])},{_val(env, args[3])})")
    return {"stored": stored, "guards": sorted(guards)}


if __name__ == "__main__":
    try:
        out = {"ptxas": fast_path(compile_sass(_ptxas_sqrt)), "fastmath": fast_path(compile_sass(_fast_sqrt)),
               "low_guard": fast_path(compile_sass(_fast_sqrt_low))}
    except Exception as exc:  # noqa: BLE001 - no CUDA backend here: the test skips
        from triton.compiler.errors import CompilationError

        if isinstance(exc, CompilationError):
            raise
        out = {"unavailable": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out))
