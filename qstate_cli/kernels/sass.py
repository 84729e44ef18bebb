"""The fused kernels as sm_90 machine code, without a GPU: compile, disassemble, count.

A launcher (adamw_step, lion_step, sgd_step, muon_momentum_step) is called with CPU
tensors and a stand-in kernel that records its arguments (`record_launch`); those
arguments compile the real Triton kernel for an sm_90 target (`compile_cubin`: what a
launch on an H100/H200 would build), Triton's own `nvdisasm` turns the cubin into SASS
(`disassemble`), and `hot_path` counts the instructions a warp issues:

    per tile     the shortest path once around the tile loop (back edge to back edge),
                 with every call (the div.rn / sqrt.rn slow paths, taken only for
                 subnormal or special operands) costed as unreachable: the full-tile
                 branch, the fast paths
    per program  entry -> loop head plus loop exit -> EXIT (hash keys, addresses, the
                 non-finite counter), spread over the program's tiles

Instructions per element = (per_program / tiles + per_tile) / elements per thread per
tile, where elements per thread = ROWS * B / (32 * num_warps). Predicated instructions
count: a warp issues them whether or not the predicate holds. Counts are by class
(`CLASSES`: memory, integer, float, conversion, control).

No I/O besides running nvdisasm on a temporary file; the compile is Triton's (cached in
~/.triton/cache). Works with Triton 3.6 and 3.9 (ASTSource + GPUTarget).
"""
from __future__ import annotations

import heapq
import inspect
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field

import torch

TYPES = {torch.float32: "*fp32", torch.int64: "*i64", torch.int32: "*i32", torch.uint8: "*u8",
         torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int16: "*i16"}
CALL_COST = 10 ** 6  # a call is a slow path: never on the hot path
OPS = ("adamw", "lion", "sgd", "muon")

# SASS opcode (before the first '.') -> class. Uniform-datapath (U*) instructions take
# issue slots like the others and are classed with their vector twins.
CLASSES = {
    "integer": set(),  # the default: IMAD, IADD3, LOP3, SHF, LEA, ISETP, SEL, PRMT, MOV, P2R, VIADD, ...
    "memory": {"LDG", "STG", "LDS", "STS", "LDL", "STL", "LD", "ST", "LDC", "ULDC", "ATOMG", "ATOMS", "ATOM",
               "RED", "REDG", "LDSM", "CCTL", "MEMBAR", "ERRBAR", "CGAERRBAR", "LDGSTS", "LDGDEPBAR",
               "SHFL", "REDUX", "UBLKCP", "UTMALDG", "UTMASTG", "SYNCS"},
    "float": {"FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FSET", "FCHK", "MUFU", "HADD2", "HMUL2",
              "HFMA2", "HSETP2", "HMNMX2", "FSWZADD", "DADD", "DMUL", "DFMA", "DSETP"},
    "conversion": {"F2F", "F2I", "I2F", "I2FP", "F2FP", "FRND", "F2IP", "I2I", "I2IP"},
    "control": {"BRA", "BRX", "JMP", "CALL", "RET", "EXIT", "BSSY", "BSYNC", "BAR", "NOP", "WARPSYNC",
                "BMOV", "YIELD", "S2R", "S2UR", "CS2R", "VOTE", "VOTEU", "BPT", "KILL", "DEPBAR", "NANOSLEEP",
                "ELECT", "ACQBULK", "ENDCOLLECTIVE"},
}
_CLASS_OF = {op: name for name, ops in CLASSES.items() for op in ops}
LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)([.\w]*)\s*(.*?)\s*;")
LABEL = re.compile(r"^(\.L_x_\d+|\$?[\w$.]+):\s*$")
TARGET = re.compile(r"`\(([^)]+)\)")


def classify(opcode: str) -> str:
    """The class of a SASS opcode (without modifiers); anything unlisted is integer/logic
    (IMAD, IADD3, LOP3, SHF, LEA, ISETP, SEL, PRMT, MOV, P2R, VIADD, ... and U* twins)."""
    if opcode in _CLASS_OF:
        return _CLASS_OF[opcode]
    if opcode.startswith("U") and opcode[1:] in _CLASS_OF:
        return _CLASS_OF[opcode[1:]]
    return "integer"


@dataclass
class Instruction:
    addr: int
    opcode: str
    predicated: bool
    target: str | None  # branch/call target label


@dataclass
class Block:
    start: int  # index of its first instruction
    end: int  # one past its last
    succ: list = field(default_factory=list)


@dataclass
class HotPath:
    """Instruction counts (warp instructions, i.e. per thread) of one compiled kernel."""

    per_tile: dict  # class -> count, once around the tile loop
    per_program: dict  # class -> count, outside the loop
    total_static: int  # every instruction of the kernel's text (all paths, slow paths included)
    tile_opcodes: dict = field(default_factory=dict)  # opcode -> count once around the loop, most first

    def per_element(self, elems_per_thread: float, tiles: int) -> dict:
        return {k: (self.per_program.get(k, 0) / tiles + self.per_tile.get(k, 0)) / elems_per_thread
                for k in CLASSES}


