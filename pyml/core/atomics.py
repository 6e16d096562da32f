"""Atomic counters for compiled code: how the threads of one parallel region share out work and
meet between its steps without leaving the region.

Why: a Numba `prange` is a parallel launch (a few µs, more on a loaded machine) and a join at
its end, where the faster thread waits out the slower one's share. A decode step
of a small model makes ~5 of them per layer. One region for the whole step, whose threads claim
pieces of each op from a counter and wait for the op's pieces to be done before the next op,
replaces them with a few shared-cache-line operations (nn/decode_kernels.py, `decode_region`).

The counters are int64 arrays; `fetch_add` is a sequentially consistent `lock xadd`, `load` an
acquire load: the writes a thread makes before it counts a piece done are seen by a thread that
reads the count after them. `fetch_max` keeps the largest value written (a traced region's
"last piece done" tick). `pause` is x86's spin-wait hint (nothing elsewhere).
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def _element_pointer(context, builder, array_type, array, index_type, index):
    arr = context.make_array(array_type)(context, builder, array)
    i = context.cast(builder, index, index_type, types.intp)
    return builder.gep(arr.data, [i])


def _read_modify_write(operation: str, doc: str):
    """An intrinsic doing `counters[index] = operation(counters[index], value)` atomically and
    returning the value before (int64)."""
    def typer(typingctx, counters, index, value):
        if not (isinstance(counters, types.Array) and counters.dtype == types.int64
                and isinstance(index, types.Integer) and isinstance(value, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            ptr = _element_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            v = context.cast(builder, args[2], sig.args[2], types.int64)
            return builder.atomic_rmw(operation, ptr, v, "seq_cst")

        return types.int64(counters, index, value), codegen

    typer.__doc__ = doc
    typer.__name__ = typer.__qualname__ = f"fetch_{operation}"  # the two intrinsics keep distinct names
    return intrinsic(typer)


fetch_add = _read_modify_write("add", "counters[index] += value, atomically; returns the value before (int64).")
fetch_max = _read_modify_write("max", "counters[index] = max(counters[index], value), atomically (signed); "
                                      "returns the value before.")


@intrinsic
def load(typingctx, counters, index):
    """counters[index], read with acquire ordering (never cached in a register across a spin)."""
    if not (isinstance(counters, types.Array) and counters.dtype == types.int64 and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(counters, index), codegen


@intrinsic
def pause(typingctx):
    """The spin-wait hint: lets the sibling hyperthread run and saves power while a thread waits."""
    def codegen(context, builder, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen
