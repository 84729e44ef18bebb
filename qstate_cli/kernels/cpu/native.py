"""numba intrinsics of the CPU path: fp32 bit casts, and arrays without reference counts.

numba keeps a reference count on every array and increfs / decrefs it (an atomic op, through
a call) each time a variable binds it, which includes every argument of an inlined helper;
its refcount pruning removes most pairs, not those around a helper that branches (measured:
~20% of the AdamW kernel's time, perf). The kernels therefore step on `borrowed` views of
their arguments and on `scratch_*` rows on the stack, neither of which holds a count.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array


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
        (no allocation, no reference count; lives until the kernel returns)."""
        if not isinstance(n, types.IntegerLiteral):
            return None
        count = n.literal_value
        aty = types.Array(dtype, 1, "C")

        def codegen(context, builder, signature, args):
            lty = context.get_data_type(dtype)
            ptr = cgutils.alloca_once(builder, lty, size=count)
            out = context.make_array(aty)(context, builder)
            itemsize = context.get_abi_sizeof(lty)
            populate_array(out, data=ptr, shape=cgutils.pack_array(builder, [context.get_constant(types.intp, count)]),
                           strides=cgutils.pack_array(builder, [context.get_constant(types.intp, itemsize)]),
                           itemsize=context.get_constant(types.intp, itemsize), meminfo=None)
            return out._getvalue()
        return aty(n), codegen
    return scratch


scratch_f32 = _scratch(types.float32)
scratch_i32 = _scratch(types.int32)