def parse_sass(text: str) -> tuple[list[Instruction], dict[str, int]]:
    """Instructions of the first function in nvdisasm output, and label -> instruction index."""
    instrs, labels = [], {}
    for line in text.splitlines():
        lab = LABEL.match(line.strip())
        if lab and not line.lstrip().startswith("/*"):
            labels[lab.group(1)] = len(instrs)
            continue
        m = LINE.match(line)
        if not m:
            continue
        tgt = TARGET.search(m.group(5))
        # BRA.DIV jumps only when the warp is diverged (to a collective fallback): conditional
        conditional = bool(m.group(2)) or (m.group(3) == "BRA" and m.group(4).startswith(".DIV"))
        instrs.append(Instruction(int(m.group(1), 16), m.group(3), conditional, tgt.group(1) if tgt else None))
    return instrs, labels


def _blocks(instrs: list[Instruction], labels: dict[str, int]) -> tuple[list[Block], dict[int, int]]:
    leaders = {0} | {i for i in labels.values() if i < len(instrs)}
    for i, ins in enumerate(instrs):
        if ins.opcode in ("BRA", "EXIT", "RET", "BRX", "JMP") and i + 1 < len(instrs):
            leaders.add(i + 1)
    starts = sorted(leaders)
    blocks, block_of = [], {}
    for j, s in enumerate(starts):
        blocks.append(Block(s, starts[j + 1] if j + 1 < len(starts) else len(instrs)))
        block_of[s] = j
    for j, b in enumerate(blocks):
        last = instrs[b.end - 1]
        falls = b.end < len(instrs)
        if last.opcode == "BRA":
            if last.target in labels:
                b.succ.append(block_of[labels[last.target]])
            if last.predicated and falls:
                b.succ.append(j + 1)
        elif last.opcode in ("EXIT", "RET", "BRX", "JMP"):
            if last.predicated and falls:
                b.succ.append(j + 1)
        elif falls:
            b.succ.append(j + 1)
    return blocks, block_of


def _cost(instrs, b: Block) -> int:
    return sum(CALL_COST if instrs[i].opcode == "CALL" else 1 for i in range(b.start, b.end))


def _shortest(blocks, costs, src: int, dst: set[int]) -> tuple[int, list[int]]:
    """Node-weighted Dijkstra from block src (its cost included) to any block in dst."""
    dist, prev, heap = {src: costs[src]}, {}, [(costs[src], src)]
    while heap:
        d, u = heapq.heappop(heap)
        if d > dist.get(u, float("inf")):
            continue
        if u in dst:
            path = [u]
            while path[-1] in prev:
                path.append(prev[path[-1]])
            return d, path[::-1]
        for v in blocks[u].succ:
            nd = d + costs[v]
            if nd < dist.get(v, float("inf")):
                dist[v], prev[v] = nd, u
                heapq.heappush(heap, (nd, v))
    raise ValueError("no path")


def hot_path(text: str) -> HotPath:
    """Count the hot path of a kernel's SASS (module docstring)."""
    instrs, labels = parse_sass(text)
    exit_at = next(i for i, ins in enumerate(instrs) if ins.opcode == "EXIT" and not ins.predicated)
    blocks, block_of = _blocks(instrs, labels)
    costs = [_cost(instrs, b) for b in blocks]
    # the tile loop: the back edge (a branch to an earlier block, before the final EXIT) spanning most
    back = [(j, s) for j, b in enumerate(blocks) for s in b.succ
            if s <= j and instrs[b.end - 1].opcode == "BRA" and b.end - 1 <= exit_at]
    if not back:
        raise ValueError("no loop in the kernel")
    latch, head = max(back, key=lambda e: e[0] - e[1])
    exits = {j for j, b in enumerate(blocks) if instrs[b.end - 1].opcode == "EXIT"}

    def opcodes(path):  # opcode -> count, most first
        seen = Counter(instrs[i].opcode for j in path for i in range(blocks[j].start, blocks[j].end))
        return dict(sorted(seen.items(), key=lambda kv: (-kv[1], kv[0])))

    def classes(ops):  # opcode -> count  =>  class -> count
        out = dict.fromkeys(CLASSES, 0)
        for op, k in ops.items():
            out[classify(op)] += k
        return out

    def count(path):
        return classes(opcodes(path))

    _, into = _shortest(blocks, costs, 0, {head})
    _, around = _shortest(blocks, costs, head, {latch})
    after = [s for s in blocks[latch].succ if s != head]
    out_path = _shortest(blocks, costs, after[0], exits)[1] if after else []
    per_program = count(into[:-1])
    for k, v in count(out_path).items():
        per_program[k] += v
    tile = opcodes(around)
    return HotPath(per_tile=classes(tile), per_program=per_program, total_static=exit_at + 1, tile_opcodes=tile)


def nvdisasm_path() -> str | None:
    """Triton's bundled nvdisasm (triton/backends/nvidia/bin), else one on PATH."""
    try:
        import triton

        cand = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
        if os.path.exists(cand):
            return cand
    except Exception:  # noqa: BLE001 - no triton: try PATH
        pass
    return shutil.which("nvdisasm")


