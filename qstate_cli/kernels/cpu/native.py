"""numba intrinsics of the CPU path: fp32 bit casts, two fp32 entries in one load, 32-bit
shifts by run-time amounts, arrays without reference counts, and the vector width it compiles
for (wide_features).

numba keeps a reference count on every array and increfs / decrefs it (an atomic op, through
a call) each time a variable binds it, which includes every argument of an inlined helper;
its refcount pruning removes most pairs, not those around a helper that branches (measured:
~20% of the AdamW kernel's time, perf). The kernels therefore step on `borrowed` views of
their arguments and on `scratch_*` rows on the stack, neither of which holds a count.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core.codegen import get_host_cpu_features
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array


# An argument written as a constant (0, True) is typed Literal[int](0) / Literal[bool](True), so a
# kernel called with 0 at one site and a variable at another is compiled twice (chunk_windows,
# float_gaps, row_sum, _cascade: the default demo's first use 79-83 -> 64-66 s of compiling,
# docs/cpu.md "Compile time: constants typed, not literal"); these are typed int64 / bool.
ROW0 = np.int64(0)
YES, NO = np.bool_(True), np.bool_(False)


# ---- bit casts ------------------------------------------------------------------------------------
@intrinsic
def f32_from_bits(typingctx, x):
    """The fp32 whose bit pattern is the uint32 x."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def bits_of_f32(typingctx, x):
    """The bit pattern (uint32) of the fp32 x."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def pair_at(typingctx, arr, i):
    """The 8 bytes of arr[i] and arr[i + 1] (a 1-D fp32 array) as one uint64: arr[i]'s bits in
    the low 32, arr[i + 1]'s in the high 32 (x86 and Arm are little-endian). One load where two
    would each be a scalar load of a computed index (search.floor_codes: ~0.2 ns a load and as
    much a store). The caller keeps i + 1 in bounds (nothing is checked)."""
    if not isinstance(arr, types.Array) or arr.dtype != types.float32 or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        a = context.make_array(signature.args[0])(context, builder, value=args[0])
        at = builder.gep(a.data, [context.cast(builder, args[1], signature.args[1], types.intp)])
        value = builder.load(builder.bitcast(at, ir.IntType(64).as_pointer()))
        value.align = 4  # an fp32 array's alignment
        return value
    return types.uint64(arr, i), codegen


# ---- 32-bit shifts -------------------------------------------------------------------------------
# numba widens a shift of int32 / uint32 operands to 64 bits, and LLVM keeps a shift by a run-time
# amount there: a vector loop then runs half as many lanes and converts each row to 64 bits and
# back (replay_model_kernel.float_gaps, whose minifloat's mantissa width is an argument: a bf16
# state's model pass took 4.1-4.7 ns an element with them, 2.4-2.8 with these; docs/cpu.md,
# "32-bit shifts"). These shift the low 32 bits of x by s in
# [0, 31] (LLVM's shl / lshr / ashr on i32, undefined from 32 on: callers clamp): the same bits as
# the widened shift truncated to 32, for shl32 at any width of x, for shr32 and sar32 where x has
# at most 32 bits (as every caller's: a uint32 or int32 value, if typed int64).
def _low32(builder, value, ty):
    if ty.bitwidth > 32:
        return builder.trunc(value, ir.IntType(32))
    if ty.bitwidth < 32:
        return (builder.sext if ty.signed else builder.zext)(value, ir.IntType(32))
    return value


def _shift32(op: str, result, x, s):
    """The signature and codegen of a 32-bit shift `op` of integers x by s, typed `result`."""
    if not (isinstance(x, types.Integer) and isinstance(s, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        a, b = (_low32(builder, v, t) for v, t in zip(args, signature.args))
        return getattr(builder, op)(a, b)
    return result(x, s), codegen


@intrinsic
def shl32(typingctx, x, s):
    """(x << s) mod 2**32 as uint32: x's low 32 bits shifted left by s in [0, 31]."""
    return _shift32("shl", types.uint32, x, s)


@intrinsic
def shr32(typingctx, x, s):
    """x's low 32 bits, as unsigned, shifted right by s in [0, 31] (zeros shifted in): uint32."""
    return _shift32("lshr", types.uint32, x, s)


@intrinsic
def sar32(typingctx, x, s):
    """x's low 32 bits, as signed, shifted right by s in [0, 31] (the sign shifted in): int32."""
    return _shift32("ashr", types.int32, x, s)


# ---- arrays without reference counts -----------------------------------------------------------
def _borrow(context, builder, aty, value):
    src = context.make_array(aty)(context, builder, value=value)
    out = context.make_array(aty)(context, builder)
    populate_array(out, data=src.data, shape=src.shape, strides=src.strides, itemsize=src.itemsize, meminfo=None)
    return out._getvalue()


@intrinsic
def borrowed(typingctx, arrays):
    """Views of a tuple of arrays with no reference count (meminfo NULL), in the same order.
    Only for arrays that outlive every use of the views (a kernel's arguments)."""
    if not isinstance(arrays, types.BaseTuple) or not all(isinstance(t, types.Array) for t in arrays):
        return None

    def codegen(context, builder, signature, args):
        views = [_borrow(context, builder, aty, builder.extract_value(args[0], i)) for i, aty in enumerate(arrays)]
        return context.make_tuple(builder, signature.return_type, views)
    return arrays(arrays), codegen


def _scratch(dtype):
    @intrinsic
    def scratch(typingctx, n):
        """An uninitialized 1-D array of n (a compile-time constant) elements on the stack
        (no allocation, no reference count; lives until the kernel returns), starting on a
        64-byte cache line: the stack's own offset is random to 16 bytes per process, and a row
        off the line made each 512-bit access span two (docs/cpu.md, "A Zen 4 EPYC")."""
        if not isinstance(n, types.IntegerLiteral):
            return None
        count = n.literal_value
        aty = types.Array(dtype, 1, "C")

        def codegen(context, builder, signature, args):
            lty = context.get_data_type(dtype)
            ptr = cgutils.alloca_once(builder, lty, size=count)
            ptr.align = 64
            out = context.make_array(aty)(context, builder)
            itemsize = context.get_abi_sizeof(lty)
            populate_array(out, data=ptr, shape=cgutils.pack_array(builder, [context.get_constant(types.intp, count)]),
                           strides=cgutils.pack_array(builder, [context.get_constant(types.intp, itemsize)]),
                           itemsize=context.get_constant(types.intp, itemsize), meminfo=None)
            return out._getvalue()
        return aty(n), codegen
    return scratch


# ---- arrays at an address (the multi-tensor launch: host.MemberTable) -------------------------------
def _view(fixed):
    @intrinsic
    def view(typingctx, like, addr, n):
        """The 1-D array of n elements at integer address addr, of like's array type (or of
        the fixed dtype, like then being any value): no reference count, as `borrowed`.
        Only for memory that outlives every use (a launch's tensors, kept alive by its caller)."""
        if not isinstance(addr, types.Integer) or not isinstance(n, types.Integer):
            return None
        if fixed is None:
            if not isinstance(like, types.Array):
                return None
            aty = types.Array(like.dtype, 1, "C")
        else:
            aty = types.Array(fixed, 1, "C")

        def codegen(context, builder, signature, args):
            lty = context.get_data_type(aty.dtype)
            ptr = builder.inttoptr(args[1], lty.as_pointer())
            count = context.cast(builder, args[2], signature.args[2], types.intp)
            itemsize = context.get_abi_sizeof(lty)
            out = context.make_array(aty)(context, builder)
            populate_array(out, data=ptr, shape=cgutils.pack_array(builder, [count]),
                           strides=cgutils.pack_array(builder, [context.get_constant(types.intp, itemsize)]),
                           itemsize=context.get_constant(types.intp, itemsize), meminfo=None)
            return out._getvalue()
        return aty(like, addr, n), codegen
    return view


view_like = _view(None)  # view_like(an array of the dtype, address, n)
view_u8 = _view(types.uint8)  # view_u8(0, address, n): codes
view_u16 = _view(types.uint16)  # scale words
view_f32 = _view(types.float32)


scratch_f32 = _scratch(types.float32)
scratch_f64 = _scratch(types.float64)
scratch_i32 = _scratch(types.int32)
scratch_u64 = _scratch(types.uint64)


# ---- a compiled kernel called by its address (the team launches: replay_step_kernel) ------------
@intrinsic
def call_compiled(typingctx, addr, args):
    """fn(*args) for fn the numba-compiled function at integer address addr whose argument
    types are exactly those of the tuple args and which returns an int64 (numba's own calling
    convention: a return slot, an exception slot, then each argument's members). Its code is
    not linked into the caller, so the caller compiles in seconds where a direct call links
    and optimizes the whole callee again. The caller (host) takes addr from the callee's
    dispatcher for these argument types (compiled_address); anything else is undefined."""
    if not isinstance(addr, types.Integer) or not isinstance(args, types.BaseTuple):
        return None
    argtys = tuple(types.unliteral(t) for t in args)

    def codegen(context, builder, signature, llargs):
        conv = context.call_conv
        fnty = conv.get_function_type(types.int64, argtys)
        fn = builder.inttoptr(llargs[0], fnty.as_pointer())  # a pointer to the function type: callable
        vals = [context.cast(builder, builder.extract_value(llargs[1], i), args[i], argtys[i])
                for i in range(len(argtys))]
        ret = cgutils.alloca_once(builder, conv.get_return_type(types.int64).pointee)
        builder.store(cgutils.get_null_value(ret.type.pointee), ret)
        exc = cgutils.alloca_once(builder, fnty.args[1].pointee, name="excinfo")
        packed = list(conv._get_arg_packer(argtys).as_arguments(builder, vals))
        builder.call(fn, [ret, exc] + packed)
        return builder.load(ret)
    return types.int64(addr, args), codegen


def compiled_address(dispatcher, args: tuple) -> int:
    """The address of dispatcher's code for the numba types of args (compiled, or loaded
    from numba's cache, first), for call_compiled."""
    key = tuple(dispatcher.typeof_pyval(a) for a in args)
    if key not in dispatcher.overloads:
        dispatcher.compile(key)
    cres = dispatcher.overloads[key]
    return int(cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name))


# ---- the compile target ----------------------------------------------------------------------
def wide_features() -> str | None:
    """The CPU features to compile the kernels for (numba.config.CPU_FEATURES): the host's plus
    "-prefer-256-bit" where the host has AVX-512, else None (numba's default, the host's).

    LLVM's tuning for the AVX-512 cores (icelake, rocketlake, sapphirerapids, ...) prefers
    256-bit vectors (down-clocking on older Xeons); the kernels are bound by instruction
    throughput (the hash's 32-bit multiplies, the divider, the rounding), so 512-bit vectors
    halve the instructions per element: sr-4bit's raw kernel 13.4 -> 5.6 ms per 4M elements
    (docs/cpu.md, "512-bit vectors"). Every op stays the same correctly rounded fp32 or uint32
    op per element (fastmath off), so the codes and parameters are the same bits at either
    width (tests/test_kernels_cpu_cache.py runs one at 256). numba keys its disk cache by the
    features, so the two widths never load each other's code."""
    features = get_host_cpu_features()
    return features + ",-prefer-256-bit" if "+avx512f" in features.split(",") else None