def disassemble(cubin: bytes) -> str:
    tool = nvdisasm_path()
    if tool is None:
        raise RuntimeError("nvdisasm not found (Triton's NVIDIA backend or a CUDA toolkit provides it)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True, timeout=120).stdout


class _Recorder:
    def __init__(self, jit):
        self.jit, self.calls = jit, []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((args, kw))


def record_launch(op: str, states: str, dtype: torch.dtype, tiles: int = 8, numel: int = 1 << 16):
    """(jit kernel, (args, kwargs)) of the launch `op` makes for `states` and parameters
    of `dtype`, with `tiles` tiles per program (CPU tensors; nothing runs)."""
    from ..quant import QuantizedState, parse_config
    from . import adamw, launch, lion, muon, sgd

    conf = parse_config(states)
    names = "mv" if op == "adamw" else "m"
    p = torch.zeros(numel, dtype=dtype)
    qs = {n: QuantizedState(conf.spec(n), p.shape) for n in names}
    member = launch.Member(p, p.clone(), {n: (q.codes, q.scales) for n, q in qs.items()},
                           torch.zeros((), dtype=torch.int64), 0,
                           out=torch.zeros(numel) if op == "muon" else None)
    lm = launch.kernel_layout(conf.m)
    if lm is None:
        raise ValueError(f"{states}: m has no kernel ({launch.why_not_covered(conf.m)})")
    batch = launch.build_batch([member], lm.block, tiles=tiles)
    scal = torch.zeros(4, dtype=torch.float32)
    kind = launch.VALUE_KINDS[dtype]
    mod = {"adamw": adamw, "lion": lion, "sgd": sgd, "muon": muon}[op]
    name = f"_{op}_kernel"
    rec = _Recorder(getattr(mod, name))
    setattr(mod, name, rec)
    try:
        if op == "adamw":
            lv = launch.kernel_layout(conf.v)
            adamw.adamw_step(batch, scal, lm, lv, p_kind=kind, g_kind=kind, step=2, written=(1, 1),
                             fresh=(False, False), beta1=0.9, beta2=0.999, eps=1e-8,
                             tables=(lm.table("cpu"), lv.table("cpu")))
        elif op == "lion":
            lion.lion_step(batch, scal, lm, p_kind=kind, g_kind=kind, step=2, written=1, fresh=False,
                           beta1=0.9, beta2=0.99, table=lm.table("cpu"))
        elif op == "sgd":
            sgd.sgd_step(batch, scal, lm, p_kind=kind, g_kind=kind, step=2, written=1, fresh=False,
                         momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, table=lm.table("cpu"))
        else:
            muon.muon_momentum_step(batch, lm, g_kind=kind, step=2, written=1, fresh=False, momentum=0.95,
                                    nesterov=True, table=lm.table("cpu"))
    finally:
        setattr(mod, name, rec.jit)
    return rec.jit, rec.calls[0]


def compile_cubin(jit, call, arch: int = 90) -> bytes:
    """Compile a recorded launch for sm_<arch> (no GPU needed): the cubin."""
    return compile_kernel(jit, call, arch).asm["cubin"]


def compile_kernel(jit, call, arch: int = 90):
    """Compile a recorded launch for sm_<arch> (no GPU needed): Triton's compiled kernel
    (its .asm holds "ptx" and "cubin")."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    args, kw = call
    kw = dict(kw)
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
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def launch_geometry(call) -> dict:
    """Tile geometry of a recorded launch: B, ROWS, warps, tiles, elements per thread per tile."""
    kw = call[1]
    warps = kw["num_warps"]
    return {"block": kw["B"], "rows": kw["ROWS"], "warps": warps, "tiles": kw["TILES"],
            "elems_per_thread": kw["ROWS"] * kw["B"] / (32 * warps)}


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def count_variant(kernel: str, states: str, param_dtype: str, tiles: int = 8) -> dict:
    """Compile one variant for sm_90 and count its hot path: SASS instructions per element by
    class (at `tiles` tiles per program), per tile and per program, the tile loop's opcodes
    (per tile, per thread), and the tile geometry."""
    jit, call = record_launch(kernel, states, DTYPES[param_dtype], tiles=tiles)
    hot = hot_path(disassemble(compile_cubin(jit, call)))
    geo = launch_geometry(call)
    return {"per_elem": hot.per_element(geo["elems_per_thread"], geo["tiles"]), "geometry": geo,
            "per_tile": sum(hot.per_tile.values()), "per_program": sum(hot.per_program.values()),
            "static": hot.total_static, "tile_opcodes": hot.tile_opcodes}


def source_fingerprint() -> str:
    """sha256 of the kernel sources and the Triton version: a cache key for counts."""
    import hashlib

    import triton

    h = hashlib.sha256(triton.__version__.encode())
    here = os.path.dirname(__file__)
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            with open(os.path.join(here, name), "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()[:16]
